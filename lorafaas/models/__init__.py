"""Model surgery and LoRA math: meta-model binding, unmerged LoRA ops, the plain transformers reference."""
