"""The function worker: staged loading, unmerged LoRA inference, generation with continuous batching, the zygote."""
