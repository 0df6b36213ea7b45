"""The Triton backend (CUDA): blockwise quantize, dequantize and the fused low-bit Adam step.

Signatures and contract in ``contract``; results equal ``backend_torch`` bit for bit, NaN and Inf
included. Each program handles ``ROWS`` consecutive quantization blocks as a ``[ROWS, BLOCK]`` tile, so
small block sizes still give every program ~2048 contiguous elements (coalesced, vectorized loads).
Both the codec and the step encode through one helper, ``_encode``: absmax per block (NaN if the block
holds one, as torch's amax), then a branch-free binary search over the 255 codebook midpoints, as in
bitsandbytes' ``kQuantizeBlockwise`` (csrc/kernels.cu). Exactness on CUDA needs the IEEE-rounded
``tl.math.div_rn`` / ``sqrt_rn`` (Triton's ``/`` and ``tl.sqrt`` on fp32 are approximate there), and the
step is launched without fp contraction, so no mul+add turns into an FMA the reference does not do.
Narrower codes (``BITS`` 6, 4, 2): the search runs BITS levels over 2**BITS - 1 midpoints; a code is read
from its bit offset offs * BITS in the stream (two bytes where a 6-bit code straddles them), and written
by reshaping each tile's codes into whole-byte groups (pairs of 4-bit codes, fours of 2- or 6-bit codes)
summed into one word per group, stored byte by byte. The step takes a width per moment.
Importing this module imports triton: ``ckptq.ops`` does so only on the Triton path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .contract import StepFlags, StepState, num_blocks

_TILE = 2048  # elements per program when blocks are small


@triton.jit
def _encode(x, mask, thr_ptr, BITS: tl.constexpr):
    # x: fp32 [ROWS, BLOCK] (transform applied), mask: the lanes that exist. Returns (codes int32
    # [ROWS, BLOCK], absmax fp32 [ROWS]). code = #{j : t[j] < y} with y = x / absmax. Invariant of the
    # search: t[pos - 1] < y; testing "not t >= y" sends NaN to the top code, like torch.searchsorted.
    # Probed indices stay within 0..2**BITS - 2. tl.max skips NaNs but torch's amax returns NaN: put it back.
    ax = tl.where(mask, tl.abs(x), 0.0)  # padding is 0, which never wins the absmax
    has_nan = tl.max((ax != ax).to(tl.int32), axis=1) > 0  # [ROWS]
    absmax = tl.where(has_nan, float("nan"), tl.max(ax, axis=1))  # [ROWS]
    safe = tl.where(absmax > 0, absmax, 1.0)  # all-zero (or NaN) block: divide by 1
    y = tl.math.div_rn(x, safe[:, None])
    pos = tl.zeros(y.shape, dtype=tl.int32)
    for level in tl.static_range(BITS):
        step = (1 << (BITS - 1)) >> level
        t = tl.load(thr_ptr + pos + (step - 1))
        pos = tl.where(t >= y, pos, pos + step)
    return pos, absmax


@triton.jit
def _mix32(x):
    # contract.mix32 on uint32 lanes (products wrap mod 2**32)
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _stochastic(pos, x, absmax, enc_ptr, offs, seed, BITS: tl.constexpr, HIGH: tl.constexpr):
    # Stochastic rounding (contract) of x [ROWS, BLOCK] given _encode's nearest codes pos and block scales
    # absmax; enc_ptr: the codebook [2**BITS]; offs: the elements' indices in the parameter; HIGH: the
    # hash's high 16 bits (the first moment) or its low 16 (the second).
    top = (1 << BITS) - 1
    safe = tl.where(absmax > 0, absmax, 1.0)
    y = tl.math.div_rn(x, safe[:, None])
    lo = tl.maximum(pos - (y < tl.load(enc_ptr + pos)).to(tl.int32), 0)
    q_lo = tl.load(enc_ptr + lo)
    h = _mix32(offs.to(tl.uint32) ^ seed.to(tl.uint32, bitcast=True))
    if HIGH:
        h = h >> 16
    else:
        h = h & 0xFFFF
    u = h.to(tl.float32) * (1.0 / 65536.0)  # a 16-bit integer: exact
    up = u * (tl.load(enc_ptr + tl.minimum(lo + 1, top)) - q_lo) < y - q_lo
    return tl.where(lo >= top, top, lo + up.to(tl.int32))


@triton.jit
def _load_codes(codes_ptr, offs, mask, BITS: tl.constexpr):
    # the codes of elements offs [ROWS, BLOCK], int32: bits [offs * BITS, (offs + 1) * BITS) of the stream
    if BITS == 8:
        return tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    bit = offs * BITS
    shift = (bit % 8).to(tl.int32)
    word = tl.load(codes_ptr + bit // 8, mask=mask, other=0).to(tl.int32)
    if BITS == 6:  # codes at bit 4 or 6 of a byte go on into the next one
        word = word | (tl.load(codes_ptr + bit // 8 + 1, mask=mask & (shift > 2), other=0).to(tl.int32) << 8)
    return (word >> shift) & ((1 << BITS) - 1)


@triton.jit
def _decode(codes_ptr, absmax_ptr, qmap_ptr, offs, rows, mask, rmask, BITS: tl.constexpr):
    # codes [ROWS, BLOCK] -> qmap[code] * absmax (no transform; two separate roundings); padded lanes 0.
    code = _load_codes(codes_ptr, offs, mask, BITS)
    scale = tl.load(absmax_ptr + rows, mask=rmask, other=0.0)
    x = tl.load(qmap_ptr + code) * scale[:, None]
    return tl.where(mask, x, 0.0)


@triton.jit
def _tile(n, n_blocks, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS] block indices, int64
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [ROWS, BLOCK] element offsets
    return rows, offs, offs < n, rows < n_blocks


@triton.jit
def _store(codes, absmax, codes_ptr, absmax_ptr, offs, rows, mask, rmask, n,
           BLOCK: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr):
    if BITS == 8:
        tl.store(codes_ptr + offs, codes.to(tl.uint8), mask=mask)
    elif BITS == 4:  # element pairs (2i, 2i + 1) -> byte i: low, high nibble; lanes past n give 0
        lo, hi = tl.split(tl.reshape(tl.where(mask, codes, 0), (ROWS, BLOCK // 2, 2)))
        boffs = rows[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]  # [ROWS, BLOCK / 2] bytes
        tl.store(codes_ptr + boffs, (lo | (hi << 4)).to(tl.uint8), mask=boffs < (n + 1) // 2)
    else:  # 2 or 6 bits: elements 4i .. 4i + 3 -> one word of 1 or 3 bytes (disjoint bits: the sum is an or)
        quads = tl.reshape(tl.where(mask, codes, 0), (ROWS, BLOCK // 4, 4))
        word = tl.sum(quads << (tl.arange(0, 4) * BITS)[None, None, :], axis=2)  # [ROWS, BLOCK / 4]
        groups = rows[:, None] * (BLOCK // 4) + tl.arange(0, BLOCK // 4)[None, :]
        nbytes = (tl.full([1, 1], n, tl.int64) * BITS + 7) // 8  # in int64: n * 6 passes 2**31 from n ~ 358 M
        for j in tl.static_range(BITS // 2):  # the group's bytes: 1 (2 bits) or 3 (6 bits)
            boffs = groups * (BITS // 2) + j
            tl.store(codes_ptr + boffs, ((word >> (8 * j)) & 255).to(tl.uint8), mask=boffs < nbytes)
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
    BITS: tl.constexpr,  # code width: 8 (a byte per code), 6, 4 or 2 (packed)
):
    rows, offs, mask, rmask = _tile(n, n_blocks, BLOCK, ROWS)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SQRT:
        x = tl.math.sqrt_rn(x)
    codes, absmax = _encode(x, mask, thr_ptr, BITS)
    _store(codes, absmax, codes_ptr, absmax_ptr, offs, rows, mask, rmask, n, BLOCK, ROWS, BITS)


@triton.jit
def _dequantize_kernel(
    codes_ptr, absmax_ptr, qmap_ptr,  # [n * BITS / 8] uint8, [n_blocks] fp32, [2**BITS] fp32 codebook
    out_ptr,  # [n] fp32 out: qmap[code] * absmax[block], squared when SQRT
    n, n_blocks,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, SQRT: tl.constexpr, BITS: tl.constexpr,
):
    rows, offs, mask, rmask = _tile(n, n_blocks, BLOCK, ROWS)
    vals = _decode(codes_ptr, absmax_ptr, qmap_ptr, offs, rows, mask, rmask, BITS)
    if SQRT:
        vals = vals * vals
    tl.store(out_ptr + offs, vals, mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _adam_kernel(
    p_ptr, g_ptr,  # param [n] (updated in place), grad [n]
    decay, l2, omb1, beta2, omb2, eps, neg_step, bc2_sqrt, dec_eps, enc_eps,  # fp32 (contract.HYPER_FIELDS)
    m_codes, m_absmax, m_qmap, m_thr, m_enc,  # exp_avg: uint8 [n * M_BITS / 8], fp32 [nb], fp32 [2**M_BITS]
    #               decode map, fp32 [2**M_BITS - 1] midpoints of the encode map, fp32 [2**M_BITS] the encode map
    v_codes, v_absmax, v_qmap, v_thr, v_enc,  # exp_avg_sq (sqrt transform), same layout
    x_codes, x_absmax, x_qmap, x_thr, x_enc,  # max_exp_avg_sq (sqrt transform; read only when AMSGRAD)
    seed,  # int32: the bits of the uint32 seed of stochastic rounding (read only when STOCHASTIC)
    n, n_blocks,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
    M_RATIO: tl.constexpr,  # exp_avg's codes are ratios (else plain values); new codes always are
    AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
    M_BITS: tl.constexpr, V_BITS: tl.constexpr, X_BITS: tl.constexpr,  # each moment's code width
    STOCHASTIC: tl.constexpr,  # exp_avg's and exp_avg_sq's new codes round stochastically (else to nearest)
):
    rows, offs, mask, rmask = _tile(n, n_blocks, BLOCK, ROWS)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        g = -g
    g = g + l2 * p
    s = _decode(v_codes, v_absmax, v_qmap, offs, rows, mask, rmask, V_BITS)  # sqrt(v) as stored
    m = _decode(m_codes, m_absmax, m_qmap, offs, rows, mask, rmask, M_BITS)
    if M_RATIO:
        m = m * (s + dec_eps)  # m = r * (s_q + eps')
    m = m + omb1 * (g - m)
    v = (s * s) * beta2 + omb2 * (g * g)
    s = tl.math.sqrt_rn(v)
    if AMSGRAD:
        x = _decode(x_codes, x_absmax, x_qmap, offs, rows, mask, rmask, X_BITS)
        sx = tl.math.sqrt_rn(tl.maximum(x * x, v, propagate_nan=tl.PropagateNan.ALL))  # NaN wins, as torch.maximum
        denom = tl.math.div_rn(sx, bc2_sqrt) + eps
        codes, absmax = _encode(sx, mask, x_thr, X_BITS)
        _store(codes, absmax, x_codes, x_absmax, offs, rows, mask, rmask, n, BLOCK, ROWS, X_BITS)
    else:
        denom = tl.math.div_rn(s, bc2_sqrt) + eps
    p = p * decay + neg_step * tl.math.div_rn(m, denom)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    r = tl.math.div_rn(m, s + enc_eps)  # the new ratio
    codes, absmax = _encode(r, mask, m_thr, M_BITS)
    if STOCHASTIC:
        codes = _stochastic(codes, r, absmax, m_enc, offs, seed, M_BITS, True)
    _store(codes, absmax, m_codes, m_absmax, offs, rows, mask, rmask, n, BLOCK, ROWS, M_BITS)
    codes, absmax = _encode(s, mask, v_thr, V_BITS)
    if STOCHASTIC:
        codes = _stochastic(codes, s, absmax, v_enc, offs, seed, V_BITS, False)
    _store(codes, absmax, v_codes, v_absmax, offs, rows, mask, rmask, n, BLOCK, ROWS, V_BITS)


def _launch(kernel, n: int, block_size: int, *args, **constexprs) -> None:
    """Run a kernel over n elements: ROWS blocks of block_size per program (~2048 elements), 8 warps for
    4096-element blocks."""
    if n == 0:
        return
    rows = max(1, _TILE // block_size)
    nb = num_blocks(n, block_size)
    kernel[(triton.cdiv(nb, rows),)](*args, n, nb, BLOCK=block_size, ROWS=rows,
                                     num_warps=8 if rows * block_size > _TILE else 4, **constexprs)


def quantize(src, thresholds, block_size: int, sqrt: bool, codes, absmax, bits: int = 8, row_len=None) -> None:
    _launch(_quantize_kernel, src.numel(), block_size, src, thresholds, codes, absmax, SQRT=sqrt, BITS=bits)


def dequantize(codes, absmax, qmap, block_size: int, sqrt: bool, out, fresh: bool, bits: int = 8,
               row_len=None) -> None:
    _launch(_dequantize_kernel, out.numel(), block_size, codes, absmax, qmap, out, SQRT=sqrt, BITS=bits)


def adam_step(p, g, states: tuple[StepState, ...], h, flags: StepFlags) -> None:
    m, v, *x = states
    seed = flags.seed or 0
    # the scalars as kernel arguments (fp32, exact: h holds fp32 values), not a tensor the GPU must be sent
    _launch(_adam_kernel, p.numel(), flags.block_size, p, g, *h.tolist(), *m[:5], *v[:5], *(x[0] if x else v)[:5],
            seed - (1 << 32) if seed >= 1 << 31 else seed, M_RATIO=flags.ratio, AMSGRAD=bool(x),
            MAXIMIZE=flags.maximize, M_BITS=m.bits, V_BITS=v.bits, X_BITS=(x[0] if x else v).bits,
            STOCHASTIC=flags.seed is not None, enable_fp_fusion=False)
