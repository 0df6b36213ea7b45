"""Fused 8-bit Adam(W) step in Triton: one pass per parameter tensor and step.

Each program owns ``ROWS`` whole quantization blocks of ``BLOCK`` elements. It loads the parameter,
the gradient and the uint8 codes + fp32 block scales of every moment, dequantizes, runs the Adam
update in fp32, requantizes the new moments with new block scales and stores everything in place:
no full-size fp32 temporaries. The first moment is decoded as m = r * (s + eps') from its ratio codes
and the second moment's stored s = sqrt(v), and re-encoded as r = m / (sqrt(v_new) + eps_new)
(``ckptq.qstate``'s ratio transform). Same signature and codes as the reference
``ckptq.adam_step.adam8bit_step`` (IEEE division and sqrt via ``div_rn``/``sqrt_rn``; the launch
disables fp contraction, so no mul+add turns into an FMA the reference does not do).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import adam_step, qstate
from ..codec import midpoints

_TILE = 2048  # elements per program: ROWS = _TILE // block_size blocks (at least one)


def _state_args(q: dict) -> tuple:
    return q["codes"], q["absmax"], q["qmap"], midpoints(q["qmap"])


@triton.jit
def _decode(codes_ptr, absmax_ptr, qmap_ptr, offs, rows, mask, rmask):
    # codes [ROWS, BLOCK] -> qmap[code] * absmax (no transform); padded lanes are 0 so that they never
    # win a block's absmax.
    code = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(absmax_ptr + rows, mask=rmask, other=0.0)
    x = tl.load(qmap_ptr + code) * scale[:, None]
    return tl.where(mask, x, 0.0)


@triton.jit
def _search(count, thr_ptr, y, STEP: tl.constexpr):
    t = tl.load(thr_ptr + count + (STEP - 1))
    return tl.where(t < y, count + STEP, count)


@triton.jit
def _requant(x, codes_ptr, absmax_ptr, thr_ptr, offs, rows, mask, rmask):
    # x: the transformed values [ROWS, BLOCK]. New block scale = absmax of the block; code =
    # #{thresholds < x / scale} by an 8-step binary search over the 255 sorted thresholds (ckptq.codec's
    # rounding contract).
    absmax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)  # [ROWS]
    safe = tl.where(absmax > 0, absmax, 1.0)
    y = tl.math.div_rn(x, safe[:, None])
    count = tl.zeros(y.shape, dtype=tl.int32)
    count = _search(count, thr_ptr, y, 128)
    count = _search(count, thr_ptr, y, 64)
    count = _search(count, thr_ptr, y, 32)
    count = _search(count, thr_ptr, y, 16)
    count = _search(count, thr_ptr, y, 8)
    count = _search(count, thr_ptr, y, 4)
    count = _search(count, thr_ptr, y, 2)
    count = _search(count, thr_ptr, y, 1)
    tl.store(codes_ptr + offs, count.to(tl.uint8), mask=mask)
    tl.store(absmax_ptr + rows, absmax, mask=rmask)


@triton.jit
def _adam8bit_kernel(
    p_ptr, g_ptr, h_ptr,  # param (fp32/bf16/fp16) [n], grad [n], hyper fp32 [10] (ckptq.adam_step)
    m_codes, m_absmax, m_qmap, m_thr,  # exp_avg: uint8 [n], fp32 [nb], fp32 [256] decode map, fp32 [255]
    v_codes, v_absmax, v_qmap, v_thr,  # exp_avg_sq (sqrt transform), same layout
    x_codes, x_absmax, x_qmap, x_thr,  # max_exp_avg_sq (sqrt transform; read only when AMSGRAD)
    n_elements, n_blocks,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
    M_RATIO: tl.constexpr,  # exp_avg's codes are ratios (else plain values); new codes always are
    AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS] block indices
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [ROWS, BLOCK] element offsets
    mask = offs < n_elements
    rmask = rows < n_blocks
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
    s = tl.sqrt_rn(v)
    if AMSGRAD:
        x = _decode(x_codes, x_absmax, x_qmap, offs, rows, mask, rmask)
        vmax = tl.maximum(x * x, v)
        sx = tl.sqrt_rn(vmax)
        denom = tl.math.div_rn(sx, tl.load(h_ptr + 7)) + tl.load(h_ptr + 5)
        _requant(sx, x_codes, x_absmax, x_thr, offs, rows, mask, rmask)
    else:
        denom = tl.math.div_rn(s, tl.load(h_ptr + 7)) + tl.load(h_ptr + 5)
    p = p * tl.load(h_ptr + 0) + tl.load(h_ptr + 6) * tl.math.div_rn(m, denom)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    r = tl.math.div_rn(m, s + tl.load(h_ptr + 9))  # the new ratio, relative to the exact new v
    _requant(r, m_codes, m_absmax, m_thr, offs, rows, mask, rmask)
    _requant(s, v_codes, v_absmax, v_thr, offs, rows, mask, rmask)


def adam8bit_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, hyper, *, ratio_eps: float, maximize=False) -> None:
    """One 8-bit Adam(W) step on one parameter, in place; see ``ckptq.adam_step.adam8bit_step``."""
    adam_step.check_states(exp_avg, exp_avg_sq, max_exp_avg_sq)
    block = exp_avg["block_size"]
    m_encode = adam_step.encode_qmap(exp_avg, "exp_avg")
    flat = param.data if param.is_contiguous() else param.data.contiguous()
    grad = grad.contiguous()
    n = flat.numel()
    n_blocks = triton.cdiv(n, block)
    rows = max(1, _TILE // block)
    amsgrad = max_exp_avg_sq is not None
    third = max_exp_avg_sq if amsgrad else exp_avg_sq  # a placeholder the kernel never reads
    h = adam_step.ratio_hyper(hyper.to(flat.device), exp_avg, ratio_eps)
    _adam8bit_kernel[(triton.cdiv(n_blocks, rows),)](
        flat, grad, h,
        exp_avg["codes"], exp_avg["absmax"], exp_avg["qmap"], midpoints(m_encode),
        *_state_args(exp_avg_sq), *_state_args(third),
        n, n_blocks,
        BLOCK=block, ROWS=rows, M_RATIO=exp_avg["transform"] == qstate.RATIO_TRANSFORM,
        AMSGRAD=amsgrad, MAXIMIZE=bool(maximize),
        enable_fp_fusion=False,
    )
    adam_step.mark_ratio(exp_avg, m_encode, ratio_eps)
    if flat is not param.data:
        param.data.copy_(flat)
