"""megatrain-ray: train large language models on one GPU from host memory, orchestrated by Ray."""

__version__ = "0.1.0"
