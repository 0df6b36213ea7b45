"""The fused Triton Adam step against the PyTorch reference (interpreter on CPU, see conftest.py).

Bound asserted: codes and block scales of every moment are identical (exp_avg decoded from ratio
or plain codes, re-encoded as a ratio), and fp32/bf16/fp16 parameters are identical: the kernel rounds
bf16 to nearest-even itself (Triton's interpreter would truncate), so the interpreter checks the bits a
GPU writes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ckptq.optim import adam
from ckptq.codec import ops, policy, quant  # noqa: E402
from ckptq.codec.qstate import QState  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Irregular sizes around block boundaries (small: the interpreter is slow).
CASES = [(1, 64), (63, 64), (65, 64), (1000, 256), (257, 256), (300, 128), (4097, 4096)]


def step_quantized(param, grad, exp_avg: dict, exp_avg_sq: dict, max_exp_avg_sq: dict | None, hyper, *, ratio_eps: float,
                   maximize: bool = False, backend: str = "auto", seed: int | None = None) -> None:
    """One low-bit Adam(W) step of one parameter's qstate dicts through ``ops.adam8bit_step`` (what the
    optimizer's grouped step equals per member): exp_avg plain or a ratio, written back as a ratio with
    eps' ``ratio_eps`` on the ratio codebook; ``hyper``: ``adam.hyper_tensor``'s fp32 [8]."""
    moments = [QState.from_dict(d) for d in (exp_avg, exp_avg_sq, max_exp_avg_sq) if d is not None]
    m = moments[0]
    encode = m.qmap if m.is_ratio else policy.ratio_policy(m.bits).qmap().to(m.qmap.device)
    eps = torch.tensor((m.eps if m.is_ratio else 0.0, ratio_eps), dtype=torch.float32)
    h = torch.cat((hyper.to("cpu", torch.float32)[:8], eps))
    inputs = [ops.StepInput(q.codes, q.absmax, q.qmap, encode if i == 0 else q.qmap) for i, q in enumerate(moments)]
    ops.adam8bit_step(param, grad, inputs, h, block_size=m.block_size, ratio=m.is_ratio, maximize=maximize,
                      backend=backend, bits=[q.bits for q in moments], seed=seed, row_len=m.row_len)
    exp_avg.update(qmap=encode, transform=policy.RATIO_TRANSFORM, eps=float(ratio_eps), divisor="exp_avg_sq")


def _clone(q):
    return None if q is None else {k: v.clone() if torch.is_tensor(v) else v for k, v in q.items()}


def _states(n, block, amsgrad, gen, m_transform="ratio"):
    m_dense, v_dense = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 1e-2
    v = quant.quantize_state(v_dense, "exp_avg_sq", block)
    if m_transform == "ratio":  # as written by ckptq convert and by the optimizer's steps
        m = quant.quantize_ratio(m_dense, v_dense, policy.ratio_eps(1e-8, 0.999, 2), block)
    else:  # a pre-ratio file: exp_avg on its own
        m = quant.quantize_state(m_dense, "exp_avg", block)
    x = quant.quantize_state(torch.rand(n, generator=gen) * 2e-2, "max_exp_avg_sq", block) if amsgrad else None
    return [None if q is None else {k: t.to(DEVICE) if torch.is_tensor(t) else t for k, t in q.items()} for q in (m, v, x)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,block", CASES)
@pytest.mark.parametrize(
    "amsgrad,maximize,decoupled,m_transform",
    [(False, False, True, "ratio"), (True, True, False, "ratio"), (False, False, True, "none")],
)
def test_kernel_matches_reference(n, block, dtype, amsgrad, maximize, decoupled, m_transform):
    gen = torch.Generator().manual_seed(n * 7 + block)
    p = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    g = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    states = _states(n, block, amsgrad, gen, m_transform)
    hyper = adam.hyper_tensor(1e-2, 0.9, 0.999, 1e-8, 0.1, 3, decoupled, DEVICE)
    eps = policy.ratio_eps(1e-8, 0.999, 3)

    ref_p, ref_states = p.to(torch.float32, copy=True), [_clone(q) for q in states]
    step_quantized(ref_p, g, *ref_states, hyper, ratio_eps=eps, maximize=maximize, backend="torch")
    out_p, out_states = p.clone(), [_clone(q) for q in states]
    step_quantized(out_p, g, *out_states, hyper, ratio_eps=eps, maximize=maximize, backend="triton")

    assert torch.equal(out_p, ref_p.to(dtype))
    for ref, out in zip(ref_states, out_states):
        if ref is not None:
            assert torch.equal(out["codes"], ref["codes"])
            assert torch.equal(out["absmax"], ref["absmax"])
            assert torch.equal(out["qmap"], ref["qmap"]) and out["transform"] == ref["transform"]
    assert out_states[0]["transform"] == "ratio" and out_states[0]["eps"] == eps


def test_kernel_updates_non_contiguous_param():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, 40, generator=gen).to(DEVICE)
    p = base.t()  # [40, 64], not contiguous
    g = torch.randn(40, 64, generator=gen).to(DEVICE)
    states = _states(p.numel(), 64, False, gen)
    hyper = adam.hyper_tensor(1e-2, 0.9, 0.999, 1e-8, 0.0, 1, True, DEVICE)
    ref_p, ref_states = p.contiguous(), [_clone(q) for q in states]
    step_quantized(ref_p, g, *ref_states, hyper, ratio_eps=1e-8, backend="torch")
    step_quantized(p, g, *states, hyper, ratio_eps=1e-8, backend="triton")
    assert torch.equal(p, ref_p)
    assert torch.equal(states[0]["codes"], ref_states[0]["codes"])


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")  # numpy, inside the interpreter
@pytest.mark.parametrize("n,block", ((202, 64), (300, 128)))
def test_nan_and_inf_gradients_match_reference(n, block):
    """NaN and Inf gradients and huge ones whose v overflows to +inf (a short last block's scale becomes
    +inf), over two steps with amsgrad: the kernel's absmax carries NaN and its search sends NaN to 255,
    exactly as the reference (and the C kernels) do."""
    from ckptq.optim import AdamW8bit

    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-3
    g[10], g[n // 2] = float("nan"), float("inf")
    g[-10:] = 1e20
    results = []
    for backend in ("torch", "triton"):
        p = torch.nn.Parameter(p0.clone().to(DEVICE))
        opt = AdamW8bit([p], lr=1e-2, min_size=64, amsgrad=True, block_size=block, backend=backend)
        for grad in (g, g * 0.5):
            p.grad = grad.to(DEVICE)
            opt.step()
        results.append((p.detach().cpu(), {k: v for k, v in opt.state[p].items() if isinstance(v, dict)}))
    (pa, sa), (pb, sb) = results
    _assert_same_nan_equal(pa, pb)
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert torch.equal(sa[key]["codes"].cpu(), sb[key]["codes"].cpu()), key
        _assert_same_nan_equal(sa[key]["absmax"].cpu(), sb[key]["absmax"].cpu())


def _assert_same_nan_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bits, except that any NaN equals any NaN (payloads and NaN signs are not part of the contract)."""
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b)), f"NaN at {int((nan != torch.isnan(b)).sum())} places differ"
    assert torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))
