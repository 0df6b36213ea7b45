"""The Triton backend (CUDA): blockwise quantize and dequantize, and the per-parameter steps of the older
contract (``adam_step``, ``momentum_step``) as groups of one of the one step's template (``triton_step``,
launched by ``triton_group``).

Signatures and contract in ``contract``; results equal ``backend_torch`` bit for bit, NaN and Inf
included, in the row layout (``ROWS``: rows of any length, blocks that never cross a row). Each program
handles ``ROWS`` consecutive quantization blocks as a ``[ROWS, BLOCK]`` tile (``triton_blocks``), so small
block sizes still give every program ~2048 contiguous elements (coalesced, vectorized loads); a block's
row, column, code bytes and scale come from its index.
Importing this module imports triton: ``ckptq.codec.ops`` does so only on the Triton path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import single, triton_blocks as tb
from . import triton_group
from .contract import MomentumFlags, StepFlags, StepState, is_flat, layout_rows, num_blocks

ROWS = True  # quantize, dequantize, adam_step and momentum_step take rows that are not whole blocks
__all__ = ["ROWS", "quantize", "dequantize", "adam_step", "momentum_step"]


@triton.jit
def _quantize_kernel(
    x_ptr,  # [n] fp32/bf16/fp16: the values to quantize
    tree_ptr,  # [2**BITS] fp32: the codebook's midpoints in search-tree order (triton_blocks.search_tree)
    codes_ptr,  # uint8 [rows * code_bytes(row_len, BITS)] out
    absmax_ptr,  # fp32 [n_blocks] out: max |x| (after the transform) of each block
    n_blocks, row_len,  # all blocks of all rows; elements per row
    BLOCK: tl.constexpr, ROWS: tl.constexpr,  # quantization block (64..4096), blocks per program
    SQRT: tl.constexpr,  # store sqrt(x) instead of x
    BITS: tl.constexpr,  # code width: 8 (a byte per code), 6, 4 or 2 (packed)
    ALIGNED: tl.constexpr,  # row_len is a multiple of 16 (triton_blocks.geometry)
):
    first = tl.program_id(0).to(tl.int64) * ROWS
    b, bmask, r, col0, offs, mask = tb.geometry(first, n_blocks - first, row_len, BLOCK, ROWS)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SQRT:
        x = tl.math.sqrt_rn(x)
    codes, absmax = tb.encode(x, mask, tree_ptr, BITS)
    tb.store(codes, absmax, codes_ptr, absmax_ptr, b, bmask, r, col0, mask, row_len, BLOCK, ROWS, BITS, ALIGNED)


@triton.jit
def _dequantize_kernel(
    codes_ptr, absmax_ptr, qmap_ptr,  # the row layout's codes and scales, fp32 [2**BITS] codebook
    out_ptr,  # [n] fp32 out: qmap[code] * absmax[block], squared when SQRT
    n_blocks, row_len,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, SQRT: tl.constexpr, BITS: tl.constexpr, ALIGNED: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * ROWS
    b, bmask, r, col0, offs, mask = tb.geometry(first, n_blocks - first, row_len, BLOCK, ROWS)
    vals = tb.decode(codes_ptr, absmax_ptr, qmap_ptr, b, bmask, r, col0, mask, row_len, BLOCK, BITS, ALIGNED)
    if SQRT:
        vals = vals * vals
    tl.store(out_ptr + offs, vals, mask=mask)


def _launch(kernel, n: int, row_len, block_size: int, *args, **constexprs) -> None:
    """Run a kernel over the blocks of n elements in rows of ``row_len`` (None: one row; a layout that is
    the flat one runs as one row), tiles as ``triton_blocks.tile_shape`` cuts them."""
    if n == 0:
        return
    rows, length = layout_rows(n, None if is_flat(n, row_len, block_size) else row_len)
    block, per_program, warps = tb.tile_shape(block_size, length)
    nb = rows * num_blocks(length, block)
    kernel[(triton.cdiv(nb, per_program),)](*args, nb, length, BLOCK=block, ROWS=per_program, ALIGNED=length % 16 == 0,
                                            num_warps=warps, **constexprs)


def quantize(src, thresholds, block_size: int, sqrt: bool, codes, absmax, bits: int = 8, row_len=None) -> None:
    _launch(_quantize_kernel, src.numel(), row_len, block_size, src, tb.search_tree(thresholds), codes, absmax, SQRT=sqrt,
            BITS=bits)


def dequantize(codes, absmax, qmap, block_size: int, sqrt: bool, out, fresh: bool, bits: int = 8,
               row_len=None) -> None:
    _launch(_dequantize_kernel, out.numel(), row_len, block_size, codes, absmax, qmap, out, SQRT=sqrt, BITS=bits)


def adam_step(p, g, states: tuple[StepState, ...], h, flags: StepFlags) -> None:
    """``contract``'s adam_step: a group of one (``single.adam_group``)."""
    triton_group.step(single.adam_group(p, g, states, h, flags))


def momentum_step(p, g, state: StepState, h, out, flags: MomentumFlags) -> None:
    """``contract``'s momentum_step: a group of one (``single.momentum_group``)."""
    triton_group.step(single.momentum_group(p, g, state, h, out, flags))
