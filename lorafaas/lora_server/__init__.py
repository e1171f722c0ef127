"""The MoE LoRA server: one process per (device, MoE backbone) computing the experts' LoRA deltas."""
