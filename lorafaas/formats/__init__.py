"""File formats and stores every process shares: safetensors, PEFT and expert adapters, the model store."""
