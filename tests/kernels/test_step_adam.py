"""The fused Adam step of one parameter (``ops.adam8bit_step``; each backend's ``adam_step`` of
``kernels/contract.py``, a group of one: ``kernels/single.py``) against the PyTorch reference, bit for bit:
parameters, and the codes and scales of every moment (exp_avg decoded from ratio or plain codes and
re-encoded as a ratio, exp_avg_sq, max_exp_avg_sq).

Parametrized backend x layout x width: the C builds of conftest.py's ``kernel`` fixture and the Triton
kernels (the interpreter on the CPU: small sizes; the kernel rounds bf16 to nearest-even itself, so the
interpreter checks the bits a GPU writes), flat (irregular sizes around block boundaries, several chunks
of the C path) and in rows (row lengths that are and are not multiples of the block), code widths 8 and 4
through the optimizers and every mix of 8/6/4/2 per moment through ``ops``, fp32/bf16/fp16 params and
grads, amsgrad, maximize, L2 or decoupled decay, nearest and stochastic rounding (seeds below and above
2**31), NaN/Inf/huge gradients. Then the usage errors of the step's arguments.
"""

import pytest
import torch

from ckptq.codec import codebooks, ops, policy, quant
from ckptq.codec.qstate import QState
from ckptq.errors import UsageError
from ckptq.kernels import registry
from ckptq.kernels.contract import StepFlags, StepState, is_flat, layout_blocks, layout_bytes
from ckptq.optim import Adam4bit, Adam8bit, AdamW4bit, AdamW8bit, adam
from tests.kernels.cases import C_BUILDS, MAPS, SIGNED, UNSIGNED, assert_same, device_of, over

BOTH = ("native", "triton")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


# ---- through the optimizers (8 and 4 bits, flat) ----

def _run(cls, p0, grads, backend, **kw):
    p = torch.nn.Parameter(p0.clone())
    if grads[0].dtype != p.dtype:
        p.grad_dtype = grads[0].dtype  # e.g. a bf16 param with an fp32 gradient (master-grad setups)
    opt = cls([p], lr=1e-2, backend=backend, min_size=64, **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt.state[p]


def _assert_same_states(sa: dict, sb: dict, bits: int) -> None:
    for key, q in sa.items():
        if isinstance(q, dict):
            assert q.get("bits", 8) == sb[key].get("bits", 8) and (q.get("bits", 8) < 8) == (bits < 8)
            assert torch.equal(q["codes"].cpu(), sb[key]["codes"].cpu()), key
            assert_same(q["absmax"].cpu(), sb[key]["absmax"].cpu())
            assert q["transform"] == sb[key]["transform"] and q.get("eps") == sb[key].get("eps")


# (class per width, arguments)
CONFIGS = {"adamw": ({8: AdamW8bit, 4: AdamW4bit}, {}),
           "adam-l2": ({8: Adam8bit}, {"weight_decay": 0.1}),
           "adam-l2-b4096": ({4: Adam4bit}, {"weight_decay": 0.1, "block_size": 4096}),
           "amsgrad-maximize-b64": ({8: AdamW8bit, 4: AdamW4bit},
                                    {"amsgrad": True, "maximize": True, "block_size": 64}),
           "b4096-betas-eps": ({8: AdamW8bit}, {"block_size": 4096, "betas": (0.8, 0.95), "eps": 1e-6}),
           "b64": ({4: AdamW4bit}, {"block_size": 64}),
           "amsgrad-maximize-b128": ({4: AdamW4bit}, {"amsgrad": True, "maximize": True, "block_size": 128})}
# the last 8-bit size: a 48-element block (16-lane loop); the last 4-bit one: several chunks of the C path
OPT_CASES = (
    [(b, 8, config, n, dtype) for b in C_BUILDS for n in (63, 4097, 3 * 65536 + 77, 3 * 256 + 48)
     for dtype in (F32, BF16, F16, "bf16-param-fp32-grad")
     for config in ("adamw", "adam-l2", "amsgrad-maximize-b64", "b4096-betas-eps")]
    + [(b, 4, config, n, dtype) for b in C_BUILDS for n in (65, 4097, 2 * 65536 + 77)
       for dtype in (F32, BF16, "bf16-param-fp32-grad")
       for config in ("adamw", "adam-l2-b4096", "amsgrad-maximize-b64")]
    + [("triton", 4, "b64", 63, F32), ("triton", 4, "amsgrad-maximize-b128", 257, F32)])


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
@over("bits,config,n,dtype", OPT_CASES)
def test_optimizer_steps_match_reference(kernel, bits, config, n, dtype):
    """Three steps (C; Triton: two) from the same start, zero gradients in places: parameters, codes and
    scales equal."""
    classes, kw = CONFIGS[config]
    dev = device_of(kernel)
    gen = torch.Generator().manual_seed(n)
    pdtype, gdtype = (BF16, F32) if dtype == "bf16-param-fp32-grad" else (dtype, dtype)
    p0 = (torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-7, 2, generator=gen)).to(pdtype)
    grads = [(torch.randn(n, generator=gen) * 1e-2).to(gdtype) for _ in range(3 if kernel != "triton" else 2)]
    grads[1][::7] = 0
    pa, sa = _run(classes[bits], p0, grads, "torch", **kw)
    pb, sb = _run(classes[bits], p0.to(dev), [g.to(dev) for g in grads], kernel, **kw)
    assert_same(pa, pb.cpu())
    _assert_same_states(sa, sb, bits)


