"""The Adam step: the update math (once, in fp32), the 8-bit step in PyTorch, and its CPU dispatch.

``step_rows`` is the reference of the fused kernels: the C kernel ``ckq_adam_step`` in
``ckptq/kernels/cpu_kernels.c`` (the CPU path where it builds) and the Triton kernel
``ckptq.kernels.adam8bit.adam8bit_step`` (CUDA), same results bit for bit. Per block of ``block_size``
elements it decodes the second moment (s = ``qmap[code] * absmax``, v = s * s) and the first
(m = r * (s + eps') for a ``"ratio"`` state, see ``ckptq.qstate``; ``qmap[code] * absmax`` for a plain
one), runs the Adam update in fp32, and requantizes with new block scales under exactly the rounding
contract of ``ckptq.codec``: v as sqrt(v), m as the ratio r = m / (sqrt(v) + eps_new) with the new exact
fp32 v. Large tensors are processed in chunks of whole blocks, so temporaries stay a few MB whatever
the tensor size.

Update math follows ``torch.optim.AdamW`` / ``torch.optim.Adam`` (single-tensor path) and
torchao's ``single_param_adam``; the state is blockwise 8-bit as in Dettmers et al., "8-bit
Optimizers via Block-wise Quantization" (ICLR 2022).
"""

from __future__ import annotations

import torch

from . import codec, qstate
from .kernels import native
from .codec import midpoints
from .errors import UsageError

# Scalars of one step, host-computed in float64 and rounded once to fp32 so that every backend sees
# the same values: fp32 [8] in this order.
HYPER_FIELDS = ("decay", "l2", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "neg_step_size", "bc2_sqrt")
# The 8-bit steps append the ratio transform's two eps' (decode: the state's stored one; encode: the new
# step's ``qstate.ratio_eps``): fp32 [10].
RATIO_FIELDS = ("decode_eps", "encode_eps")
# Elements per chunk of the PyTorch path (whole blocks for every block size <= 4096): temporaries of 1 MB.
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
    denom = codec.ieee_sqrt(v if vmax is None else vmax) / h[7] + h[5]
    p = p * h[0] + h[6] * (m / denom)
    return p, m, v, vmax


