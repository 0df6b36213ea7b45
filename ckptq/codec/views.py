"""Tensors as views of their storage."""

from __future__ import annotations

import torch

QUANTIZABLE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def repeats_bytes(t: torch.Tensor) -> bool:
    """Whether some elements of ``t`` share memory: a stride of 0 along a dimension longer than 1 (an
    ``expand``ed tensor), or strides that interleave. Such a tensor holds fewer bytes than its elements
    need, so reading it element by element (to quantize, or to decode its codes) would make output
    that no input bytes back: a 4-byte storage claiming 2**40 elements."""
    span = 1  # elements spanned by the dimensions taken so far, from the innermost
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride < span:
            return True
        span += stride * (size - 1)
    return False


def unbacked(t: torch.Tensor) -> str | None:
    """Why the elements of ``t`` are not each backed by bytes of their own in its storage, or None when they
    are: a view that repeats its bytes (``repeats_bytes``), or one that reaches past its storage. Checked
    before a tensor of someone else's making is read element by element, so that what is allocated for it
    stays in proportion to the bytes it holds."""
    if t.numel() == 0:
        return None
    if repeats_bytes(t):
        return "a view that repeats its bytes (stride 0 or overlapping strides)"
    last = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    if (last + 1) * t.element_size() > t.untyped_storage().nbytes():
        return "a view that reaches past its storage"
    return None


def storage_key(t: torch.Tensor) -> tuple:
    """Equal for tensors that share one storage. A wrapper tensor subclass (torchao's optimizer states,
    DTensor) has no storage of its own, so it shares none: keyed by identity."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__"):
        return ("wrapper", id(t))
    if t.layout != torch.strided:  # sparse and other layouts have no one storage
        return ("layout", id(t))
    s = t.untyped_storage()
    return (t.device.type, s.data_ptr(), s.nbytes()) if s.nbytes() else ("empty", id(t))


def is_quantizable(t: object, min_size: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.dtype in QUANTIZABLE_DTYPES
            and t.numel() >= min_size)