NAN_CASES = ([(b, 8, n, block) for b in C_BUILDS for n, block in ((5000, 256), (202, 64))]
             + [(b, 4, n, block) for b in C_BUILDS for n, block in ((5001, 128), (203, 64))]
             + [("triton", 8, 202, 64), ("triton", 8, 300, 128), ("triton", 4, 203, 64)])


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning",
                            "ignore:All-NaN slice:RuntimeWarning")  # numpy, inside the interpreter
@over("bits,n,block", NAN_CASES)
def test_nan_and_inf_gradients_match_reference(kernel, bits, n, block):
    """NaN and Inf gradients and huge ones whose v overflows to +inf in a short last block (whose scale then
    is +inf: the PyTorch path must not let padding turn it into NaN), over two steps with amsgrad: absmax
    carries NaN and the search sends NaN to the top code, in every backend as in the reference."""
    gen = torch.Generator().manual_seed(3)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    g[10], g[n // 2] = float("nan"), float("inf")
    g[-10:] = 1e20
    cls, dev = {8: AdamW8bit, 4: AdamW4bit}[bits], device_of(kernel)
    pa, sa = _run(cls, p0, [g, g * 0.5], "torch", amsgrad=True, block_size=block)
    pb, sb = _run(cls, p0.to(dev), [g.to(dev), g.to(dev) * 0.5], kernel, amsgrad=True, block_size=block)
    assert_same(pa, pb.cpu())
    assert {k for k, v in sa.items() if isinstance(v, dict)} == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    _assert_same_states(sa, sb, bits)


# ---- through ops.adam8bit_step (a parameter's qstate dicts) ----

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


def _clone(q, device="cpu"):
    return None if q is None else {k: v.to(device, copy=True) if torch.is_tensor(v) else v for k, v in q.items()}


def _states(n, block, amsgrad, gen, m_transform="ratio"):
    m_dense, v_dense = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 1e-2
    v = quant.quantize_state(v_dense, "exp_avg_sq", block)
    if m_transform == "ratio":  # as written by ckptq convert and by the optimizer's steps
        m = quant.quantize_ratio(m_dense, v_dense, policy.ratio_eps(1e-8, 0.999, 2), block)
    else:  # a pre-ratio file: exp_avg on its own
        m = quant.quantize_state(m_dense, "exp_avg", block)
    x = quant.quantize_state(torch.rand(n, generator=gen) * 2e-2, "max_exp_avg_sq", block) if amsgrad else None
    return [m, v, x]


# irregular sizes around block boundaries (small: the interpreter is slow)
SIZES = [(1, 64), (63, 64), (65, 64), (1000, 256), (257, 256), (300, 128), (4097, 4096)]
OPS_CASES = [(b, n, block, dtype, *variant) for b in BOTH for n, block in SIZES for dtype in (F32, BF16, F16)
             for variant in ((False, False, True, "ratio"), (True, True, False, "ratio"), (False, False, True, "none"))]


@over("n,block,dtype,amsgrad,maximize,decoupled,m_transform", OPS_CASES)
def test_ops_step_matches_reference(kernel, n, block, dtype, amsgrad, maximize, decoupled, m_transform):
    dev = device_of(kernel)
    gen = torch.Generator().manual_seed(n * 7 + block)
    p = torch.randn(n, generator=gen).to(dtype)
    g = torch.randn(n, generator=gen).to(dtype)
    states = _states(n, block, amsgrad, gen, m_transform)
    hyper = adam.hyper_tensor(1e-2, 0.9, 0.999, 1e-8, 0.1, 3, decoupled, "cpu")
    eps = policy.ratio_eps(1e-8, 0.999, 3)

    ref_p, ref_states = p.to(torch.float32, copy=True), [_clone(q) for q in states]
    step_quantized(ref_p, g, *ref_states, hyper, ratio_eps=eps, maximize=maximize, backend="torch")
    out_p, out_states = p.to(dev, copy=True), [_clone(q, dev) for q in states]
    step_quantized(out_p, g.to(dev), *out_states, hyper.to(dev), ratio_eps=eps, maximize=maximize, backend=kernel)

    assert torch.equal(out_p.cpu(), ref_p.to(dtype))
    for ref, out in zip(ref_states, out_states):
        if ref is not None:
            assert torch.equal(out["codes"].cpu(), ref["codes"])
            assert torch.equal(out["absmax"].cpu(), ref["absmax"])
            assert torch.equal(out["qmap"].cpu(), ref["qmap"]) and out["transform"] == ref["transform"]
    assert out_states[0]["transform"] == "ratio" and out_states[0]["eps"] == eps


@over("dtype", [(b, F32) for b in BOTH])
def test_ops_step_updates_a_non_contiguous_param(kernel, dtype):
    dev = device_of(kernel)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, 40, generator=gen).to(dev)
    p = base.t()  # [40, 64], not contiguous
    g = torch.randn(40, 64, generator=gen).to(dev)
    states = [_clone(q, dev) for q in _states(p.numel(), 64, False, gen)]
    hyper = adam.hyper_tensor(1e-2, 0.9, 0.999, 1e-8, 0.0, 1, True, dev)
    ref_p, ref_states = p.contiguous(), [_clone(q, dev) for q in states]
    step_quantized(ref_p, g, *ref_states, hyper, ratio_eps=1e-8, backend="torch")
    step_quantized(p, g, *states, hyper, ratio_eps=1e-8, backend=kernel)
    assert torch.equal(p, ref_p)
    assert torch.equal(states[0]["codes"], ref_states[0]["codes"])


