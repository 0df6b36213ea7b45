"""Blockwise quantize and dequantize (``ops.quantize_blockwise`` / ``dequantize_blockwise``; each backend's
``quantize`` / ``dequantize`` of ``kernels/contract.py``), bit for bit: codes, scales and decoded values.

First the PyTorch reference against brute force: the nearest codebook entry (ties to the lower), the
little-endian bit stream of codes narrower than a byte, pack/unpack, NaN, and stochastic rounding (the
codes the steps write when seeded). Then every backend against the reference, parametrized backend x layout
x width (x dtype x size): the C builds of conftest.py's ``kernel`` fixture and the Triton kernels (in the
interpreter on the CPU: small sizes), flat (irregular sizes that span several chunks and end in a short
block, 2-d and non-contiguous inputs) and in rows (``contract.py``'s "Rows": row lengths that are and are
not multiples of the block), widths 8/6/4/2, fp32/bf16/fp16 inputs, special values (all-zero blocks, -0.0,
subnormals, NaN, Inf), ties on midpoints, every bucket edge of the C code table; then usage errors.
"""

import pytest
import torch

from ckptq.codec import codebooks, ops, policy
from ckptq.errors import UsageError
from ckptq.kernels import backend_torch
from ckptq.kernels.contract import layout_blocks, layout_bytes
from tests.kernels.cases import (C_BUILDS, DEVICE, MAPS, OTHER_BUILDS, assert_same, bucket_edges, device_of, over,
                                 sample, special)

# codebooks narrower than a byte (the reference's brute-force checks, and each backend's codes)
NARROW = {"ratio4": policy.ratio_policy(4).qmap(), "sqrt4": policy.policy_for("exp_avg_sq", 4).qmap(),
          "signed4-2.5": codebooks.power_map(True, 2.5, 4), "ratio6": policy.ratio_policy(6).qmap(),
          "sqrt2": policy.policy_for("exp_avg_sq", 2).qmap()}
BOOKS = {"dynamic-signed": codebooks.dynamic_map(True), "dynamic-unsigned": codebooks.dynamic_map(False),
         **{name: pol.qmap() for name, pol in (("exp_avg", policy.POLICIES["exp_avg"]),
                                                ("exp_avg_sq", policy.POLICIES["exp_avg_sq"]),
                                                ("ratio", policy.RATIO_POLICY))},
         **NARROW}
WIDTH = {name: {256: 8, 64: 6, 16: 4, 4: 2}[q.numel()] for name, q in BOOKS.items()}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bit_stream(codes: torch.Tensor, n: int, bits: int) -> list[int]:
    """The n codes read from the bytes the plain way: element i is bits [i * bits, (i + 1) * bits) of the
    little-endian stream (kernels.contract)."""
    stream = int.from_bytes(bytes(codes.tolist()), "little")
    return [(stream >> (i * bits)) & (2**bits - 1) for i in range(n)]


# ---- the reference against brute force ----

def test_codebooks_are_sorted_and_hold_their_ends():
    for name, qmap in NARROW.items():
        assert qmap.shape == (2 ** WIDTH[name],) and bool((qmap[1:] > qmap[:-1]).all())
        assert float(qmap[-1]) == 1.0 and (0.0 in qmap.tolist()) == (name not in ("sqrt4", "sqrt2"))
    assert float(NARROW["ratio4"][0]) == float(NARROW["ratio6"][0]) == -1.0
    assert NARROW["sqrt2"].tolist() == pytest.approx([1 / 27, 1 / 9, 1 / 3, 1])
    assert NARROW["sqrt4"].tolist() == pytest.approx([1.3 ** (k - 15) for k in range(16)])  # no 0: see qstate