def decode_rows(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """codes uint8 [nb, B], absmax fp32 [nb] -> qmap[code] * absmax, fp32 [nb, B] (no transform)."""
    return qmap[codes.to(torch.int64)] * absmax[:, None]


def step_rows(p, g, h, states, maximize: bool):
    """The fused step on whole blocks, in PyTorch: p, g [nb, B] (any float dtype), h fp32 [10].

    ``states``: tuple of (codes u8 [nb, B], absmax fp32 [nb], codebook the codes refer to, thresholds
    of the codebook new codes use, decode transform) for exp_avg (``"ratio"`` or ``"none"``; always
    re-encoded as a ratio), exp_avg_sq and optionally max_exp_avg_sq (both ``"sqrt"``).
    Returns (p fp32 [nb, B], ((codes, absmax), ...)) with the new values.
    """
    m_state, v_state, *x_state = states
    s = decode_rows(*v_state[:3])  # sqrt(v) as stored
    m = decode_rows(*m_state[:3])
    if m_state[4] == qstate.RATIO_TRANSFORM:
        m = m * (s + h[8])  # m = r * (s_q + eps'), in this order (qstate.dequantize_state)
    vmax = None
    if x_state:
        vmax = decode_rows(*x_state[0][:3])
        vmax = vmax * vmax
    p32, m, v, vmax = adam_math(p.float(), g.float(), m, s * s, vmax, h, maximize)
    s = codec.ieee_sqrt(v)  # exact fp32 v: the new divisor of the ratio
    new = (codec.quantize_rows(m / (s + h[9]), m_state[3]), codec.quantize_rows(s, v_state[3]))
    if vmax is not None:
        new += (codec.quantize_rows(codec.ieee_sqrt(vmax), x_state[0][3]),)
    return p32, new


def step_rows_(p, g, h, states, maximize: bool) -> None:
    """``step_rows`` writing its results into p and each state's codes/absmax."""
    p_new, new = step_rows(p, g, h, states, maximize)
    p.copy_(p_new)
    for state, (codes, absmax) in zip(states, new):
        state[0].copy_(codes)
        state[1].copy_(absmax)


def _run_chunk(p, g, h, qstates, thresholds, start: int, end: int, maximize: bool) -> None:
    """Step elements [start, end) of flat p/g/codes in place: the whole blocks as [rows, B] and a short
    last block on its own as [1, length] (no padding: padding would take part in the block's math)."""
    block = qstates[0]["block_size"]
    full = start + (end - start) // block * block
    for lo, hi, width in ((start, full, block), (full, end, end - full)):
        if hi == lo:
            continue
        rows, b0 = (hi - lo) // width, lo // block
        states = tuple(
            (q["codes"][lo:hi].view(rows, width), q["absmax"][b0 : b0 + rows], q["qmap"], t, q["transform"])
            for q, t in zip(qstates, thresholds)
        )
        step_rows_(p[lo:hi].view(rows, width), g[lo:hi].view(rows, width), h, states, maximize)


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


def _native_can_step(p: torch.Tensor, g: torch.Tensor, qstates) -> bool:
    """Everything the C kernel reads and writes lies where it expects: CPU, contiguous, fp32/bf16/fp16
    param and grad of n elements, per state n uint8 codes with one fp32 scale per block and a 256-entry
    codebook (``codec.check_quantized``)."""
    n = p.numel()
    tensors = [p, g] + [q[k] for q in qstates for k in ("codes", "absmax", "qmap")]
    if g.numel() != n or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return False
    if p.dtype not in native.DTYPE_CODES or g.dtype not in native.DTYPE_CODES:
        return False
    try:
        for q in qstates:
            codec.check_quantized(q["codes"], q["absmax"], q["qmap"], q["block_size"])
    except UsageError:
        return False
    return all(q["codes"].numel() == n and q["absmax"].dtype == torch.float32 for q in qstates)


def _native_step(p, g, qstates, thresholds, h, maximize: bool, backend: str) -> bool:
    """Run the step with the C kernel (``ckptq.kernels.cpu_kernels.c``, ``ckq_adam_step``) when it can:
    CPU tensors, fp32/bf16/fp16 param and grad, flat contiguous states, codebooks with a code table.
    Returns False (nothing touched) where it cannot; the PyTorch path below then runs, with the same bits."""
    if backend not in ("auto", "native") or not _native_can_step(p, g, qstates):
        return False
    lib = native.library()
    if lib is None:
        return False
    tables = [native.code_table(t) for t in thresholds]
    if any(t is None for t in tables):
        return False
    block = qstates[0]["block_size"]
    ratio = qstates[0]["transform"] == qstate.RATIO_TRANSFORM
    decode = [q["qmap"].to(torch.float32).contiguous() for q in qstates]
    dtypes, n = native.DTYPE_CODES, p.numel()

    def run(start: int, stop: int, _ws) -> None:
        states = [(q["codes"].data_ptr() + start, q["absmax"].data_ptr() + 4 * (start // block), d.data_ptr(),
                   t.data_ptr()) for q, d, t in zip(qstates, decode, tables)]
        m, v, x = states + [(None,) * 4] * (3 - len(states))
        native.check(lib.ckq_adam_step(p.data_ptr() + start * p.element_size(), dtypes[p.dtype],
                                       g.data_ptr() + start * g.element_size(), dtypes[g.dtype], stop - start, block,
                                       *m, ratio, *v, *x, h.data_ptr(), maximize))

    codec._for_each_chunk(run, n, p.device, codec.native_chunk(n), workspace=False)
    return True


def adam8bit_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, hyper, *, ratio_eps: float,
                  maximize=False, backend: str = "auto") -> None:
    """One 8-bit Adam(W) step on one parameter, in place (param, and each qstate's codes/absmax;
    exp_avg becomes a ratio state with eps' = ``ratio_eps``, ``qstate.ratio_eps`` of the new step).

    ``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq`` (None without amsgrad) are qstate dicts with one
    block size and flat ``codes``; ``hyper`` is ``hyper_tensor``'s fp32 [8]. ``backend`` "auto" or
    "native" runs the C kernel where it can (``_native_step``), "torch" (or anything it cannot serve)
    the PyTorch reference in chunks of whole blocks; both give the same bits.
    """
    qstates = check_states(exp_avg, exp_avg_sq, max_exp_avg_sq)
    keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    encode = [encode_qmap(q, k) for q, k in zip(qstates, keys)]
    thresholds = [midpoints(e) for e in encode]  # of the codebooks the new codes use
    h = ratio_hyper(hyper, exp_avg, ratio_eps)
    flat = param.data if param.is_contiguous() else param.data.contiguous()
    p, g = flat.view(-1), grad.reshape(-1).contiguous()
    if not _native_step(p, g, qstates, thresholds, h, maximize, backend):

        def run(start: int, end: int, _ws) -> None:
            with torch.no_grad():  # grad mode is per thread: pool workers run without it, as step() does
                _run_chunk(p, g, h, qstates, thresholds, start, end, maximize)

        # Chunks touch disjoint blocks and torch ops release the GIL: on the CPU they run on codec's pool
        # of single-threaded workers (an OpenMP team per small op costs a barrier each).
        codec._for_each_chunk(run, p.numel(), p.device, CHUNK_ELEMENTS, workspace=False)
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