def _stepped(bits: int, backend: str, seed: int, device: str):
    gen = torch.Generator().manual_seed(bits + seed % 97)
    n, block = 1000, 128
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 1e-2
    states = [quant.quantize_ratio(m, v, policy.ratio_eps(1e-8, 0.999, 2), block, bits=bits),
              quant.quantize_state(v, "exp_avg_sq", block, bits=bits)]
    states = [_clone(q, device) for q in states]
    p, g = p.to(device), g.to(device)
    hyper = adam.hyper_tensor(1e-2, 0.9, 0.999, 1e-8, 0.1, 3, True, device)
    step_quantized(p, g, *states, None, hyper, ratio_eps=policy.ratio_eps(1e-8, 0.999, 3), backend=backend, seed=seed)
    return p.cpu(), [(q["codes"].cpu(), q["absmax"].cpu()) for q in states]


@pytest.mark.parametrize("bits", (8, 4))
def test_reference_stochastic_steps_draw_for_both_moments(bits):
    """Other seeds give other codes, in both moments."""
    a, b = _stepped(bits, "torch", 6, "cpu")[1], _stepped(bits, "torch", 6 + 97, "cpu")[1]
    assert not torch.equal(a[0][0], b[0][0]) and not torch.equal(a[1][0], b[1][0])


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:divide by zero:RuntimeWarning")
@over("bits", [(b, bits) for b in BOTH for bits in (8, 4)])
def test_stochastic_steps_match_reference(kernel, bits):
    """Seeds below and above 2**31 (Triton takes them as int32 bits)."""
    for seed in (5, 2**31 + 12345):
        pa, sa = _stepped(bits, "torch", seed, "cpu")
        pb, sb = _stepped(bits, kernel, seed, device_of(kernel))
        assert_same(pa, pb)
        for (ca, aa), (cb, ab) in zip(sa, sb):
            assert torch.equal(ca, cb)
            assert_same(aa, ab)


