"""Triton blockwise 8-bit quantize/dequantize, bit-for-bit equal to the reference in ``ckptq.codec``.

Each program handles ``ROWS`` consecutive quantization blocks as a ``[ROWS, BLOCK_SIZE]`` tile, so
small block sizes still give every program ~2048 contiguous elements (coalesced, vectorized loads).
Rounding is a branch-free binary search over the 255 codebook midpoints, as in bitsandbytes'
``kQuantizeBlockwise`` (csrc/kernels.cu). Exactness on CUDA needs the IEEE-rounded
``tl.math.div_rn`` / ``tl.math.sqrt_rn``: Triton's ``/`` and ``tl.sqrt`` on fp32 are approximate there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ckptq.codec import TRANSFORMS, check_block_size, check_codebook, check_quantized, midpoints, num_blocks, output_buffer
from ckptq.errors import UsageError

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TILE = 2048  # elements per program when blocks are small


@triton.jit
def _quantize_kernel(
    x_ptr,  # [n] fp32/bf16/fp16, contiguous: the values to quantize
    thresholds_ptr,  # [255] fp32, ascending: midpoints between neighbouring codebook entries
    codes_ptr,  # [n] uint8 out: number of midpoints below each normalized value
    absmax_ptr,  # [n_blocks] fp32 out: max |x| (after the transform) of each block
    n,  # number of elements
    n_blocks,  # ceil(n / BLOCK_SIZE)
    BLOCK_SIZE: tl.constexpr,  # quantization block, a power of two 64..4096
    ROWS: tl.constexpr,  # quantization blocks per program
    SQRT: tl.constexpr,  # store sqrt(x) instead of x
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)  # [ROWS] block indices, int64
    offs = rows[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]  # [ROWS, BLOCK_SIZE]
    mask = offs < n
    # Padding loads 0, which never wins the absmax and is discarded on store (as the reference pads).
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SQRT:
        x = tl.math.sqrt_rn(x)
    # tl.max skips NaNs but torch's amax returns NaN: put it back, so even NaN blocks match. (A
    # tl.reduce with a NaN-propagating combine does the same but is ~20x slower in the interpreter.)
    ax = tl.abs(x)
    has_nan = tl.max((ax != ax).to(tl.int32), axis=1) > 0  # [ROWS]
    absmax = tl.where(has_nan, float("nan"), tl.max(ax, axis=1))  # [ROWS]
    safe = tl.where(absmax > 0, absmax, 1.0)  # all-zero block: divide by 1 so codes are those of 0
    y = tl.math.div_rn(x, safe[:, None])  # [ROWS, BLOCK_SIZE], IEEE division like torch
    # code = #{j : t[j] < y}. Invariant: t[pos - 1] < y. Testing "not t >= y" sends NaN to 255,
    # like torch.searchsorted. Probed indices stay within 0..254, so no padding entry is needed.
    pos = tl.zeros([ROWS, BLOCK_SIZE], dtype=tl.int32)
    for level in tl.static_range(8):
        step = 128 >> level
        t = tl.load(thresholds_ptr + pos + (step - 1))
        pos = tl.where(t >= y, pos, pos + step)
    tl.store(codes_ptr + offs, pos.to(tl.uint8), mask=mask)
    tl.store(absmax_ptr + rows, absmax, mask=rows < n_blocks)


@triton.jit
def _dequantize_kernel(
    codes_ptr,  # [n] uint8: codebook indices
    absmax_ptr,  # [n_blocks] fp32: per-block scales
    qmap_ptr,  # [256] fp32: the codebook
    out_ptr,  # [n] fp32 out: qmap[code] * absmax[block], squared when SQRT
    n,  # number of elements
    n_blocks,  # ceil(n / BLOCK_SIZE)
    BLOCK_SIZE: tl.constexpr,  # quantization block, a power of two 64..4096
    ROWS: tl.constexpr,  # quantization blocks per program
    SQRT: tl.constexpr,  # codes store sqrt(x): square on decode
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)  # [ROWS] block indices, int64
    offs = rows[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]  # [ROWS, BLOCK_SIZE]
    mask = offs < n
    codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(absmax_ptr + rows, mask=rows < n_blocks, other=0.0)  # [ROWS]
    vals = tl.load(qmap_ptr + codes) * scale[:, None]  # two separate roundings, no FMA to contract
    if SQRT:
        vals = vals * vals
    tl.store(out_ptr + offs, vals, mask=mask)


def _launch_shape(block_size: int) -> tuple[int, int]:
    """(blocks per program, warps): ~2048 elements per program, 8 warps for 4096-element blocks."""
    rows = max(1, _TILE // block_size)
    return rows, (8 if rows * block_size > _TILE else 4)


def _check_common(qmap: torch.Tensor, block_size: int, transform: str) -> None:
    check_block_size(block_size)
    if transform not in TRANSFORMS:
        raise UsageError(f"transform {transform!r} is not one of {', '.join(TRANSFORMS)}")
    check_codebook(qmap)
    if qmap.dtype != torch.float32:
        raise UsageError(f"codebook must be float32 for the Triton kernels, got {qmap.dtype}")


def quantize_blockwise(
    x: torch.Tensor, qmap: torch.Tensor, block_size: int, transform: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``ckptq.codec.quantize_blockwise``: ``(codes uint8 [numel], absmax fp32 [n_blocks])``.

    ``x`` may have any shape and be fp32, bf16 or fp16; it is read, never written.
    """
    _check_common(qmap, block_size, transform)
    if x.dtype not in _INPUT_DTYPES:
        raise UsageError(f"cannot quantize a {x.dtype} tensor; convert it to float32, bfloat16 or float16")
    flat = x.detach().reshape(-1).contiguous()
    n, n_blocks = flat.numel(), num_blocks(flat.numel(), block_size)
    thresholds = midpoints(qmap.to(flat.device)).contiguous()  # [255], same fp32 values as the reference
    codes = torch.empty(n, dtype=torch.uint8, device=flat.device)
    absmax = torch.empty(n_blocks, dtype=torch.float32, device=flat.device)
    if n == 0:
        return codes, absmax
    _launch(_quantize_kernel, block_size, transform, flat, thresholds, codes, absmax, n, n_blocks)
    return codes, absmax


def _launch(kernel, block_size: int, transform: str, *args) -> None:
    """Run a codec kernel over args (..., n, n_blocks): ROWS blocks per program."""
    rows, warps = _launch_shape(block_size)
    grid = (triton.cdiv(args[-1], rows),)
    kernel[grid](*args, BLOCK_SIZE=block_size, ROWS=rows, SQRT=transform == "sqrt", num_warps=warps)


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor, block_size: int, transform: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of ``ckptq.codec.dequantize_blockwise``: fp32 ``[codes.numel()]`` (into ``out``
    when given: a contiguous fp32 tensor of that many elements on the same device)."""
    _check_common(qmap, block_size, transform)
    check_quantized(codes, absmax, qmap, block_size)
    flat = codes.reshape(-1).contiguous()
    n, n_blocks = flat.numel(), num_blocks(codes.numel(), block_size)
    scales = absmax.reshape(-1).to(torch.float32).contiguous()
    table = qmap.to(flat.device).contiguous()
    out = output_buffer(out, n, flat.device)
    if n == 0:
        return out
    _launch(_dequantize_kernel, block_size, transform, flat, scales, table, out, n, n_blocks)
    return out
