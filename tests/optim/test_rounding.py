"""The optimizers' ``rounding`` option: "stochastic" at 8 bits (round-to-nearest loses the small
increments of a rarely updated second moment, such as a byte embedding's), deterministic given the step
counts and the parameters' indices: the same bits on every backend and after a resume, and unbiased;
"auto" keeps 8-bit codes rounded to nearest and narrower ones stochastic."""

import os

import pytest
import torch

from ckptq.errors import ArgumentError
from ckptq.optim import AdamW8bit, SGD8bit


def _run(backend="auto", rounding="stochastic", steps=4, resume_at=None, cls=AdamW8bit, shapes=((64, 70), (5000,)),
         **kw):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    make = lambda: cls(ps, lr=1e-2, backend=backend, rounding=rounding, min_size=1024, **kw)  # noqa: E731
    opt = make()
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        if resume_at == s + 1:
            sd = opt.state_dict()
            opt = make()
            opt.load_state_dict(sd)
    return [p.detach().clone() for p in ps], opt


@pytest.mark.parametrize("cls,kw", [(AdamW8bit, {}), (SGD8bit, {"momentum": 0.9})], ids=["adamw", "sgd"])
def test_stochastic_rounding_at_8_bits_is_the_same_on_every_backend_and_after_a_resume(cls, kw):
    ref, _ = _run("torch", cls=cls, **kw)
    backends = ["native"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available() else [])
    for backend in backends:
        got, _ = _run(backend, cls=cls, steps=4, shapes=((8, 260),), **kw) if backend == "triton" else _run(backend, cls=cls, **kw)
        want = _run("torch", cls=cls, shapes=((8, 260),), **kw)[0] if backend == "triton" else ref
        assert all(torch.equal(a, b) for a, b in zip(got, want)), backend
    resumed, _ = _run("auto", resume_at=2, cls=cls, **kw)
    assert all(torch.equal(a, b) for a, b in zip(resumed, ref))
    nearest, _ = _run("torch", rounding="nearest", cls=cls, **kw)
    assert not all(torch.equal(a, b) for a, b in zip(nearest, ref))
    auto, _ = _run("torch", rounding="auto", cls=cls, **kw)  # the 8-bit default: nearest
    assert all(torch.equal(a, b) for a, b in zip(auto, nearest))


def test_stochastic_rounding_keeps_small_increments_that_nearest_loses():
    """A second moment that grows by a tenth of a code step per step: rounded to nearest it never leaves its
    code, rounded stochastically its mean follows the increments (the bias a rarely updated byte embedding shows)."""
    means = {}
    for rounding in ("nearest", "stochastic"):
        p = torch.nn.Parameter(torch.zeros(64, 256))
        opt = AdamW8bit([p], lr=0.0, betas=(0.9, 0.999), weight_decay=0.0, rounding=rounding)
        for _ in range(200):
            p.grad = torch.ones_like(p)
            p.grad[:, 0] = 100.0  # each block's absmax: the other elements sit far below it
            opt.step()
        v = ckptq_decoded(opt, p)
        means[rounding] = float(v[:, 1:].mean())
    exact = 1 - 0.999**200  # v of a constant gradient 1 after 200 steps, bias included
    assert abs(means["stochastic"] / exact - 1) < 0.05
    assert abs(means["nearest"] / exact - 1) > 2 * abs(means["stochastic"] / exact - 1)


def ckptq_decoded(opt, p):
    from ckptq.codec import quant

    return quant.dequantize_state(opt.state[p]["exp_avg_sq"])


def test_rounding_is_checked_and_travels_with_the_optimizer():
    with pytest.raises(ArgumentError, match="rounding"):
        AdamW8bit([torch.nn.Parameter(torch.zeros(8))], rounding="up")
    import copy

    _, opt = _run(steps=1)
    assert copy.deepcopy(opt).rounding == "stochastic"