def _mixed_step(widths, backend, n, amsgrad, seed, device="cpu"):
    """One fused step on moments of the given code widths (exp_avg a ratio; plain 4- or 2-bit maps for the
    second moments, a 64-entry one where they are 6 bits) from fixed states; returns (p, [(codes, absmax)])."""
    gen = torch.Generator().manual_seed(n + sum(widths))
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    dense = [torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 2e-2]
    ratio_map = torch.tensor([-1.0, 0.0, 0.5, 1.0]) if widths[0] == 2 else policy.ratio_policy(widths[0]).qmap()
    maps = [ratio_map] + [
        codebooks.power_map(False, 3.0)[::4].contiguous() if w == 6 else policy.policy_for("exp_avg_sq", w).qmap()
        for w in widths[1:]]
    states = []
    for i, (x, qmap, bits) in enumerate(list(zip(dense, maps, widths))[: 3 if amsgrad else 2]):
        codes, absmax = ops.quantize_blockwise(x, qmap, 128, "none" if i == 0 else "sqrt", "torch", bits)
        qmap = qmap.to(device)
        states.append(ops.StepInput(codes.to(device), absmax.to(device), qmap, qmap))
    hyper = torch.tensor([0.999, 0.0, 0.1, 0.999, 0.001, 1e-8, -1e-3, 0.05, 1e-9, 2e-9])
    p = p.to(device)
    ops.adam8bit_step(p, g.to(device), states, hyper, block_size=128, ratio=True, backend=backend,
                      bits=list(widths[: len(states)]), seed=seed)
    return p.cpu(), [(s.codes.cpu(), s.absmax.cpu()) for s in states]


MIXES = ((6, 2, 4), (6, 2, 8), (4, 4, 4), (8, 2, 6), (6, 6, 6), (2, 2, 2), (4, 2, 2))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@over("widths", [(b, w) for b in BOTH for w in MIXES])
def test_moments_of_different_widths_match_reference(kernel, widths):
    """The step takes a code width per moment (the 4-bit budget steps a 6-bit ratio with a 2-bit sqrt(v)
    and a 4-bit max_exp_avg_sq): every backend equals the reference for every mix, with and without amsgrad
    and stochastic rounding, on sizes that end in a short block and a part-full byte."""
    cases = ((1000, False, None), (77, True, 2**31 + 5)) if kernel == "triton" else \
        [(n, ams, seed) for n in (77, 1000, 4096 + 64) for ams in (False, True) for seed in (None, 12345)]
    for n, amsgrad, seed in cases:
        pa, sa = _mixed_step(widths, "torch", n, amsgrad, seed)
        pb, sb = _mixed_step(widths, kernel, n, amsgrad, seed, device_of(kernel))
        assert_same(pa, pb)
        for (ca, aa), (cb, ab) in zip(sa, sb):
            assert torch.equal(ca, cb)
            assert_same(aa, ab)


# ---- rows ----

def _values(n: int, signed: bool, gen: torch.Generator) -> torch.Tensor:
    """Values over many decades, zeros in places (an all-zero short block when rows are short)."""
    x = torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-6, 1, generator=gen)
    x[: min(n, 70)] = 0.0
    return x if signed else x.abs()


def _row_states(n: int, row_len: int, block: int, mix: tuple, gen: torch.Generator) -> tuple[StepState, ...]:
    """exp_avg (ratio codes), exp_avg_sq and max_exp_avg_sq (sqrt) quantized in rows by the reference."""
    states = []
    for k, bits in enumerate(mix):
        qmap = SIGNED[bits] if k == 0 else UNSIGNED[bits]
        x = _values(n, k == 0, gen) * (1e-3 if k == 0 else 1e-6)
        codes = torch.empty(layout_bytes(n, row_len, bits), dtype=torch.uint8)
        absmax = torch.empty(layout_blocks(n, row_len, block))
        registry.backend("torch").quantize(x, ops.midpoints(qmap), block, k > 0, codes, absmax, bits, row_len)
        states.append(StepState(codes, absmax, qmap, ops.midpoints(qmap), qmap, bits))
    return tuple(states)


