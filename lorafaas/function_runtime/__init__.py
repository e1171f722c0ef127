"""The function worker: staged loading, unmerged LoRA inference, generation, batch executor."""
