"""Blockwise 8-bit quantization: codebooks, and the PyTorch reference of quantize/dequantize.

A tensor is flattened and cut into blocks of ``block_size`` values (the last block may be short).
Each block is divided by its absmax (an fp32 scale), and every normalized value in [-1, 1] is
rounded to the nearest entry of a sorted 256-entry codebook; the code is that entry's index.
Method: Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022).

Rounding rule (the contract the Triton kernels reproduce bit for bit): with ``t = midpoints(qmap)``
(255 fp32 values ``(q[i] + q[i+1]) / 2``), ``code = #{j : t[j] < y}`` where ``y = x / absmax`` is an
IEEE fp32 division. Ties go to the lower code. An all-zero block gets absmax 0 and the code of 0.

Transforms change what is stored, not how: ``"sqrt"`` stores ``sqrt(x)`` (x >= 0, for second
moments: it halves the number of decades the codebook must span) and decodes ``s * s``.

The functions here are the CPU path and the reference; ``backend="triton"`` runs the kernels in
``ckptq.kernels.quant`` with identical signatures and results.
"""

from __future__ import annotations

import torch

from .errors import UsageError

BLOCK_SIZES = tuple(2**k for k in range(6, 13))  # 64 ... 4096
DEFAULT_BLOCK_SIZE = 256
TRANSFORMS = ("none", "sqrt")
BACKENDS = ("auto", "torch", "triton")
_CHUNK_BLOCKS = 1 << 14  # blocks per chunk on the CPU path: bounds temporaries to a few MB


def midpoints(qmap: torch.Tensor) -> torch.Tensor:
    """Decision thresholds between neighbouring codebook entries: 255 fp32 values."""
    q = qmap.to(torch.float32)
    return (q[:-1] + q[1:]) / 2.0


def check_codebook(qmap: torch.Tensor) -> None:
    if qmap.dtype != torch.float32 or qmap.shape != (256,):
        raise UsageError(f"codebook must be a float32 tensor of 256 entries, got {qmap.dtype} {tuple(qmap.shape)}")
    if not bool((qmap[1:] > qmap[:-1]).all()):
        raise UsageError("codebook entries must be strictly increasing")
    if not bool((qmap == 0).any()) or qmap[0] < -1 or qmap[-1] > 1:
        raise UsageError("codebook must contain 0 and lie within [-1, 1]")


def check_block_size(block_size: int) -> int:
    if block_size not in BLOCK_SIZES:
        raise UsageError(f"block size {block_size} is not supported; use a power of two from 64 to 4096")
    return block_size


def num_blocks(numel: int, block_size: int) -> int:
    return (numel + block_size - 1) // block_size


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise UsageError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def _check_transform(transform: str) -> None:
    if transform not in TRANSFORMS:
        raise UsageError(f"transform {transform!r} is not one of {', '.join(TRANSFORMS)}")


def _quantize_chunk(x: torch.Tensor, thresholds: torch.Tensor, block_size: int, transform: str):
    """x: fp32 [n] with n a multiple of block_size, except possibly the tensor's last chunk."""
    n = x.numel()
    nb = num_blocks(n, block_size)
    pad = nb * block_size - n
    if transform == "sqrt":
        x = torch.sqrt(x)
    blocks = torch.nn.functional.pad(x, (0, pad)).view(nb, block_size)  # [nb, B]; zero padding never wins absmax
    absmax = blocks.abs().amax(dim=1)  # [nb]
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    y = blocks / safe[:, None]  # IEEE division, as the kernels do
    codes = torch.searchsorted(thresholds, y, right=False, out_int32=True)  # #{t < y}
    return codes.view(-1)[:n].to(torch.uint8), absmax


def quantize_blockwise(
    x: torch.Tensor,
    qmap: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    transform: str = "none",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (any float dtype and shape) blockwise.

    Returns ``(codes, absmax)``: ``codes`` uint8 of shape ``[x.numel()]`` and ``absmax`` fp32 of
    shape ``[ceil(numel / block_size)]``, both on ``x.device``. NaN/Inf inputs are not checked here
    (callers keep such tensors exact); ``transform="sqrt"`` requires ``x >= 0``.
    """
    check_block_size(block_size)
    _check_transform(transform)
    if _resolve_backend(backend, x.device) == "triton":
        from .kernels import quant

        return quant.quantize_blockwise(x, qmap, block_size, transform)
    flat = x.detach().reshape(-1).to(torch.float32)
    thresholds = midpoints(qmap.to(flat.device))
    chunk = _CHUNK_BLOCKS * block_size
    codes = torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device)
    absmax = torch.empty(num_blocks(flat.numel(), block_size), dtype=torch.float32, device=flat.device)
    for start in range(0, flat.numel(), chunk):
        c, a = _quantize_chunk(flat[start : start + chunk], thresholds, block_size, transform)
        codes[start : start + c.numel()] = c
        absmax[start // block_size : start // block_size + a.numel()] = a
    return codes, absmax


def dequantize_blockwise(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    qmap: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    transform: str = "none",
    backend: str = "auto",
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: fp32 tensor of shape ``[codes.numel()]``.

    Value = ``qmap[code] * absmax[block]``, squared afterwards when ``transform == "sqrt"``.
    """
    check_block_size(block_size)
    _check_transform(transform)
    if _resolve_backend(backend, codes.device) == "triton":
        from .kernels import quant

        return quant.dequantize_blockwise(codes, absmax, qmap, block_size, transform)
    n = codes.numel()
    qmap = qmap.to(device=codes.device, dtype=torch.float32)
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    chunk = _CHUNK_BLOCKS * block_size
    for start in range(0, n, chunk):
        c = codes.reshape(-1)[start : start + chunk]
        vals = qmap[c.to(torch.int64)]
        nb = num_blocks(c.numel(), block_size)
        scale = absmax[start // block_size : start // block_size + nb].repeat_interleave(block_size)[: c.numel()]
        vals = vals * scale
        if transform == "sqrt":
            vals = vals * vals
        out[start : start + c.numel()] = vals
    return out