def _hyper(step: int, decoupled: bool) -> torch.Tensor:
    lr, wd, b1, b2, eps = 1e-2, 0.1, 0.9, 0.999, 1e-8
    return torch.tensor([1 - lr * wd if decoupled else 1.0, 0.0 if decoupled else wd, 1 - b1, b2, 1 - b2, eps,
                         -lr / (1 - b1**step), (1 - b2**step) ** 0.5, eps, 2 * eps], dtype=torch.float32)


def _step_both(p0, g, states, flags: StepFlags, steps: int = 2):
    """``steps`` steps of the reference and of the C kernels from the same start: equal params, codes, scales."""
    results = []
    for impl in (registry.backend("torch"), registry.backend("native")):
        p, s = p0.clone(), tuple(x._replace(codes=x.codes.clone(), absmax=x.absmax.clone()) for x in states)
        for t in range(1, steps + 1):
            impl.adam_step(p, g * t, s, _hyper(t + 3, decoupled=t % 2 == 1), flags)
        results.append((p, s))
    (pa, sa), (pb, sb) = results
    assert_same(pa, pb)
    for k, (a, b) in enumerate(zip(sa, sb)):
        assert torch.equal(a.codes, b.codes), f"moment {k}: codes differ"
        assert_same(a.absmax, b.absmax)


def _c_rows(rows: int, row_len: int, block: int, mix: tuple, index: int) -> None:
    """Two steps (nearest, fp32) and two more (seeded, the dtypes ``index`` picks, maximize every other
    index) of the reference and the C kernels from the same start."""
    n = rows * row_len
    assert is_flat(n, row_len, block) == (row_len % block == 0)
    dtypes = [(F32, F32), (BF16, BF16), (F16, F16), (BF16, F32)]
    for variant, (pdtype, gdtype) in enumerate((dtypes[0], dtypes[index % 4])):
        gen = torch.Generator().manual_seed(index * 10 + variant)
        p0 = (torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-6, 1, generator=gen)).to(pdtype)
        g = (torch.randn(n, generator=gen) * 1e-2).to(gdtype)
        g[::7] = 0.0
        seed = None if variant == 0 else 0xC0FFEE + index
        flags = StepFlags(block, True, variant == 1 and index % 2 == 0, seed, row_len)
        _step_both(p0, g, _row_states(n, row_len, block, mix, gen), flags)


HYPER = torch.tensor([0.999, 0.0, 0.1, 0.999, 0.001, 1e-8, -1e-3, 0.05, 1e-9, 2e-9])
HYPER_L2 = torch.tensor([1.0, 0.1, 0.1, 0.999, 0.001, 1e-8, -1e-3, 0.05, 1e-9, 2e-9])  # Adam's L2 decay


def _ops_rows_step(widths, backend, p, g, states, hyper, row_len, maximize, seed, block=64):
    dev = device_of(backend)
    p = p.to(dev)
    inputs = [ops.StepInput(c.to(dev), a.to(dev), q.to(dev), q.to(dev)) for c, a, q in states]
    ops.adam8bit_step(p, g.to(dev), inputs, hyper, block_size=block, ratio=True, maximize=maximize,
                      backend=backend, bits=list(widths[: len(states)]), seed=seed, row_len=row_len)
    return p.cpu(), [(s.codes.cpu(), s.absmax.cpu()) for s in inputs]


def _ops_row_states(widths, n: int, row_len: int, amsgrad: bool, gen: torch.Generator, block: int = 64):
    """exp_avg (ratio codes), exp_avg_sq[, max_exp_avg_sq] (sqrt) of n elements in rows of row_len, quantized
    by the reference at the given widths: [(codes, absmax, qmap)]."""
    dense = [torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 2e-2]
    out = []
    for i, (x, bits) in enumerate(list(zip(dense, widths))[: 3 if amsgrad else 2]):
        qmap = MAPS[bits][min(i, 1)]
        codes, absmax = ops.quantize_blockwise(x, qmap, block, "none" if i == 0 else "sqrt", "torch", bits,
                                               row_len=row_len)
        out.append((codes, absmax, qmap))
    return out


