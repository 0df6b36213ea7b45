"""ckptq: blockwise 8-bit optimizer state for PyTorch checkpoints."""

__version__ = "0.1.0"
