"""Fused 8-bit Adam(W) step in Triton: one pass per parameter tensor and step.

Each program owns ``ROWS`` whole quantization blocks of ``BLOCK`` elements. It loads the parameter,
the gradient and the uint8 codes + fp32 block scales of every moment, dequantizes, runs the Adam
update in fp32, requantizes the new moments with new block scales and stores everything in place:
no full-size fp32 temporaries. Same signature and codes as the reference
``ckptq.adam_step.adam8bit_step`` (IEEE division and sqrt via ``div_rn``/``sqrt_rn``; the launch
disables fp contraction, so no mul+add turns into an FMA the reference does not do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..codec import midpoints

_TILE = 2048  # elements per program: ROWS = _TILE // block_size blocks (at least one)


@triton.jit
def _dequant(codes_ptr, absmax_ptr, qmap_ptr, offs, rows, mask, rmask, SQRT: tl.constexpr):
    # codes [ROWS, BLOCK] -> fp32 values; padded lanes are 0 so that they never win a block's absmax.
    code = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(absmax_ptr + rows, mask=rmask, other=0.0)
    x = tl.load(qmap_ptr + code) * scale[:, None]
    if SQRT:
        x = x * x
    return tl.where(mask, x, 0.0)


@triton.jit
def _search(count, thr_ptr, y, STEP: tl.constexpr):
    t = tl.load(thr_ptr + count + (STEP - 1))
    return tl.where(t < y, count + STEP, count)


@triton.jit
def _requant(x, codes_ptr, absmax_ptr, thr_ptr, offs, rows, mask, rmask, SQRT: tl.constexpr):
    # New block scale = absmax of the (sqrt-transformed) block; code = #{thresholds < x / scale}
    # by an 8-step binary search over the 255 sorted thresholds (ckptq.codec's rounding contract).
    if SQRT:
        x = tl.sqrt_rn(x)
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
    p_ptr, g_ptr, h_ptr,  # param (fp32/bf16/fp16) [n], grad [n], hyper fp32 [8] (ckptq.adam_step.HYPER_FIELDS)
    m_codes, m_absmax, m_qmap, m_thr,  # exp_avg: uint8 [n], fp32 [nb], fp32 [256], fp32 [255]
    v_codes, v_absmax, v_qmap, v_thr,  # exp_avg_sq, same layout
    x_codes, x_absmax, x_qmap, x_thr,  # max_exp_avg_sq (read only when AMSGRAD)
    n_elements, n_blocks,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
    M_SQRT: tl.constexpr, V_SQRT: tl.constexpr, X_SQRT: tl.constexpr,
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
    m = _dequant(m_codes, m_absmax, m_qmap, offs, rows, mask, rmask, M_SQRT)
    v = _dequant(v_codes, v_absmax, v_qmap, offs, rows, mask, rmask, V_SQRT)
    m = m + tl.load(h_ptr + 2) * (g - m)
    v = v * tl.load(h_ptr + 3) + tl.load(h_ptr + 4) * (g * g)
    if AMSGRAD:
        vmax = tl.maximum(_dequant(x_codes, x_absmax, x_qmap, offs, rows, mask, rmask, X_SQRT), v)
        denom = tl.math.div_rn(tl.sqrt_rn(vmax), tl.load(h_ptr + 7)) + tl.load(h_ptr + 5)
        _requant(vmax, x_codes, x_absmax, x_thr, offs, rows, mask, rmask, X_SQRT)
    else:
        denom = tl.math.div_rn(tl.sqrt_rn(v), tl.load(h_ptr + 7)) + tl.load(h_ptr + 5)
    p = p * tl.load(h_ptr + 0) + tl.load(h_ptr + 6) * tl.math.div_rn(m, denom)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    _requant(m, m_codes, m_absmax, m_thr, offs, rows, mask, rmask, M_SQRT)
    _requant(v, v_codes, v_absmax, v_thr, offs, rows, mask, rmask, V_SQRT)


def _state_args(q: dict) -> tuple:
    return q["codes"], q["absmax"], q["qmap"], midpoints(q["qmap"])


def adam8bit_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, hyper, *, maximize=False) -> None:
    """One 8-bit Adam(W) step on one parameter, in place; see ``ckptq.adam_step.adam8bit_step``."""
    block = exp_avg["block_size"]
    qstates = [q for q in (exp_avg, exp_avg_sq, max_exp_avg_sq) if q is not None]
    assert all(q["block_size"] == block for q in qstates), "states of one parameter share a block size"
    flat = param.data if param.is_contiguous() else param.data.contiguous()
    grad = grad.contiguous()
    n = flat.numel()
    n_blocks = triton.cdiv(n, block)
    rows = max(1, _TILE // block)
    amsgrad = max_exp_avg_sq is not None
    third = max_exp_avg_sq if amsgrad else exp_avg  # a placeholder the kernel never reads
    _adam8bit_kernel[(triton.cdiv(n_blocks, rows),)](
        flat, grad, hyper.to(device=flat.device, dtype=torch.float32),
        *_state_args(exp_avg), *_state_args(exp_avg_sq), *_state_args(third),
        n, n_blocks,
        BLOCK=block, ROWS=rows,
        M_SQRT=exp_avg["transform"] == "sqrt", V_SQRT=exp_avg_sq["transform"] == "sqrt",
        X_SQRT=third["transform"] == "sqrt", AMSGRAD=amsgrad, MAXIMIZE=bool(maximize),
        enable_fp_fusion=False,
    )
    if flat is not param.data:
        param.data.copy_(flat)
