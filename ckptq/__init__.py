"""ckptq: blockwise 8-bit optimizer state for PyTorch checkpoints.

    import ckptq
    report = ckptq.convert("ckpt.pt")                 # -> ckpt.q8.safetensors
    ckpt = ckptq.load("ckpt.q8.safetensors")          # quantized states stay quantized
    ckptq.save(ckpt, "copy.q8.safetensors")
    ckptq.expand("ckpt.q8.safetensors", "ckpt_fp32.pt")
"""

__version__ = "0.1.0"

from .errors import CkptqError  # noqa: E402
from .pipeline import convert, expand, load, save  # noqa: E402

__all__ = ["convert", "expand", "load", "save", "CkptqError", "__version__"]