@pytest.mark.parametrize("n", (1, 2, 3, 127, 129, 1001))
@pytest.mark.parametrize("name", ("ratio4", "ratio6", "sqrt2"))
def test_reference_codes_are_the_nearest_entry_in_a_little_endian_bit_stream(n, name):
    """Brute force: each code is the nearest codebook entry of x / absmax (ties to the lower), element i
    at bit i * bits of the little-endian stream (4 bits: element 2i in the low nibble of byte i); the bits
    after the last code are 0."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen)
    qmap, bits = NARROW[name], WIDTH[name]
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


@pytest.mark.parametrize("bits", (2, 4, 6, 8))
@pytest.mark.parametrize("n", (1, 3, 4, 1001))
def test_reference_pack_and_unpack_are_inverse_and_follow_the_bit_stream(bits, n):
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    packed = torch.empty(ops.code_bytes(n, bits), dtype=torch.uint8)
    backend_torch.pack_codes(codes, packed, bits)
    assert torch.equal(backend_torch.unpack_codes(packed, n, bits), codes)
    assert _bit_stream(packed, n, bits) == codes.tolist()


def test_reference_nan_gets_the_top_code_and_a_nan_scale():
    x = torch.randn(131)
    x[3], x[130] = float("nan"), float("nan")
    codes, absmax = ops.quantize_blockwise(x, NARROW["ratio4"], 64, backend="torch", bits=4)
    assert int(codes[1]) >> 4 == 15 and int(codes[65]) == 15  # element 3: a high nibble; 130: a lone low one
    assert torch.isnan(absmax[0]) and not torch.isnan(absmax[1]) and torch.isnan(absmax[2])


def test_reference_stochastic_rounding_is_unbiased_between_the_two_neighbours():
    """The reference's stochastic codes (kernels.contract): always the codebook entry just below or just
    above y, y itself on average; an entry of the codebook keeps its code, a NaN gets the top code."""
    qmap = NARROW["ratio4"]
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
    nan_codes = backend_torch.stochastic_codes(nan, scale, near.view(1, 64), qmap,
                                               backend_torch.uniforms(0, 64, 1, "cpu")[1].view(1, 64))
    assert bool((nan_codes[:, 1::2] == 15).all()) and set(nan_codes[:, ::2].unique().tolist()) <= {12, 13}


# ---- every backend against the reference: the flat layout ----

def assert_codec_matches(kernel: str, x: torch.Tensor, qmap: torch.Tensor, block: int, transform: str,
                         bits: int = 8) -> None:
    """ops' quantize and dequantize on ``kernel`` (x and qmap on its device; the reference's on the CPU): the
    same codes, scales and decoded values; the C kernels also decode into a given ``out``."""
    dev = device_of(kernel)
    c1, a1 = ops.quantize_blockwise(x.cpu(), qmap, block, transform, "torch", bits=bits)
    c2, a2 = ops.quantize_blockwise(x.to(dev), qmap.to(dev), block, transform, kernel, bits=bits)
    assert c2.dtype == torch.uint8 and a2.dtype == torch.float32
    assert torch.equal(c1, c2.cpu()), f"{int((c1 != c2.cpu()).sum())} codes differ"
    assert_same(a1, a2.cpu())
    n = x.numel()
    d1 = ops.dequantize_blockwise(c1, a1, qmap, block, transform, "torch", bits=bits, numel=n)
    d2 = ops.dequantize_blockwise(c1.to(dev), a1.to(dev), qmap.to(dev), block, transform, kernel, bits=bits, numel=n)
    assert_same(d1, d2.cpu())
    if kernel == "native":
        out = torch.full((n,), 7.0)
        d3 = ops.dequantize_blockwise(c1, a1, qmap, block, transform, kernel, out=out, bits=bits, numel=n)
        assert d3.data_ptr() == out.data_ptr()
        assert_same(d1, d3)


SIZES = (1, 63, 4097, 3 * 65536 + 77)  # several chunks of the C path (at least 64K elements each), a short block
CODECS = {8: (("dynamic-signed", "none"), ("dynamic-unsigned", "sqrt"), ("dynamic-unsigned", "none")),
          "narrow": (("ratio4", "none"), ("sqrt4", "sqrt"), ("ratio6", "none"), ("sqrt2", "sqrt"))}
FLAT = (  # C: every build, every width, big sizes; Triton: small ones ("wide": special(), "6dec": sample())
    [(b, WIDTH[q], q, t, n, block, dtype, "wide") for b in C_BUILDS for n in SIZES for block in (64, 256, 4096)
     for dtype in DTYPES for q, t in CODECS[8]]
    + [(b, WIDTH[q], q, t, n, block, dtype, "wide") for b in C_BUILDS for n in SIZES for block in (64, 128, 4096)
       for dtype in DTYPES for q, t in CODECS["narrow"]]
    + [("triton", WIDTH[q], q, t, n, block, dtype, "wide") for n in (1, 63, 65, 999) for block in (64, 128)
       for dtype in DTYPES[:2] for q, t in CODECS["narrow"]]
    + [("triton", 8, q, t, shape, block, dtype, "6dec") for block in (64, 256, 4096)
       for shape in ((1,), (block - 1,), (block + 1,), (4999,), (37, 91)) for dtype in DTYPES
       for q in ("dynamic-signed", "dynamic-unsigned") for t in ("none", "sqrt")])


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy, inside the interpreter
@over("bits,codebook,transform,shape,block,dtype,values", FLAT)
def test_flat_matches_reference(kernel, bits, codebook, transform, shape, block, dtype, values):
    qmap, signed = BOOKS[codebook], bool((BOOKS[codebook] < 0).any())
    if values == "wide":
        x = special(shape, signed, torch.Generator().manual_seed(shape + block)).to(dtype)
    else:
        x = sample(shape, dtype, transform == "sqrt" or not signed, seed=block + len(shape) * 1000 + shape[0])
    assert_codec_matches(kernel, x, qmap, block, transform, bits)


@over("name", [(b, name) for b in C_BUILDS for name in sorted(BOOKS)])
def test_code_table_equals_searchsorted_on_every_bucket_edge(kernel, name):
    """Both ends of every 2^16-float bucket in [-1, 1], every threshold +-1 ulp, and NaN, each in a block
    whose absmax is exactly 1 (so y = x): the code table (8 and 6 bits) and the register search (4 and 2
    bits) meet every edge case."""
    qmap, bits = BOOKS[name], WIDTH[name]
    x, t = bucket_edges(qmap)
    codes, absmax = ops.quantize_blockwise(x, qmap, 64, backend=kernel, bits=bits)
    ref, _ = backend_torch.reference_codes(x, t, 64)
    assert torch.equal(backend_torch.unpack_codes(codes, x.numel(), bits), ref)
    assert torch.equal(absmax.isnan(), torch.isnan(x.view(-1, 64)).any(1))


BOTH = ("native", "triton")


@over("transform", [(b, t) for b in BOTH for t in ("none", "sqrt")])
def test_all_zero_blocks_get_scale_zero_and_the_code_of_zero(kernel, transform):
    x = sample((5 * 256 + 17,), torch.float32, non_negative=True, seed=1)
    x[256:512] = 0.0
    x[768:1024] = -0.0
    x[1280:] = 0.0  # the short last block
    qmap = codebooks.dynamic_map(False)
    dev = device_of(kernel)
    codes, absmax = (t.cpu() for t in ops.quantize_blockwise(x.to(dev), qmap.to(dev), 256, transform, kernel))
    assert torch.equal(absmax[[1, 3, 5]], torch.zeros(3))
    zero_code = int((qmap == 0).nonzero())
    assert bool((codes[256:512] == zero_code).all()) and bool((codes[1280:] == zero_code).all())
    assert_codec_matches(kernel, x, qmap, 256, transform)
    assert_codec_matches(kernel, torch.zeros(100), qmap, 64, transform)


@over("signed,scale", [(b, s, scale) for b in BOTH for s in (True, False) for scale in (1.0, 2.0**-10, 4.0)])
def test_ties_on_midpoints_go_to_the_lower_code(kernel, signed, scale):
    # One block per probe set: [absmax, t[j]*absmax, just below, just above]; power-of-two scales keep
    # y = x / absmax exactly on (or one ulp beside) the midpoint.
    qmap = codebooks.dynamic_map(signed)
    t = ops.midpoints(qmap)  # [255]
    probes = torch.cat([t, torch.nextafter(t, torch.tensor(-2.0)), torch.nextafter(t, torch.tensor(2.0))])
    block = torch.cat([torch.ones(1), probes, torch.zeros(1024 - 1 - probes.numel())])
    x = block * scale
    dev = device_of(kernel)
    codes, _ = ops.quantize_blockwise(x.to(dev), qmap.to(dev), 1024, "none", kernel)
    expected = (t[None, :] < block[:, None]).sum(dim=1)  # brute-force #{t < y}
    assert torch.equal(codes.cpu().long(), expected)
    assert_codec_matches(kernel, x, qmap, 1024, "none")


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy, inside the interpreter
@over("transform", [(b, t) for b in BOTH for t in ("none", "sqrt")])
def test_non_finite_values_match_reference(kernel, transform):
    x = sample((4 * 64,), torch.float32, non_negative=transform == "sqrt", seed=2)
    x[3], x[70], x[140], x[141], x[200] = float("nan"), float("inf"), float("-inf"), 0.5, float("inf")
    assert_codec_matches(kernel, x, codebooks.dynamic_map(True), 64, transform)


@over("dtype", [(b, torch.bfloat16) for b in BOTH])
def test_non_contiguous_input_is_read_and_not_modified(kernel, dtype):
    x = sample((91, 37), dtype, non_negative=False, seed=3).to(device_of(kernel)).t()  # [37, 91], not contiguous
    before = x.clone()
    assert_codec_matches(kernel, x, codebooks.dynamic_map(True), 64, "none")
    assert torch.equal(x, before)


@over("bits", [(b, bits) for b in BOTH for bits in (8, 2)])
def test_empty_input(kernel, bits):
    dev = device_of(kernel)
    qmap = (codebooks.dynamic_map(True) if bits == 8 else NARROW["sqrt2"]).to(dev)
    codes, absmax = ops.quantize_blockwise(torch.empty(0, device=dev), qmap, 256, "none", kernel, bits=bits)
    assert codes.shape == (0,) and absmax.shape == (0,)
    assert ops.dequantize_blockwise(codes, absmax, qmap, 256, "none", kernel, bits=bits).shape == (0,)


@over("bits", [("triton", 6), ("triton", 2)])
def test_triton_stores_codes_of_tensors_past_2_31_bits(kernel, bits):
    """The last byte a store may write is computed in int64: with n * bits past 2**31 an int32 product
    wrapped negative and masked every code byte off (found in review). One program's tile of a tensor of
    400 M (6 bits) or 1.5 G (2 bits) elements must get the codes a 4096-element tensor gets there."""
    from ckptq.kernels import backend_triton, triton_blocks

    x = torch.randn(4096, generator=torch.Generator().manual_seed(bits)).to(DEVICE)
    qmap = NARROW["ratio6" if bits == 6 else "sqrt2"].to(DEVICE)
    tree = triton_blocks.search_tree(ops.midpoints(qmap))  # the kernel's order of the midpoints
    tile = []
    for n in (4096, 400_000_000 if bits == 6 else 1_500_000_000):  # n * bits wraps negative in int32
        codes = torch.full((4096 * bits // 8,), 0xAA, dtype=torch.uint8, device=DEVICE)
        absmax = torch.zeros(32, device=DEVICE)
        backend_triton._quantize_kernel[(1,)](x.abs() if bits == 2 else x, tree, codes, absmax,
                                              -(-n // 128), n, BLOCK=128, ROWS=16, SQRT=False, BITS=bits,
                                              ALIGNED=n % 16 == 0)
        tile.append(codes[: 16 * 128 * bits // 8].cpu())
    want, _ = ops.quantize_blockwise(x[: 16 * 128].cpu().abs() if bits == 2 else x[: 16 * 128].cpu(), qmap.cpu(),
                                     128, backend="torch", bits=bits)
    assert torch.equal(tile[0], want) and torch.equal(tile[1], want)


# ---- every backend against the reference: rows ----

def assert_rows_match(kernel: str, rows: int, row_len: int, block: int, bits: int, dtype: torch.dtype) -> None:
    """Quantize in rows with the reference and ``kernel``'s implementation (the one ops sends rows to) into
    buffers filled with other bytes (none may be left unwritten), on a signed codebook and an unsigned one with
    the square-root transform; decode each: equal codes, scales and values."""
    from ckptq.kernels import registry

    impl, dev = registry.backend(kernel), device_of(kernel)
    assert ops._implementation(kernel, (dtype,), (ops.midpoints(MAPS[bits][0]).to(dev),), flat=False) is impl
    n = rows * row_len
    gen = torch.Generator().manual_seed(bits * 1000 + n + block)
    x = special(n, True, gen)
    x = torch.where(x.abs() < 6e4, x, x.sign() * 6e4).to(dtype) if dtype == torch.float16 else x.to(dtype)
    for qmap, sqrt in zip(MAPS[bits], (False, True)):
        src = x.abs() if sqrt else x
        out = []
        for im, d in ((registry.backend("torch"), "cpu"), (impl, dev)):
            codes = torch.full((layout_bytes(n, row_len, bits),), 0xA5, dtype=torch.uint8, device=d)
            absmax = torch.full((layout_blocks(n, row_len, block),), 7.0, device=d)
            im.quantize(src.to(d), ops.midpoints(qmap).to(d), block, sqrt, codes, absmax, bits, row_len)
            decoded = torch.full((n,), 7.0, device=d)
            im.dequantize(codes, absmax, qmap.to(d), block, sqrt, decoded, False, bits, row_len)
            out.append((codes.cpu(), absmax.cpu(), decoded.cpu()))
        (c1, a1, d1), (c2, a2, d2) = out
        assert torch.equal(c1, c2), f"{int((c1 != c2).sum())} code bytes differ"
        assert_same(a1, a2)
        assert_same(d1, d2)


# (rows, row_len, block): rows that are not whole blocks (short last blocks of every length class: 1,
# block - 1, a vector's worth and a remainder, ...), plus one that is (the flat layout, same bits)
ROW_CASES = [(5, 1, 64), (3, 63, 64), (3, 65, 64), (2, 3 * 64 + 7, 64), (4, 201, 64), (3, 577, 256), (2, 255, 256),
             (3, 300, 128), (2, 1023, 512), (2, 2049, 1024), (2, 4095, 2048), (2, 4097, 4096), (2, 3 * 4096 + 7, 4096),
             (3, 512, 256)]
TRITON_ROWS = [(5, 1, 64), (3, 63, 64), (3, 65, 64), (3, 201, 64), (3, 128, 64)]  # the last: whole blocks
ROWS = ([("native", bits, *case) for case in ROW_CASES for bits in (8, 6, 4, 2)]
        + [(b, bits, 3, 577, 256) for b in OTHER_BUILDS for bits in (8, 6, 4, 2)]
        + [("triton", bits, *case) for case in TRITON_ROWS for bits in (8, 6, 4, 2)])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy, inside the interpreter
@over("bits,rows,row_len,block", ROWS)
def test_rows_match_reference(kernel, bits, rows, row_len, block):
    assert_rows_match(kernel, rows, row_len, block, bits, DTYPES[(rows * row_len + bits) % 3])


# ---- usage errors ----

@over("bits", [(b, 8) for b in BOTH])
def test_bad_arguments_raise_usage_errors(kernel, bits):
    dev = device_of(kernel)
    qmap, x = codebooks.dynamic_map(True).to(dev), torch.ones(300, device=dev)
    with pytest.raises(UsageError, match="int32"):
        ops.quantize_blockwise(x.int(), qmap, 256, "none", backend=kernel)
    with pytest.raises(UsageError, match="block size"):
        ops.quantize_blockwise(x, qmap, 100, "none", backend=kernel)
    with pytest.raises(UsageError, match="codebook"):
        ops.quantize_blockwise(x, qmap[:255], 256, "none", backend=kernel)
    with pytest.raises(UsageError, match="transform"):
        ops.quantize_blockwise(x, qmap, 256, "log", backend=kernel)
    codes, absmax = ops.quantize_blockwise(x, qmap, 256, "none", backend=kernel)
    with pytest.raises(UsageError, match="absmax"):
        ops.dequantize_blockwise(codes, absmax[:1], qmap, 256, "none", backend=kernel)
    with pytest.raises(UsageError, match="uint8"):
        ops.dequantize_blockwise(codes.int(), absmax, qmap, 256, "none", backend=kernel)


def test_wrong_sizes_are_usage_errors():
    codes, absmax = ops.quantize_blockwise(torch.randn(129), NARROW["ratio4"], 64, bits=4)
    with pytest.raises(UsageError, match="65 bytes of codes cannot hold 131"):
        ops.dequantize_blockwise(codes, absmax, NARROW["ratio4"], 64, bits=4, numel=131)
    with pytest.raises(UsageError, match="codebook must be a float tensor of 16 entries"):
        ops.dequantize_blockwise(codes, absmax, codebooks.dynamic_map(True), 64, bits=4, numel=129)
    assert ops.dequantize_blockwise(codes, absmax, NARROW["ratio4"], 64, bits=4, numel=129).shape == (129,)


@over("bits", [("native", 8)])
def test_malformed_states_never_reach_the_kernel(kernel, bits):
    """What the C kernel would read or write out of bounds is refused before: a short absmax or an
    unsupported block size in a loaded state dict, a short absmax / wrong codes dtype / short codebook
    in dequantize."""
    from ckptq.errors import StateMismatchError
    from ckptq.optim import AdamW8bit

    p = torch.nn.Parameter(torch.randn(5000))
    opt = AdamW8bit([p], min_size=64)
    p.grad = torch.randn(5000)
    opt.step()
    good = opt.state_dict()
    for key, bad in (("absmax", lambda q: q["absmax"].reshape(-1)[:3]), ("block_size", lambda q: 8192)):
        sd = {"state": {0: {**good["state"][0], "exp_avg_sq": {**good["state"][0]["exp_avg_sq"],
                                                                key: bad(good["state"][0]["exp_avg_sq"])}}},
              "param_groups": good["param_groups"]}
        with pytest.raises(StateMismatchError, match="malformed"):
            AdamW8bit([p], min_size=64).load_state_dict(sd)
    q = good["state"][0]["exp_avg_sq"]
    for args, match in (((q["codes"], q["absmax"].reshape(-1)[:3], q["qmap"]), "absmax"),
                        ((q["codes"].int(), q["absmax"], q["qmap"]), "uint8"),
                        ((q["codes"], q["absmax"], q["qmap"][:16]), "codebook")):
        for backend in ("torch", kernel):
            with pytest.raises(UsageError, match=match):
                ops.dequantize_blockwise(*args, 256, "sqrt", backend)
