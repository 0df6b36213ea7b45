"""The Triton backend (CUDA): blockwise quantize, dequantize and the fused low-bit Adam step, one parameter
per call or a group of them in one launch (``triton_group``).

Signatures and contract in ``contract``; results equal ``backend_torch`` bit for bit, NaN and Inf
included, in the row layout (``ROWS``: rows of any length, blocks that never cross a row). Each program
handles ``ROWS`` consecutive quantization blocks as a ``[ROWS, BLOCK]`` tile (``triton_blocks``), so small
block sizes still give every program ~2048 contiguous elements (coalesced, vectorized loads); a block's
row, column, code bytes and scale come from its index. The step takes a width per moment; its scalars
are kernel arguments here and come from a per-member table in the grouped kernels.
Importing this module imports triton: ``ckptq.ops`` does so only on the Triton path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import memo
from . import triton_blocks as tb
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


@triton.jit(do_not_specialize=["seed"])
def _adam_kernel(
    p_ptr, g_ptr,  # param [n] (updated in place), grad [n]
    decay, l2, omb1, beta2, omb2, eps, neg_step, bc2_sqrt, dec_eps, enc_eps,  # fp32 (contract.HYPER_FIELDS)
    m_codes, m_absmax, m_qmap, m_tree, m_enc,  # exp_avg: uint8 codes, fp32 scales (row layout), fp32 [2**M_BITS]
    #               decode map, [2**M_BITS] the encode map's midpoints as a search tree, [2**M_BITS] encode map
    v_codes, v_absmax, v_qmap, v_tree, v_enc,  # exp_avg_sq (sqrt transform), same layout
    x_codes, x_absmax, x_qmap, x_tree, x_enc,  # max_exp_avg_sq (sqrt transform; read only when AMSGRAD)
    seed,  # int32: the bits of the uint32 seed of stochastic rounding (read only when STOCHASTIC)
    n_blocks, row_len,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
    M_RATIO: tl.constexpr,  # exp_avg's codes are ratios (else plain values); new codes always are
    AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
    M_BITS: tl.constexpr, V_BITS: tl.constexpr, X_BITS: tl.constexpr,  # each moment's code width
    STOCHASTIC: tl.constexpr,  # exp_avg's and exp_avg_sq's new codes round stochastically (else to nearest)
    ALIGNED: tl.constexpr,  # row_len is a multiple of 16 (triton_blocks.geometry)
):
    first = tl.program_id(0).to(tl.int64) * ROWS
    tb.adam_tile(p_ptr, g_ptr, m_codes, m_absmax, v_codes, v_absmax, x_codes, x_absmax,
                 m_qmap, m_tree, m_enc, v_qmap, v_tree, v_enc, x_qmap, x_tree, x_enc,
                 decay, l2, omb1, beta2, omb2, eps, neg_step, bc2_sqrt, dec_eps, enc_eps,
                 seed.to(tl.uint32, bitcast=True), first, n_blocks - first, row_len,
                 BLOCK, ROWS, M_RATIO, AMSGRAD, MAXIMIZE, M_BITS, V_BITS, X_BITS, STOCHASTIC, ALIGNED)


@triton.jit(do_not_specialize=["seed"])
def _momentum_kernel(
    p_ptr, g_ptr, out_ptr,  # param [n] (updated in place unless UPDATE_NONE), grad [n], fp32 d [n] (HAS_OUT)
    codes, absmax, qmap, tree, enc,  # the state (as _adam_kernel's moments)
    l2, keep, take, c_old, c_new, c_grad, decay, neg_lr,  # fp32 (contract.MOMENTUM_FIELDS)
    seed,  # int32: the bits of the uint32 seed (read only when STOCHASTIC)
    n_blocks, row_len,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr, MAXIMIZE: tl.constexpr,
    UPDATE: tl.constexpr, HAS_OUT: tl.constexpr, STOCHASTIC: tl.constexpr, ALIGNED: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * ROWS
    tb.momentum_tile(p_ptr, g_ptr, out_ptr, codes, absmax, qmap, tree, enc,
                     l2, keep, take, c_old, c_new, c_grad, decay, neg_lr, seed.to(tl.uint32, bitcast=True),
                     first, n_blocks - first, row_len, BLOCK, ROWS, BITS, MAXIMIZE, UPDATE, HAS_OUT, STOCHASTIC,
                     ALIGNED)


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


def _tree(thresholds):
    return memo.by_tensor(tb.search_tree, thresholds)


def _moment(state: StepState) -> tuple:
    """A moment's five kernel arguments (codes, scales, decode map, search tree, encode map)."""
    return state.codes, state.absmax, state.qmap, _tree(state.thresholds), state.encode


def quantize(src, thresholds, block_size: int, sqrt: bool, codes, absmax, bits: int = 8, row_len=None) -> None:
    _launch(_quantize_kernel, src.numel(), row_len, block_size, src, tb.search_tree(thresholds), codes, absmax, SQRT=sqrt,
            BITS=bits)


def dequantize(codes, absmax, qmap, block_size: int, sqrt: bool, out, fresh: bool, bits: int = 8,
               row_len=None) -> None:
    _launch(_dequantize_kernel, out.numel(), row_len, block_size, codes, absmax, qmap, out, SQRT=sqrt, BITS=bits)


def adam_step(p, g, states: tuple[StepState, ...], h, flags: StepFlags) -> None:
    m, v, *x = states
    seed = flags.seed or 0
    # the scalars as kernel arguments (fp32, exact: h holds fp32 values), not a tensor the GPU must be sent
    _launch(_adam_kernel, p.numel(), flags.row_len, flags.block_size, p, g, *h.tolist(), *_moment(m), *_moment(v),
            *_moment(x[0] if x else v), seed - (1 << 32) if seed >= 1 << 31 else seed, M_RATIO=flags.ratio,
            AMSGRAD=bool(x), MAXIMIZE=flags.maximize, M_BITS=m.bits, V_BITS=v.bits, X_BITS=(x[0] if x else v).bits,
            STOCHASTIC=flags.seed is not None, enable_fp_fusion=False)


def momentum_step(p, g, state: StepState, h, out, flags: MomentumFlags) -> None:
    seed = flags.seed or 0
    _launch(_momentum_kernel, p.numel(), flags.row_len, flags.block_size, p, g, p if out is None else out,
            *_moment(state), *h.tolist(), seed - (1 << 32) if seed >= 1 << 31 else seed, BITS=state.bits,
            MAXIMIZE=flags.maximize, UPDATE=flags.update, HAS_OUT=out is not None,
            STOCHASTIC=flags.seed is not None, enable_fp_fusion=False)
