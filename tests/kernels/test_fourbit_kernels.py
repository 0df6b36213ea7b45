"""Codes narrower than 8 bits (6, 4, 2) on every backend: the reference against a brute-force
nearest-entry search and its bit-stream layout, then the C kernels and the Triton kernels (interpreter on
the CPU) against the reference, bit for bit: codes, scales, decoded values and the fused step (the 4-bit
budget's 6 + 2 split, 4 + 4, and other mixes of widths), on irregular sizes (a last byte part full),
every input dtype, NaN/Inf.
"""

import os

import pytest
import torch

from ckptq.codec import codebooks, ops, policy, quant
from ckptq.errors import UsageError
from ckptq.kernels import backend_torch, native
from ckptq.optim import Adam4bit, AdamW4bit
from tests.kernels.test_native import _assert_same, _special, bucket_edges, build  # noqa: F401  (build: the C builds fixture)

QMAPS = {"ratio": policy.ratio_policy(4).qmap(), "sqrt": policy.policy_for("exp_avg_sq", 4).qmap(),
         "signed-2.5": codebooks.power_map(True, 2.5, 4), "ratio6": policy.ratio_policy(6).qmap(),
         "sqrt2": policy.policy_for("exp_avg_sq", 2).qmap()}
WIDTH = {name: {16: 4, 64: 6, 4: 2}[q.numel()] for name, q in QMAPS.items()}
CODECS = (("ratio", "none"), ("sqrt", "sqrt"), ("ratio6", "none"), ("sqrt2", "sqrt"))  # (codebook, transform)
needs_c = pytest.mark.skipif(native.library() is None, reason=f"C kernels unavailable: {native.why_unavailable()}")


def test_codebooks_are_sorted_and_hold_their_ends():
    for name, qmap in QMAPS.items():
        assert qmap.shape == (2 ** WIDTH[name],) and bool((qmap[1:] > qmap[:-1]).all())
        assert float(qmap[-1]) == 1.0 and (0.0 in qmap.tolist()) == (name not in ("sqrt", "sqrt2"))
    assert float(QMAPS["ratio"][0]) == float(QMAPS["ratio6"][0]) == -1.0
    assert QMAPS["sqrt2"].tolist() == pytest.approx([1 / 27, 1 / 9, 1 / 3, 1])
    assert QMAPS["sqrt"].tolist() == pytest.approx([1.3 ** (k - 15) for k in range(16)])  # no 0: see qstate


def _bit_stream(codes: torch.Tensor, n: int, bits: int) -> list[int]:
    """The n codes read from the bytes the plain way: element i is bits [i * bits, (i + 1) * bits) of the
    little-endian stream (kernels.contract)."""
    stream = int.from_bytes(bytes(codes.tolist()), "little")
    return [(stream >> (i * bits)) & (2**bits - 1) for i in range(n)]


