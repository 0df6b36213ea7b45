"""The Triton backend (CUDA): blockwise quantize, dequantize and the fused 8-bit Adam step.

Signatures and contract in ``contract``; results equal ``backend_torch`` bit for bit, NaN and Inf
included. Each program handles ``ROWS`` consecutive quantization blocks as a ``[ROWS, BLOCK]`` tile, so
small block sizes still give every program ~2048 contiguous elements (coalesced, vectorized loads).
Both the codec and the step encode through one helper, ``_encode``: absmax per block (NaN if the block
holds one, as torch's amax), then a branch-free binary search over the 255 codebook midpoints, as in
bitsandbytes' ``kQuantizeBlockwise`` (csrc/kernels.cu). Exactness on CUDA needs the IEEE-rounded
``tl.math.div_rn`` / ``sqrt_rn`` (Triton's ``/`` and ``tl.sqrt`` on fp32 are approximate there), and the
step is launched without fp contraction, so no mul+add turns into an FMA the reference does not do.
Importing this module imports triton: ``ckptq.ops`` does so only on the Triton path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .contract import StepFlags, StepState, num_blocks

_TILE = 2048  # elements per program when blocks are small


@triton.jit
def _encode(x, mask, thr_ptr):
    # x: fp32 [ROWS, BLOCK] (transform applied), mask: the lanes that exist. Returns (codes int32
    # [ROWS, BLOCK], absmax fp32 [ROWS]). code = #{j : t[j] < y} with y = x / absmax. Invariant of the
    # search: t[pos - 1] < y; testing "not t >= y" sends NaN to 255, like torch.searchsorted. Probed
    # indices stay within 0..254. tl.max skips NaNs but torch's amax returns NaN: put it back.
    ax = tl.where(mask, tl.abs(x), 0.0)  # padding is 0, which never wins the absmax
    has_nan = tl.max((ax != ax).to(tl.int32), axis=1) > 0  # [ROWS]
    absmax = tl.where(has_nan, float("nan"), tl.max(ax, axis=1))  # [ROWS]
    safe = tl.where(absmax > 0, absmax, 1.0)  # all-zero (or NaN) block: divide by 1
    y = tl.math.div_rn(x, safe[:, None])
    pos = tl.zeros(y.shape, dtype=tl.int32)
    for level in tl.static_range(8):
        step = 128 >> level
        t = tl.load(thr_ptr + pos + (step - 1))
        pos = tl.where(t >= y, pos, pos + step)
    return pos, absmax


@triton.jit
def _decode(codes_ptr, absmax_ptr, qmap_ptr, offs, rows, mask, rmask):
    # codes [ROWS, BLOCK] -> qmap[code] * absmax (no transform; two separate roundings); padded lanes 0.
    code = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(absmax_ptr + rows, mask=rmask, other=0.0)
    x = tl.load(qmap_ptr + code) * scale[:, None]
    return tl.where(mask, x, 0.0)


@triton.jit
def _tile(n, n_blocks, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS] block indices, int64
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [ROWS, BLOCK] element offsets
    return rows, offs, offs < n, rows < n_blocks


@triton.jit
def _store(codes, absmax, codes_ptr, absmax_ptr, offs, rows, mask, rmask):
    tl.store(codes_ptr + offs, codes.to(tl.uint8), mask=mask)
    tl.store(absmax_ptr + rows, absmax, mask=rmask)


@triton.jit
def _quantize_kernel(
    x_ptr,  # [n] fp32/bf16/fp16: the values to quantize
    thr_ptr,  # [255] fp32, ascending: midpoints between neighbouring codebook entries
    codes_ptr,  # [n] uint8 out
    absmax_ptr,  # [n_blocks] fp32 out: max |x| (after the transform) of each block
    n, n_blocks,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,  # quantization block (64..4096), blocks per program
    SQRT: tl.constexpr,  # store sqrt(x) instead of x
):
    rows, offs, mask, rmask = _tile(n, n_blocks, BLOCK, ROWS)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SQRT:
        x = tl.math.sqrt_rn(x)
    codes, absmax = _encode(x, mask, thr_ptr)
    _store(codes, absmax, codes_ptr, absmax_ptr, offs, rows, mask, rmask)


@triton.jit
def _dequantize_kernel(
    codes_ptr, absmax_ptr, qmap_ptr,  # [n] uint8, [n_blocks] fp32, [256] fp32 codebook
    out_ptr,  # [n] fp32 out: qmap[code] * absmax[block], squared when SQRT
    n, n_blocks,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, SQRT: tl.constexpr,
):
    rows, offs, mask, rmask = _tile(n, n_blocks, BLOCK, ROWS)
    vals = _decode(codes_ptr, absmax_ptr, qmap_ptr, offs, rows, mask, rmask)
    if SQRT:
        vals = vals * vals
    tl.store(out_ptr + offs, vals, mask=mask)


@triton.jit
def _adam_kernel(
    p_ptr, g_ptr, h_ptr,  # param [n] (updated in place), grad [n], hyper fp32 [10] (contract.HYPER_FIELDS)
    m_codes, m_absmax, m_qmap, m_thr,  # exp_avg: uint8 [n], fp32 [nb], fp32 [256] decode map, fp32 [255]
    v_codes, v_absmax, v_qmap, v_thr,  # exp_avg_sq (sqrt transform), same layout
    x_codes, x_absmax, x_qmap, x_thr,  # max_exp_avg_sq (sqrt transform; read only when AMSGRAD)
    n, n_blocks,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
    M_RATIO: tl.constexpr,  # exp_avg's codes are ratios (else plain values); new codes always are
    AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
):
    rows, offs, mask, rmask = _tile(n, n_blocks, BLOCK, ROWS)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        g = -g
    g = g + tl.load(h_ptr + 1) * p
    s = _decode(v_codes, v_absmax, v_qmap, offs, rows, mask, rmask)  # sqrt(v) as stored
    m = _decode(m_codes, m_absmax, m_qmap, offs, rows, mask, rmask)
    if M_RATIO:
        m = m * (s + tl.load(h_ptr + 8))  # m = r * (s_q + eps')
    m = m + tl.load(h_ptr + 2) * (g - m)
    v = (s * s) * tl.load(h_ptr + 3) + tl.load(h_ptr + 4) * (g * g)
    s = tl.math.sqrt_rn(v)
    if AMSGRAD:
        x = _decode(x_codes, x_absmax, x_qmap, offs, rows, mask, rmask)
        sx = tl.math.sqrt_rn(tl.maximum(x * x, v, propagate_nan=tl.PropagateNan.ALL))  # NaN wins, as torch.maximum
        denom = tl.math.div_rn(sx, tl.load(h_ptr + 7)) + tl.load(h_ptr + 5)
        codes, absmax = _encode(sx, mask, x_thr)
        _store(codes, absmax, x_codes, x_absmax, offs, rows, mask, rmask)
    else:
        denom = tl.math.div_rn(s, tl.load(h_ptr + 7)) + tl.load(h_ptr + 5)
    p = p * tl.load(h_ptr + 0) + tl.load(h_ptr + 6) * tl.math.div_rn(m, denom)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    codes, absmax = _encode(tl.math.div_rn(m, s + tl.load(h_ptr + 9)), mask, m_thr)  # the new ratio
    _store(codes, absmax, m_codes, m_absmax, offs, rows, mask, rmask)
    codes, absmax = _encode(s, mask, v_thr)
    _store(codes, absmax, v_codes, v_absmax, offs, rows, mask, rmask)


def _launch(kernel, n: int, block_size: int, *args, **constexprs) -> None:
    """Run a kernel over n elements: ROWS blocks of block_size per program (~2048 elements), 8 warps for
    4096-element blocks."""
    if n == 0:
        return
    rows = max(1, _TILE // block_size)
    nb = num_blocks(n, block_size)
    kernel[(triton.cdiv(nb, rows),)](*args, n, nb, BLOCK=block_size, ROWS=rows,
                                     num_warps=8 if rows * block_size > _TILE else 4, **constexprs)


def quantize(src, thresholds, block_size: int, sqrt: bool, codes, absmax) -> None:
    _launch(_quantize_kernel, src.numel(), block_size, src, thresholds, codes, absmax, SQRT=sqrt)


def dequantize(codes, absmax, qmap, block_size: int, sqrt: bool, out, fresh: bool) -> None:
    _launch(_dequantize_kernel, codes.numel(), block_size, codes, absmax, qmap, out, SQRT=sqrt)


def adam_step(p, g, states: tuple[StepState, ...], h, flags: StepFlags) -> None:
    m, v, *x = states
    _launch(_adam_kernel, p.numel(), flags.block_size, p, g, h, *m, *v, *(x[0] if x else v),
            M_RATIO=flags.ratio, AMSGRAD=bool(x), MAXIMIZE=flags.maximize, enable_fp_fusion=False)
