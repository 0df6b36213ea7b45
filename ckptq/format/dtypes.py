"""The one dtype table: torch dtypes, their safetensors names (``F32``...) and the names ckptq's skeleton
and qstates record (``float32``...)."""

from __future__ import annotations

import torch

from ..errors import FormatError

# torch dtype -> safetensors dtype name (what a header entry records)
SAFETENSORS_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: how the skeleton, qstates and DCP scalars name a dtype."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name) -> torch.dtype:
    """The torch dtype a recorded name stands for; FormatError for anything else (never an attribute
    of torch that is not a dtype)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() and name[0] != "_" else None
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"unknown dtype {str(name)[:40]!r} in file; upgrade ckptq or check the file")
    return dtype


def float_dtype_from_name(name, what: str) -> torch.dtype:
    """``dtype_from_name`` for a state's original dtype, which must be floating point."""
    try:
        dtype = dtype_from_name(name)
    except FormatError:
        dtype = None
    if dtype is None or not dtype.is_floating_point:
        raise FormatError(f"{what} names dtype {str(name)[:40]!r}, not a floating-point dtype; it is corrupt")
    return dtype