@pytest.mark.parametrize("n", (1, 2, 3, 127, 129, 1001))
@pytest.mark.parametrize("name", ("ratio", "ratio6", "sqrt2"))
def test_reference_codes_are_the_nearest_entry_in_a_little_endian_bit_stream(n, name):
    """Brute force: each code is the nearest codebook entry of x / absmax (ties to the lower), element i
    at bit i * bits of the little-endian stream (4 bits: element 2i in the low nibble of byte i); the bits
    after the last code are 0."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen)
    qmap, bits = QMAPS[name], WIDTH[name]
    codes, absmax = ops.quantize_blockwise(x, qmap, 64, backend="torch", bits=bits)
    assert codes.shape == ((n * bits + 7) // 8,) and absmax.shape == (-(-n // 64),)
    y = x / absmax.repeat_interleave(64)[:n]
    dist = (y[:, None] - qmap[None, :]).abs()
    want = (dist - dist.min(1, keepdim=True).values <= 0).int().argmax(1)  # first (lowest) of the nearest
    assert _bit_stream(codes, n, bits) == want.tolist()
    assert int.from_bytes(bytes(codes.tolist()), "little") >> (n * bits) == 0
    if bits == 4:
        assert torch.equal(torch.stack([codes & 15, codes >> 4], 1).view(-1)[:n].long(), want)
    decoded = ops.dequantize_blockwise(codes, absmax, qmap, 64, backend="torch", bits=bits, numel=n)
    assert torch.equal(decoded, qmap[want] * absmax.repeat_interleave(64)[:n])


def test_nan_gets_the_top_code_and_a_nan_scale():
    x = torch.randn(131)
    x[3], x[130] = float("nan"), float("nan")
    codes, absmax = ops.quantize_blockwise(x, QMAPS["ratio"], 64, backend="torch", bits=4)
    assert int(codes[1]) >> 4 == 15 and int(codes[65]) == 15  # element 3: a high nibble; 130: a lone low one
    assert torch.isnan(absmax[0]) and not torch.isnan(absmax[1]) and torch.isnan(absmax[2])


def test_wrong_sizes_are_usage_errors():
    codes, absmax = ops.quantize_blockwise(torch.randn(129), QMAPS["ratio"], 64, bits=4)
    with pytest.raises(UsageError, match="65 bytes of codes cannot hold 131"):
        ops.dequantize_blockwise(codes, absmax, QMAPS["ratio"], 64, bits=4, numel=131)
    with pytest.raises(UsageError, match="codebook must be a float tensor of 16 entries"):
        ops.dequantize_blockwise(codes, absmax, codebooks.dynamic_map(True), 64, bits=4, numel=129)
    assert ops.dequantize_blockwise(codes, absmax, QMAPS["ratio"], 64, bits=4, numel=129).shape == (129,)


@needs_c
@pytest.mark.parametrize("n", (1, 63, 4097, 3 * 65536 + 77))
@pytest.mark.parametrize("block", (64, 128, 4096))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("name,transform", CODECS)
def test_c_quantize_and_dequantize_match_the_reference(n, block, dtype, name, transform, build):
    gen = torch.Generator().manual_seed(n + block)
    x = _special(n, transform == "none", gen).to(dtype)
    qmap, bits = QMAPS[name], WIDTH[name]
    c1, a1 = ops.quantize_blockwise(x, qmap, block, transform, "torch", bits=bits)
    c2, a2 = ops.quantize_blockwise(x, qmap, block, transform, "native", bits=bits)
    assert torch.equal(c1, c2)
    _assert_same(a1, a2)
    d1 = ops.dequantize_blockwise(c1, a1, qmap, block, transform, "torch", bits=bits, numel=n)
    out = torch.full((n,), 7.0)
    d2 = ops.dequantize_blockwise(c1, a1, qmap, block, transform, "native", out=out, bits=bits, numel=n)
    assert d2.data_ptr() == out.data_ptr()
    _assert_same(d1, d2)


@needs_c
@pytest.mark.parametrize("name", sorted(QMAPS))
def test_c_code_table_equals_searchsorted_on_every_bucket_edge(name, build):
    """Both ends of every 2^16-float bucket in [-1, 1], every threshold +-1 ulp, and NaN, each in a block
    whose absmax is exactly 1 (so y = x): the code table (6 bits) and the register search (4 and 2 bits)
    meet every edge case."""
    qmap, bits = QMAPS[name], WIDTH[name]
    x, t = bucket_edges(qmap)
    codes, _ = ops.quantize_blockwise(x, qmap, 64, backend="native", bits=bits)
    ref, _ = backend_torch.reference_codes(x, t, 64)
    assert torch.equal(backend_torch.unpack_codes(codes, x.numel(), bits), ref)


def _run(cls, p0, grads, backend, **kw):
    p = torch.nn.Parameter(p0.clone())
    if grads[0].dtype != p.dtype:
        p.grad_dtype = grads[0].dtype
    opt = cls([p], lr=1e-2, backend=backend, min_size=64, **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt.state[p]


def _assert_same_states(sa: dict, sb: dict) -> None:
    for key, q in sa.items():
        if isinstance(q, dict):
            assert q["bits"] == sb[key]["bits"] < 8
            assert torch.equal(q["codes"].cpu(), sb[key]["codes"].cpu()), key
            _assert_same(q["absmax"].cpu(), sb[key]["absmax"].cpu())


@needs_c
@pytest.mark.parametrize("n", (65, 4097, 2 * 65536 + 77))  # the last: several chunks of the C path, a short block
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, "bf16-param-fp32-grad"))
@pytest.mark.parametrize("cls,kw", (
    (AdamW4bit, {}),
    (Adam4bit, {"weight_decay": 0.1, "block_size": 4096}),
    (AdamW4bit, {"amsgrad": True, "maximize": True, "block_size": 64}),
))
def test_c_step_matches_the_reference(n, dtype, cls, kw, build):
    """Three steps (zero gradients in places) from the same start: parameters, codes and scales equal."""
    gen = torch.Generator().manual_seed(n)
    pdtype, gdtype = (torch.bfloat16, torch.float32) if dtype == "bf16-param-fp32-grad" else (dtype, dtype)
    p0 = (torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-7, 2, generator=gen)).to(pdtype)
    grads = [(torch.randn(n, generator=gen) * 1e-2).to(gdtype) for _ in range(3)]
    grads[1][::7] = 0
    (pa, sa), (pb, sb) = (_run(cls, p0, grads, b, **kw) for b in ("torch", "native"))
    _assert_same(pa, pb)
    _assert_same_states(sa, sb)


def _nan_inf_grads(n):
    gen = torch.Generator().manual_seed(3)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    g[10], g[n // 2] = float("nan"), float("inf")
    g[-10:] = 1e20  # v overflows to +inf in the short last block
    return p0, [g, g * 0.5]


@needs_c
@pytest.mark.parametrize("n,block", ((5001, 128), (203, 64)))
def test_c_step_with_nan_and_inf_gradients_matches(n, block, build):
    p0, grads = _nan_inf_grads(n)
    (pa, sa), (pb, sb) = (_run(AdamW4bit, p0, grads, b, amsgrad=True, block_size=block) for b in ("torch", "native"))
    _assert_same(pa, pb)
    _assert_same_states(sa, sb)


def _triton():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs here only under TRITON_INTERPRET=1 (set by conftest.py)")
    pytest.importorskip("triton")
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy, inside the interpreter
@pytest.mark.parametrize("n", (1, 63, 65, 999))
@pytest.mark.parametrize("block", (64, 128))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("name,transform", CODECS)
def test_triton_quantize_and_dequantize_match_the_reference(n, block, dtype, name, transform):
    device = _triton()
    gen = torch.Generator().manual_seed(n + block)
    x = _special(n, transform == "none", gen).to(dtype)
    qmap, bits = QMAPS[name], WIDTH[name]
    c1, a1 = ops.quantize_blockwise(x, qmap, block, transform, "torch", bits=bits)
    c2, a2 = ops.quantize_blockwise(x.to(device), qmap.to(device), block, transform, "triton", bits=bits)
    assert torch.equal(c1, c2.cpu())
    _assert_same(a1, a2.cpu())
    d1 = ops.dequantize_blockwise(c1, a1, qmap, block, transform, "torch", bits=bits, numel=n)
    d2 = ops.dequantize_blockwise(c1.to(device), a1.to(device), qmap.to(device), block, transform, "triton",
                                  bits=bits, numel=n)
    _assert_same(d1, d2.cpu())


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning",
                            "ignore:All-NaN slice:RuntimeWarning")
@pytest.mark.parametrize("n,block,kw", ((63, 64, {}), (257, 128, {"amsgrad": True, "maximize": True}),
                                        (203, 64, {"nan": True})))
def test_triton_step_matches_the_reference(n, block, kw):
    device = _triton()
    if kw.pop("nan", False):
        p0, grads = _nan_inf_grads(n)
        kw = {"amsgrad": True}
    else:
        gen = torch.Generator().manual_seed(n)
        p0, grads = torch.randn(n, generator=gen), [torch.randn(n, generator=gen) * 1e-2 for _ in range(2)]
    pa, sa = _run(AdamW4bit, p0, grads, "torch", block_size=block, **kw)
    pb, sb = _run(AdamW4bit, p0.to(device), [g.to(device) for g in grads], "triton", block_size=block, **kw)
    _assert_same(pa, pb.cpu())
    _assert_same_states(sa, sb)


def test_step_refuses_codebooks_and_codes_of_another_width():
    p = torch.randn(300)
    m8 = ops.quantize_blockwise(torch.randn(300), codebooks.power_map(True, 1.5), 64)
    v4 = ops.quantize_blockwise(torch.rand(300), QMAPS["sqrt"], 64, "sqrt", bits=4)
    states = [ops.StepInput(*m8, codebooks.power_map(True, 1.5), codebooks.power_map(True, 1.5)),
              ops.StepInput(*v4, QMAPS["sqrt"], QMAPS["sqrt"])]
    hyper = torch.zeros(10)
    with pytest.raises(UsageError, match="codebook must be a float tensor of 16 entries"):
        ops.adam8bit_step(p, torch.randn(300), states, hyper, block_size=64, ratio=True, bits=4)
    before = v4[0].clone()
    as_8bit = [states[0], ops.StepInput(*v4, codebooks.dynamic_map(False), codebooks.dynamic_map(False))]
    with pytest.raises(UsageError, match="holds 150 code bytes"):
        ops.adam8bit_step(p, torch.randn(300), as_8bit, hyper, block_size=64, ratio=True, bits=8)
    assert torch.equal(v4[0], before)


@pytest.mark.parametrize("bits", (2, 4, 6, 8))
@pytest.mark.parametrize("n", (1, 3, 4, 1001))
def test_reference_pack_and_unpack_are_inverse_and_follow_the_bit_stream(bits, n):
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    packed = torch.empty(ops.code_bytes(n, bits), dtype=torch.uint8)
    backend_torch.pack_codes(codes, packed, bits)
    assert torch.equal(backend_torch.unpack_codes(packed, n, bits), codes)
    assert _bit_stream(packed, n, bits) == codes.tolist()


def test_stochastic_rounding_is_unbiased_between_the_two_neighbours():
    """The reference's stochastic codes (kernels.contract): always the codebook entry just below or just
    above y, y itself on average; an entry of the codebook keeps its code, a NaN gets the top code."""
    qmap = QMAPS["ratio"]
    gen = torch.Generator().manual_seed(0)
    row = torch.cat([torch.rand(59, generator=gen) * 2 - 1, qmap[[0, 5, 7, 12]], torch.tensor([1.0])])  # absmax 1
    x = row.repeat(4000, 1)  # [4000, 64]: each value rounded with 4000 random numbers (element indices differ)
    nearest, absmax = backend_torch.reference_codes(x.reshape(-1), ops.midpoints(qmap), 64)
    u = backend_torch.uniforms(0, x.numel(), 2**32 - 7, "cpu")[0].view(x.shape)
    codes = backend_torch.stochastic_codes(x, absmax, nearest.view(x.shape), qmap, u).long()
    below = (torch.searchsorted(qmap, row, right=True) - 1).clamp(max=14)
    assert bool(((codes == below) | (codes == below + 1)).all())
    exact = torch.isin(row, qmap)
    assert bool((codes[:, exact] == torch.searchsorted(qmap, row[exact])).all())
    # mean of 4000 draws: standard error <= (largest gap / 2) / sqrt(4000) ~ 0.002; nearest rounding
    # would be off by up to half a gap (~0.1) on most values
    assert float((qmap[codes].mean(0) - row).abs().max()) < 0.012
    nan = torch.tensor([[0.5, float("nan")] * 32])
    near, scale = backend_torch.reference_codes(nan.view(-1), ops.midpoints(qmap), 64)
    nan_codes = backend_torch.stochastic_codes(nan, scale, near.view(1, 64), qmap, backend_torch.uniforms(0, 64, 1, "cpu")[1].view(1, 64))
    assert bool((nan_codes[:, 1::2] == 15).all()) and set(nan_codes[:, ::2].unique().tolist()) <= {12, 13}


def _stepped(bits: int, backend: str, seed: int, device: str):
    from tests.kernels.test_kernels_adam import _clone  # the Triton step test's helpers

    from ckptq.optim import adam
    from tests.kernels.test_kernels_adam import step_quantized
    gen = torch.Generator().manual_seed(bits + seed % 97)
    n, block = 1000, 128
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 1e-2
    states = [quant.quantize_ratio(m, v, policy.ratio_eps(1e-8, 0.999, 2), block, bits=bits),
              quant.quantize_state(v, "exp_avg_sq", block, bits=bits)]
    states = [{k: t.to(device) if torch.is_tensor(t) else t for k, t in _clone(q).items()} for q in states]
    p, g = p.to(device), g.to(device)
    hyper = adam.hyper_tensor(1e-2, 0.9, 0.999, 1e-8, 0.1, 3, True, device)
    step_quantized(p, g, *states, None, hyper, ratio_eps=policy.ratio_eps(1e-8, 0.999, 3), backend=backend,
                        seed=seed)
    return p.cpu(), [(q["codes"].cpu(), q["absmax"].cpu()) for q in states]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:divide by zero:RuntimeWarning")
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("backend", ("native", "triton"))
def test_stochastic_steps_match_the_reference_at_both_widths(bits, backend):
    """Seeds below and above 2**31 (Triton takes them as int32 bits); other seeds give other codes."""
    if backend == "native" and native.library() is None:
        pytest.skip(f"C kernels unavailable: {native.why_unavailable()}")
    device = _triton() if backend == "triton" else "cpu"
    for seed in (5, 2**31 + 12345):
        pa, sa = _stepped(bits, "torch", seed, "cpu")
        pb, sb = _stepped(bits, backend, seed, device)
        _assert_same(pa, pb)
        for (ca, aa), (cb, ab) in zip(sa, sb):
            assert torch.equal(ca, cb)
            _assert_same(aa, ab)
    a, b = _stepped(bits, "torch", 6, "cpu")[1], _stepped(bits, "torch", 6 + 97, "cpu")[1]
    assert not torch.equal(a[0][0], b[0][0]) and not torch.equal(a[1][0], b[1][0])  # both moments draw


@pytest.mark.parametrize("seed", (-1, 2**32, True, 1.5))
def test_seed_outside_uint32_is_a_usage_error(seed):
    q = quant.quantize_state(torch.rand(64), "exp_avg_sq", 64, bits=4)
    m = quant.quantize_state(torch.randn(64), "exp_avg", 64, bits=4)
    inputs = [ops.StepInput(s["codes"], s["absmax"], s["qmap"], s["qmap"]) for s in (m, q)]
    with pytest.raises(UsageError, match="seed"):
        ops.adam8bit_step(torch.zeros(64), torch.zeros(64), inputs, torch.zeros(10), block_size=64, ratio=False,
                          bits=4, seed=seed)


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
@pytest.mark.parametrize("widths", MIXES)
@pytest.mark.parametrize("backend", ("native", "triton"))
def test_steps_with_moments_of_different_widths_match_the_reference(widths, backend):
    """The step takes a code width per moment (the 4-bit budget steps a 6-bit ratio with a 2-bit sqrt(v)
    and a 4-bit max_exp_avg_sq): C and Triton equal the reference for every mix, with and without amsgrad
    and stochastic rounding, on sizes that end in a short block and a part-full byte."""
    if backend == "native" and native.library() is None:
        pytest.skip(f"C kernels unavailable: {native.why_unavailable()}")
    device = _triton() if backend == "triton" else "cpu"
    cases = ((1000, False, None), (77, True, 2**31 + 5)) if backend == "triton" else \
        [(n, ams, seed) for n in (77, 1000, 4096 + 64) for ams in (False, True) for seed in (None, 12345)]
    for n, amsgrad, seed in cases:
        pa, sa = _mixed_step(widths, "torch", n, amsgrad, seed)
        pb, sb = _mixed_step(widths, backend, n, amsgrad, seed, device)
        _assert_same(pa, pb)
        for (ca, aa), (cb, ab) in zip(sa, sb):
            assert torch.equal(ca, cb)
            _assert_same(aa, ab)


def test_one_width_per_moment_is_checked():
    states = [ops.StepInput(*ops.quantize_blockwise(torch.randn(64), QMAPS["ratio6"], 64, bits=6), QMAPS["ratio6"],
                            QMAPS["ratio6"]),
              ops.StepInput(*ops.quantize_blockwise(torch.rand(64), QMAPS["sqrt2"], 64, "sqrt", bits=2),
                            QMAPS["sqrt2"], QMAPS["sqrt2"])]
    with pytest.raises(UsageError, match="bits names 3 code widths for 2 moments"):
        ops.adam8bit_step(torch.zeros(64), torch.zeros(64), states, torch.zeros(10), block_size=64, ratio=True,
                          bits=[6, 2, 4])
    with pytest.raises(UsageError, match="codebook must be a float tensor of 4 entries"):
        ops.adam8bit_step(torch.zeros(64), torch.zeros(64), states, torch.zeros(10), block_size=64, ratio=True,
                          bits=[6, 2][::-1])


@pytest.mark.parametrize("bits", (6, 2))
def test_triton_stores_codes_of_tensors_past_2_31_bits(bits):
    """The last byte a store may write is computed in int64: with n * bits past 2**31 an int32 product
    wrapped negative and masked every code byte off (found in review). One program's tile of a tensor of
    400 M (6 bits) or 1.5 G (2 bits) elements must get the codes a 4096-element tensor gets there."""
    device = _triton()
    from ckptq.kernels import backend_triton, triton_blocks

    x = torch.randn(4096, generator=torch.Generator().manual_seed(bits)).to(device)
    qmap = QMAPS["ratio6" if bits == 6 else "sqrt2"].to(device)
    tree = triton_blocks.search_tree(ops.midpoints(qmap))  # the kernel's order of the midpoints
    tile = []
    for n in (4096, 400_000_000 if bits == 6 else 1_500_000_000):  # n * bits wraps negative in int32
        codes = torch.full((4096 * bits // 8,), 0xAA, dtype=torch.uint8, device=device)
        absmax = torch.zeros(32, device=device)
        backend_triton._quantize_kernel[(1,)](x.abs() if bits == 2 else x, tree, codes, absmax,
                                              -(-n // 128), n, BLOCK=128, ROWS=16, SQRT=False, BITS=bits,
                                              ALIGNED=n % 16 == 0)
        tile.append(codes[: 16 * 128 * bits // 8].cpu())
    want, _ = ops.quantize_blockwise(x[: 16 * 128].cpu().abs() if bits == 2 else x[: 16 * 128].cpu(), qmap.cpu(),
                                     128, backend="torch", bits=bits)
    assert torch.equal(tile[0], want) and torch.equal(tile[1], want)
