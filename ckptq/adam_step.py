"""The Adam step in PyTorch: the update math (once, in fp32) and the chunked 8-bit CPU path.

``adam8bit_step`` is the CPU path and the reference for the fused Triton kernel
(``ckptq.kernels.adam8bit.adam8bit_step``, same signature, same codes). Per block of ``block_size``
elements it decodes the second moment (s = ``qmap[code] * absmax``, v = s * s) and the first
(m = r * (s + eps') for a ``"ratio"`` state, see ``ckptq.qstate``; ``qmap[code] * absmax`` for a plain
one), runs the Adam update in fp32, and requantizes with new block scales under exactly the rounding
contract of ``ckptq.codec``: v as sqrt(v), m as the ratio r = m / (sqrt(v) + eps_new) with the new exact
fp32 v. Large tensors are processed in chunks of
whole blocks, so temporaries stay a few MB whatever the tensor size.

Update math follows ``torch.optim.AdamW`` / ``torch.optim.Adam`` (single-tensor path) and
torchao's ``single_param_adam``; the state is blockwise 8-bit as in Dettmers et al., "8-bit
Optimizers via Block-wise Quantization" (ICLR 2022).
"""

from __future__ import annotations

import functools

import torch

from . import codebooks, codec, qstate
from .codec import midpoints

# Scalars of one step, host-computed in float64 and rounded once to fp32 so that every backend sees
# the same values: fp32 [8] in this order.
HYPER_FIELDS = ("decay", "l2", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "neg_step_size", "bc2_sqrt")
# The 8-bit steps append the ratio transform's two eps' (decode: the state's stored one; encode: the new
# step's ``qstate.ratio_eps``): fp32 [10].
RATIO_FIELDS = ("decode_eps", "encode_eps")
# Elements per chunk on the CPU path (whole blocks for every block size <= 4096): temporaries of 1 MB, and
# few enough chunks that the compiled path's OpenMP barrier per chunk costs little (2^16 was 2-4x slower).
CHUNK_ELEMENTS = 1 << 18


