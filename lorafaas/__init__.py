"""lorafaas: each LoRA adapter deployed as an isolated serverless function on a shared backbone."""

__version__ = "0.1.0"