def _triton_rows(rows: int, row_len: int, widths: tuple, k: int) -> None:
    """One step through ops on rows; ``k`` rotates through param/grad dtypes, amsgrad, maximize, L2 or decoupled
    decay and seeds (one above 2**31, where the kernel takes the seed's int32 bits)."""
    pdtype, gdtype = [(F32, F32), (BF16, BF16), (F16, F16), (BF16, F32)][k % 4]
    amsgrad, maximize = k % 2 == 0, k % 3 == 0
    seed = (None, 12345, 2**31 + 5)[k // 2 % 3]
    n = rows * row_len
    gen = torch.Generator().manual_seed(n + sum(widths))
    p, g = torch.randn(n, generator=gen).to(pdtype), torch.randn(n, generator=gen).to(gdtype)
    states = _ops_row_states(widths, n, row_len, amsgrad, gen)
    hyper = HYPER_L2 if k % 2 else HYPER
    pa, sa = _ops_rows_step(widths, "torch", p, g, states, hyper, row_len, maximize, seed)
    pb, sb = _ops_rows_step(widths, "triton", p, g, states, hyper, row_len, maximize, seed)
    assert_same(pa, pb)
    for (ca, aa), (cb, ab) in zip(sa, sb):
        assert torch.equal(ca, cb)
        assert_same(aa, ab)


# (rows, row_len, block): short last blocks of every length class, plus rows of whole blocks
ROW_CASES = [(5, 1, 64), (3, 63, 64), (3, 65, 64), (2, 3 * 64 + 7, 64), (4, 201, 64), (3, 577, 256), (2, 255, 256),
             (3, 300, 128), (2, 1023, 512), (2, 2049, 1024), (2, 4095, 2048), (2, 4097, 4096), (2, 3 * 4096 + 7, 4096),
             (3, 512, 256)]
C_MIXES = [(8, 8), (6, 2), (4, 4), (2, 2), (8, 4), (8, 8, 8), (6, 2, 4), (4, 4, 4), (2, 2, 2)]
TRITON_MIXES = ((6, 2, 4), (4, 4, 4), (8, 8, 8), (2, 2, 2), (8, 2, 6))
TRITON_ROW_LENS = (1, 63, 65, 201, 3 * 64 + 7)
ROWS = (  # C: every row case with three width mixes, every mix with several row cases; the other builds: each mix
    [("native", *case, C_MIXES[(i + k * 3) % len(C_MIXES)], i * 3 + k) for i, case in enumerate(ROW_CASES)
     for k in range(3)]
    + [(b, 3, 201, 64, mix, C_MIXES.index(mix)) for b in C_BUILDS for mix in C_MIXES]
    + [("triton", 3 if row_len > 1 else 7, row_len, 64, mix, i + j) for i, mix in enumerate(TRITON_MIXES)
       for j, row_len in enumerate(TRITON_ROW_LENS)])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@over("rows,row_len,block,mix,index", ROWS)
def test_rows_match_reference(kernel, rows, row_len, block, mix, index):
    """The C kernels: two steps of each of two variants through ``adam_step``; Triton (the interpreter): one
    step through ops."""
    if kernel == "triton":
        _triton_rows(rows, row_len, mix, index)
    else:
        _c_rows(rows, row_len, block, mix, index)


@pytest.mark.usefixtures("one_thread")
@over("row_len,block", [("native", 201, 64), ("native", 4097, 4096)])
def test_rows_with_nan_inf_and_huge_gradients(kernel, row_len, block):
    """NaN, Inf and overflowing gradients in short last blocks of rows (their scales become NaN / inf)."""
    n, gen = 3 * row_len, torch.Generator().manual_seed(row_len)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    g[5], g[row_len + row_len - 3], g[-1] = float("nan"), float("inf"), 1e20
    _step_both(p0, g, _row_states(n, row_len, block, (8, 8, 8), gen), StepFlags(block, True, False, None, row_len))


@over("bits", [(b, 4) for b in BOTH])
def test_a_row_step_touches_no_byte_outside_the_codes(kernel, bits):
    """Rows of 65 4-bit codes end in a half byte: the kernel writes each row's bytes and nothing past them
    (a guard byte after each tensor stays as it was)."""
    dev = device_of(kernel)
    gen = torch.Generator().manual_seed(0)
    guarded = []
    for c, a, q in _ops_row_states((bits, bits), 3 * 65, 65, False, gen):
        guarded.append((torch.cat([c, torch.tensor([0xA5], dtype=torch.uint8)]).to(dev),
                        torch.cat([a, torch.tensor([7.0])]).to(dev), q.to(dev)))
    inputs = [ops.StepInput(c[:-1], a[:-1], q, q) for c, a, q in guarded]
    p = torch.randn(3 * 65, generator=gen).to(dev)
    ops.adam8bit_step(p, torch.randn(3 * 65, generator=gen).to(dev), inputs, HYPER, block_size=64, ratio=True,
                      backend=kernel, bits=bits, row_len=65)
    for c, a, _ in guarded:
        assert int(c[-1]) == 0xA5 and float(a[-1]) == 7.0


# ---- usage errors ----

def test_step_refuses_codebooks_and_codes_of_another_width():
    p = torch.randn(300)
    sqrt4 = policy.policy_for("exp_avg_sq", 4).qmap()
    m8 = ops.quantize_blockwise(torch.randn(300), codebooks.power_map(True, 1.5), 64)
    v4 = ops.quantize_blockwise(torch.rand(300), sqrt4, 64, "sqrt", bits=4)
    states = [ops.StepInput(*m8, codebooks.power_map(True, 1.5), codebooks.power_map(True, 1.5)),
              ops.StepInput(*v4, sqrt4, sqrt4)]
    hyper = torch.zeros(10)
    with pytest.raises(UsageError, match="codebook must be a float tensor of 16 entries"):
        ops.adam8bit_step(p, torch.randn(300), states, hyper, block_size=64, ratio=True, bits=4)
    before = v4[0].clone()
    as_8bit = [states[0], ops.StepInput(*v4, codebooks.dynamic_map(False), codebooks.dynamic_map(False))]
    with pytest.raises(UsageError, match="holds 150 code bytes"):
        ops.adam8bit_step(p, torch.randn(300), as_8bit, hyper, block_size=64, ratio=True, bits=8)
    assert torch.equal(v4[0], before)


@pytest.mark.parametrize("seed", (-1, 2**32, True, 1.5))
def test_seed_outside_uint32_is_a_usage_error(seed):
    q = quant.quantize_state(torch.rand(64), "exp_avg_sq", 64, bits=4)
    m = quant.quantize_state(torch.randn(64), "exp_avg", 64, bits=4)
    inputs = [ops.StepInput(s["codes"], s["absmax"], s["qmap"], s["qmap"]) for s in (m, q)]
    with pytest.raises(UsageError, match="seed"):
        ops.adam8bit_step(torch.zeros(64), torch.zeros(64), inputs, torch.zeros(10), block_size=64, ratio=False,
                          bits=4, seed=seed)


def test_one_width_per_moment_is_checked():
    ratio6, sqrt2 = policy.ratio_policy(6).qmap(), policy.policy_for("exp_avg_sq", 2).qmap()
    states = [ops.StepInput(*ops.quantize_blockwise(torch.randn(64), ratio6, 64, bits=6), ratio6, ratio6),
              ops.StepInput(*ops.quantize_blockwise(torch.rand(64), sqrt2, 64, "sqrt", bits=2), sqrt2, sqrt2)]
    with pytest.raises(UsageError, match="bits names 3 code widths for 2 moments"):
        ops.adam8bit_step(torch.zeros(64), torch.zeros(64), states, torch.zeros(10), block_size=64, ratio=True,
                          bits=[6, 2, 4])
    with pytest.raises(UsageError, match="codebook must be a float tensor of 4 entries"):
        ops.adam8bit_step(torch.zeros(64), torch.zeros(64), states, torch.zeros(10), block_size=64, ratio=True,
                          bits=[6, 2][::-1])