def hyper_tensor(lr, beta1, beta2, eps, weight_decay, step, decoupled: bool, device=None) -> torch.Tensor:
    """The fp32 [8] scalar vector of one step (``step`` counts from 1)."""
    lr, step = float(lr), float(step)
    decay = 1.0 - lr * weight_decay if decoupled else 1.0
    l2 = 0.0 if decoupled else float(weight_decay)
    bc1 = 1.0 - beta1**step
    bc2_sqrt = (1.0 - beta2**step) ** 0.5
    values = (decay, l2, 1.0 - beta1, beta2, 1.0 - beta2, eps, -lr / bc1, bc2_sqrt)
    return torch.tensor(values, dtype=torch.float32, device=device)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt (IEEE, as Triton's ``sqrt_rn``). Eager torch.sqrt on AVX512 CPUs is
    not (~20% of results are 1 ulp off), so eager rounds a float64 sqrt to fp32, which is exact
    (53 >= 2*24 + 2 bits); inductor's C++ emits the IEEE vector sqrt itself (tested bit-equal)."""
    if torch.compiler.is_compiling():
        return torch.sqrt(x)
    return torch.sqrt(x.double()).float()


def adam_math(p, g, m, v, vmax, h, maximize: bool):
    """One Adam(W) update on fp32 tensors of one shape; ``h`` is ``hyper_tensor``'s fp32 [8].

    Returns ``(p, m, v, vmax)``; ``vmax`` is None without amsgrad. Decoupled decay (AdamW) is
    ``h[0] = 1 - lr*wd``, L2 decay (Adam) is ``h[1] = wd``; the unused one is the identity (x*1, x+0*p).
    """
    if maximize:
        g = -g
    g = g + h[1] * p
    m = m + h[2] * (g - m)  # torch's lerp(m, g, 1 - beta1) for weights < 0.5
    v = v * h[3] + h[4] * (g * g)
    if vmax is not None:
        vmax = torch.maximum(vmax, v)
    denom = sqrt_rn(v if vmax is None else vmax) / h[7] + h[5]
    p = p * h[0] + h[6] * (m / denom)
    return p, m, v, vmax


# Arithmetic codec of the second moments' codebook, power-unsigned-3: q_k = (k / 255)^3 is exactly the
# fp32 division k^3 / 255^3 (both integers < 2^24, so exact in fp32; checked against the table for all
# 256 codes). Decoding then needs no table gather, and encoding only an estimate k0 = round(255 * y^(1/3))
# that is within one code of the answer (the threshold between codes k and k+1 lies at cube-root k + 0.5
# to k + 0.8, pow's error is ~1e-5 codes) and two exact threshold compares. Gathers from 256-entry tables
# are what inductor's C++ backend emulates element by element.
POW3 = "pow3"  # codec kind; "table" otherwise
POW3_DENOMINATOR = 255.0**3


def decode_rows(codes, absmax, dec, kind: str) -> torch.Tensor:
    """codes uint8 [nb, B], absmax fp32 [nb] -> qmap[code] * absmax, fp32 [nb, B] (no transform).
    ``dec``: the codebook fp32 [256], or for ``kind == POW3`` the fp32 [1] denominator 255^3 (a tensor,
    so that inductor does not turn the division into a multiplication by a rounded reciprocal)."""
    if kind == POW3:
        k = codes.to(torch.float32)
        return (k * k * k / dec) * absmax[:, None]
    return dec[codes.to(torch.int64)] * absmax[:, None]


def pow3_codes(y: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """#{midpoints of power-unsigned-3 < y} for y in [0, 1] (float codes, y's shape): the estimate and
    the fix-ups against thresholds computed as ``codec.midpoints`` does, (q_k + q_k+1) / 2 in fp32."""
    k = torch.round(torch.pow(y, 1.0 / 3.0) * 255.0).clamp(0.0, 255.0)

    def q(j):
        return j * j * j / den

    qk = q(k)
    # x * 0.5 is x / 2 rounded the same way (both are the correctly rounded x/2), one division less
    below = y <= (q(k - 1.0) + qk) * 0.5  # never true at k = 0: the threshold there is negative
    above = y > (qk + q(k + 1.0)) * 0.5  # never true at k = 255: the threshold there is above 1
    return k - below.to(torch.float32) + above.to(torch.float32)


def quantize_rows(x, enc, kind: str):
    """fp32 [nb, B] (transform applied) -> (codes uint8 [nb, B], absmax fp32 [nb]), the
    ``ckptq.codec`` rounding contract; ``enc``: ``search_table(...)`` or, for POW3, the denominator."""
    absmax = x.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    y = x / safe[:, None]
    return (pow3_codes(y, enc) if kind == POW3 else count_below(enc, y)).to(torch.uint8), absmax


def search_table(thresholds: torch.Tensor):
    """Lookup table that turns ``count_below`` into 1 + K gathers instead of an 8-step search.

    Bins are the top 16 bits of an fp32 pattern (sign, exponent, 7 mantissa bits); ``start[b]`` =
    #{t < smallest value of bin b}. A value y of bin b has #{t < y} = start[b] + #{k < K :
    padded[start[b] + k] < y}, where K bounds the thresholds inside one bin (2 for the dynamic maps)
    and ``padded`` is the thresholds followed by K +inf. The same idea as bitsandbytes' 65,536-bin
    CPU table, plus the exact fix-up that keeps the rounding contract. Returns (start int64 [65536],
    padded fp32 [255 + K]).
    """
    pattern = torch.arange(1 << 16, dtype=torch.int64) << 16
    edges = [(pattern | low).to(torch.int32).view(torch.float32) for low in (0, 0xFFFF)]
    lo = torch.nan_to_num(torch.minimum(*edges), nan=0.0)
    hi = torch.nan_to_num(torch.maximum(*edges), nan=0.0)
    t = thresholds.cpu()
    start = torch.searchsorted(t, lo)
    k = int((torch.searchsorted(t, hi, right=True) - start).max())
    padded = torch.cat([t, torch.full((k,), float("inf"))])
    return start.to(thresholds.device), padded.to(thresholds.device)


def count_below(table, y: torch.Tensor) -> torch.Tensor:
    """#{j : thresholds[j] < y} per element (int64, y's shape): equals ``torch.searchsorted`` on the
    thresholds, with ops that inductor's C++ backend fuses (it leaves searchsorted/bucketize to ATen)."""
    start, padded = table
    bins = (y.view(torch.int32) >> 16) & 0xFFFF
    count = start[bins.to(torch.int64)]
    base = count
    for k in range(padded.numel() - 255):
        count = count + (padded[base + k] < y).to(torch.int64)
    return count


def step_rows(p, g, h, states, maximize: bool):
    """The fused step on whole blocks: p, g [nb, B] (any float dtype), h fp32 [10].

    ``states``: tuple of (codes u8 [nb, B], absmax fp32 [nb], decoder, its kind, encoder, its kind,
    decode transform), decoder/encoder as ``decode_rows``/``quantize_rows`` take them (for the codebook
    the codes refer to, and the one new codes will use), for exp_avg
    (``"ratio"`` or ``"none"``; always re-encoded as a ratio), exp_avg_sq and optionally max_exp_avg_sq
    (both ``"sqrt"``). Returns (p fp32 [nb, B], ((codes, absmax), ...)) with the new values; this is
    the function the compiled path traces.
    """
    m_state, v_state, *x_state = states
    s = decode_rows(*v_state[:4])  # sqrt(v) as stored
    m = decode_rows(*m_state[:4])
    if m_state[6] == qstate.RATIO_TRANSFORM:
        m = m * (s + h[8])  # m = r * (s_q + eps'), in this order (qstate.dequantize_state)
    vmax = None
    if x_state:
        vmax = decode_rows(*x_state[0][:4])
        vmax = vmax * vmax
    p32, m, v, vmax = adam_math(p.float(), g.float(), m, s * s, vmax, h, maximize)
    s = sqrt_rn(v)  # exact fp32 v: the new divisor of the ratio
    new = (quantize_rows(m / (s + h[9]), *m_state[4:6]), quantize_rows(s, *v_state[4:6]))
    if vmax is not None:
        new += (quantize_rows(sqrt_rn(vmax), *x_state[0][4:6]),)
    return p32, new


def step_rows_(p, g, h, states, maximize: bool) -> None:
    """``step_rows`` writing its results into p and each state's codes/absmax (the compiled unit)."""
    p_new, new = step_rows(p, g, h, states, maximize)
    p.copy_(p_new)
    for state, (codes, absmax) in zip(states, new):
        state[0].copy_(codes)
        state[1].copy_(absmax)


def _padded_rows(x: torch.Tensor, rows: int, block: int, fill) -> torch.Tensor:
    pad = rows * block - x.numel()
    return torch.nn.functional.pad(x, (0, pad), value=fill).view(rows, block) if pad else x.view(rows, block)


def _run_chunk(fn, p, g, h, qstates, tables, start: int, end: int, rows: int, maximize: bool) -> None:
    """Step elements [start, end) of flat p/g/codes in place as ``rows`` blocks, zero-padding a short
    chunk (padding decodes to 0, so it never changes a real block's absmax) and copying it back."""
    block = qstates[0]["block_size"]
    b0, nb = start // block, -(-(end - start) // block)
    states = tuple(
        (
            _padded_rows(q["codes"][start:end], rows, block, codecs[4]),
            _padded_rows(q["absmax"][b0 : b0 + nb], rows, 1, 0.0).view(-1),
            *codecs[:4],
            q["transform"],
        )
        for q, codecs in zip(qstates, tables)
    )
    p_rows = _padded_rows(p[start:end], rows, block, 0.0)
    fn(p_rows, _padded_rows(g[start:end], rows, block, 0.0), h, states, maximize)
    if rows * block != end - start:
        p[start:end] = p_rows.view(-1)[: end - start]
        for q, (codes, absmax, *_) in zip(qstates, states):
            q["codes"][start:end] = codes.view(-1)[: end - start]
            q["absmax"][b0 : b0 + nb] = absmax[:nb]


def _codec(qmap: torch.Tensor, device: str, search: bool):
    """(decoder or encoder, kind) for a codebook: the arithmetic POW3 codec when it is exactly
    power-unsigned-3, else the codebook (decoder) or its ``search_table`` (encoder)."""
    if torch.equal(qmap, codebooks.power_map(False, 3.0)):
        return torch.tensor([POW3_DENOMINATOR], dtype=torch.float32, device=device), POW3
    return (search_table(midpoints(qmap).to(device)) if search else qmap.to(device)), "table"


@functools.lru_cache(maxsize=16)
def _cached_tables(decode_bytes: bytes, encode_bytes: bytes, device: str):
    decode = torch.frombuffer(bytearray(decode_bytes), dtype=torch.float32)
    encode = torch.frombuffer(bytearray(encode_bytes), dtype=torch.float32)
    zero = int(torch.nonzero(decode == 0)[0, 0])
    return (*_codec(decode, device, False), *_codec(encode, device, True), zero)


def _tables(q: dict, encode: torch.Tensor):
    """(decoder, kind, encoder, kind, index of the code that decodes to 0) for a qstate whose codes refer
    to ``q["qmap"]`` and whose new codes use ``encode``; cached by codebook contents."""
    return _cached_tables(q["qmap"].cpu().numpy().tobytes(), encode.cpu().numpy().tobytes(), str(q["qmap"].device))


def encode_qmap(q: dict, key: str) -> torch.Tensor:
    """The codebook a step writes state ``key`` with: its own, except that a plain first moment
    becomes a ratio on ``qstate.RATIO_POLICY``'s map."""
    if key == "exp_avg" and q["transform"] != qstate.RATIO_TRANSFORM:
        return qstate.RATIO_POLICY.qmap().to(q["qmap"].device)
    return q["qmap"]


def check_states(exp_avg, exp_avg_sq, max_exp_avg_sq) -> list:
    """The states of one 8-bit step, checked: one block size, sqrt second moments, a ratio or plain
    first moment whose divisor is exp_avg_sq (``optim_io`` requantizes anything else on load)."""
    qstates = [q for q in (exp_avg, exp_avg_sq, max_exp_avg_sq) if q is not None]
    assert len({q["block_size"] for q in qstates}) == 1, "states of one parameter share a block size"
    assert all(q["transform"] == "sqrt" for q in qstates[1:]), "second moments use the sqrt transform"
    assert exp_avg["transform"] == "none" or exp_avg.get("divisor") == "exp_avg_sq", "ratio of exp_avg_sq"
    return qstates


def ratio_hyper(hyper: torch.Tensor, exp_avg: dict, ratio_eps: float) -> torch.Tensor:
    """``hyper`` [8] + (decode eps', encode eps') -> fp32 [10] on hyper's device."""
    decode = float(exp_avg.get("eps", 0.0)) if exp_avg["transform"] == qstate.RATIO_TRANSFORM else 0.0
    extra = torch.tensor((decode, ratio_eps), dtype=torch.float32, device=hyper.device)
    return torch.cat((hyper.to(torch.float32)[:8], extra))


def mark_ratio(exp_avg: dict, qmap: torch.Tensor, ratio_eps: float) -> None:
    """After a step: exp_avg's codes are ratios on ``qmap`` relative to exp_avg_sq with eps' ``ratio_eps``."""
    exp_avg.update(qmap=qmap, transform=qstate.RATIO_TRANSFORM, eps=float(ratio_eps), divisor="exp_avg_sq")


def adam8bit_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, hyper, *, ratio_eps: float,
                  maximize=False, chunk_fn=None) -> None:
    """One 8-bit Adam(W) step on one parameter, in place (param, and each qstate's codes/absmax;
    exp_avg becomes a ratio state with eps' = ``ratio_eps``, ``qstate.ratio_eps`` of the new step).

    ``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq`` (None without amsgrad) are qstate dicts with one
    block size and flat ``codes``; ``hyper`` is ``hyper_tensor``'s fp32 [8]. ``chunk_fn`` replaces
    ``step_rows_`` (the compiled CPU path, compiled with dynamic shapes: no padding to a fixed size).
    """
    qstates = check_states(exp_avg, exp_avg_sq, max_exp_avg_sq)
    keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    encode = [encode_qmap(q, k) for q, k in zip(qstates, keys)]
    tables = [_tables(q, e) for q, e in zip(qstates, encode)]
    h = ratio_hyper(hyper, exp_avg, ratio_eps)
    flat = param.data if param.is_contiguous() else param.data.contiguous()
    p, g = flat.view(-1), grad.reshape(-1)
    n, block = p.numel(), qstates[0]["block_size"]

    def run(start: int) -> None:
        end = min(n, start + CHUNK_ELEMENTS)
        # a short last block is zero-padded to a whole one (it decodes to 0: never a block's absmax)
        rows = -(-(end - start) // block)
        with torch.no_grad():  # grad mode is per thread: pool workers run without it, as step() does
            _run_chunk(chunk_fn or step_rows_, p, g, h, qstates, tables, start, end, rows, maximize)

    starts = range(0, n, CHUNK_ELEMENTS)
    # Eager chunks touch disjoint blocks and torch ops release the GIL: on the CPU they run on codec's
    # pool of single-threaded workers (an OpenMP team per small op costs a barrier each). Compiled
    # chunks hold the GIL (inductor's kernel call does not release it) and use OpenMP inside instead.
    pool = codec._pool() if p.device.type == "cpu" and chunk_fn is None else None
    if pool is None:
        for start in starts:
            run(start)
    else:
        list(pool.map(run, starts))
    mark_ratio(exp_avg, encode[0], ratio_eps)
    if flat is not param.data:
        param.data.copy_(flat)


def adam_dense_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, hyper, *, maximize=False) -> None:
    """The same step for small parameters whose states are plain fp32 tensors (in place)."""
    p32, m, v, vmax = adam_math(param.detach().float(), grad.float(), exp_avg, exp_avg_sq, max_exp_avg_sq, hyper, maximize)
    param.data.copy_(p32)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if max_exp_avg_sq is not None:
        max_exp_avg_sq.copy_(vmax)
