"""The Adam step in PyTorch: the update math (once, in fp32) and the chunked 8-bit CPU path.

``adam8bit_step`` is the CPU path and the reference for the fused Triton kernel
(``ckptq.kernels.adam8bit.adam8bit_step``, same signature, same codes). Per block of ``block_size``
elements it dequantizes both moments (``qmap[code] * absmax``, squared under the ``"sqrt"``
transform), runs the Adam update in fp32, and requantizes the new moments with new block scales
under exactly the rounding contract of ``ckptq.codec``. Large tensors are processed in chunks of
whole blocks, so temporaries stay a few MB whatever the tensor size.

Update math follows ``torch.optim.AdamW`` / ``torch.optim.Adam`` (single-tensor path) and
torchao's ``single_param_adam``; the state is blockwise 8-bit as in Dettmers et al., "8-bit
Optimizers via Block-wise Quantization" (ICLR 2022).
"""

from __future__ import annotations

import functools

import torch

from .codec import midpoints

# Scalars of one step, host-computed in float64 and rounded once to fp32 so that every backend sees
# the same values: fp32 [8] in this order.
HYPER_FIELDS = ("decay", "l2", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "neg_step_size", "bc2_sqrt")
CHUNK_ELEMENTS = 1 << 16  # elements per chunk on the CPU path (whole blocks for every block size <= 4096)


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


def dequantize_rows(codes, absmax, qmap, transform: str) -> torch.Tensor:
    """codes uint8 [nb, B], absmax fp32 [nb] -> fp32 [nb, B] (``ckptq.codec`` decoding)."""
    x = qmap[codes.to(torch.int64)] * absmax[:, None]
    return x * x if transform == "sqrt" else x


def quantize_rows(x, table, transform: str):
    """fp32 [nb, B] -> (codes uint8 [nb, B], absmax fp32 [nb]), the ``ckptq.codec`` rounding contract."""
    if transform == "sqrt":
        x = sqrt_rn(x)
    absmax = x.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    return count_below(table, x / safe[:, None]).to(torch.uint8), absmax


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
    """The fused step on whole blocks: p, g [nb, B] (any float dtype), h fp32 [8].

    ``states``: tuple of (codes u8 [nb, B], absmax fp32 [nb], qmap fp32 [256], search_table(thresholds),
    transform) for exp_avg, exp_avg_sq and optionally max_exp_avg_sq. Returns (p fp32 [nb, B],
    ((codes, absmax), ...)) with the new values; this is the function the compiled path traces.
    """
    dense = [dequantize_rows(c, a, q, tr) for c, a, q, _, tr in states]
    vmax = dense[2] if len(dense) == 3 else None
    p32, m, v, vmax = adam_math(p.float(), g.float(), dense[0], dense[1], vmax, h, maximize)
    new = (m, v) if vmax is None else (m, v, vmax)
    return p32, tuple(quantize_rows(x, s[3], s[4]) for x, s in zip(new, states))


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
            _padded_rows(q["codes"][start:end], rows, block, zero),
            _padded_rows(q["absmax"][b0 : b0 + nb], rows, 1, 0.0).view(-1),
            q["qmap"],
            table,
            q["transform"],
        )
        for q, (table, zero) in zip(qstates, tables)
    )
    p_rows = _padded_rows(p[start:end], rows, block, 0.0)
    fn(p_rows, _padded_rows(g[start:end], rows, block, 0.0), h, states, maximize)
    if rows * block != end - start:
        p[start:end] = p_rows.view(-1)[: end - start]
        for q, (codes, absmax, *_) in zip(qstates, states):
            q["codes"][start:end] = codes.view(-1)[: end - start]
            q["absmax"][b0 : b0 + nb] = absmax[:nb]


@functools.lru_cache(maxsize=16)
def _cached_tables(qmap_bytes: bytes, device: str):
    qmap = torch.frombuffer(bytearray(qmap_bytes), dtype=torch.float32)
    return search_table(midpoints(qmap).to(device)), int(torch.nonzero(qmap == 0)[0, 0])


def _tables(q: dict):
    """(search table of the codebook's thresholds, index of the code that decodes to 0) for one qstate;
    cached by codebook contents, which are the same for every parameter."""
    return _cached_tables(q["qmap"].cpu().numpy().tobytes(), str(q["qmap"].device))


def adam8bit_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, hyper, *, maximize=False, chunk_fn=None) -> None:
    """One 8-bit Adam(W) step on one parameter, in place (param, and each qstate's codes/absmax).

    ``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq`` (None without amsgrad) are qstate dicts with one
    block size and flat ``codes``; ``hyper`` is ``hyper_tensor``'s fp32 [8]. ``chunk_fn`` replaces
    ``step_rows_`` (the compiled CPU path: it then always sees chunks of ``CHUNK_ELEMENTS``).
    """
    qstates = [q for q in (exp_avg, exp_avg_sq, max_exp_avg_sq) if q is not None]
    assert len({q["block_size"] for q in qstates}) == 1, "states of one parameter share a block size"
    tables = [_tables(q) for q in qstates]
    flat = param.data if param.is_contiguous() else param.data.contiguous()
    p, g = flat.view(-1), grad.reshape(-1)
    n = p.numel()
    block = qstates[0]["block_size"]
    for start in range(0, n, CHUNK_ELEMENTS):
        end = min(n, start + CHUNK_ELEMENTS)
        # The compiled function has one fixed shape: a short last chunk is padded up to it.
        rows = CHUNK_ELEMENTS // block if chunk_fn is not None else -(-(end - start) // block)
        _run_chunk(chunk_fn or step_rows_, p, g, hyper, qstates, tables, start, end, rows, maximize)
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
