"""One module per process protocol: the backbone daemon's and the MoE LoRA server's messages and clients."""
