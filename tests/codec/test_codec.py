"""The CPU codec against its contract: code = #{fp32 midpoints < x / absmax}, ties to the lower code.

Both CPU paths (PyTorch: lookup table + one compare; the C kernels), chunked over a thread pool, must
equal, bit for bit, a plain ``torch.searchsorted`` over the midpoints, and that must be a nearest-entry
rounding.
"""

import pytest
import numpy as np
import torch

from ckptq.codec import codebooks, ops, policy
from ckptq.errors import UsageError
from ckptq.kernels import backend_torch, cpu_runtime, lut, native

MAPS = {"signed": codebooks.dynamic_map(True), "unsigned": codebooks.dynamic_map(False)}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The CPU implementations: PyTorch, and the C kernels where they build (tests/kernels/test_quantize.py has more).
CPU_BACKENDS = ("torch", pytest.param("native", marks=pytest.mark.skipif(
    native.library() is None, reason=f"C kernels unavailable: {native.why_unavailable()}")))


def searchsorted_quantize(x, qmap, block_size, transform):
    """The contract written plainly: fp32 [n] -> (codes int64 [n], absmax fp32 [nb])."""
    flat = x.reshape(-1).to(torch.float32)
    if transform == "sqrt":  # IEEE-rounded sqrt (numpy's); torch's CPU fp32 sqrt is not always
        flat = torch.from_numpy(np.sqrt(flat.numpy()))
    nb = ops.num_blocks(flat.numel(), block_size)
    blocks = torch.nn.functional.pad(flat, (0, nb * block_size - flat.numel())).view(nb, block_size)
    absmax = blocks.abs().amax(dim=1)
    y = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
    return torch.searchsorted(ops.midpoints(qmap), y).reshape(-1)[: flat.numel()], absmax


def sample(n, signed, transform, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 1e-3
    if not signed or transform == "sqrt":  # a second moment: many decades, >= 0
        x = x**2 * torch.pow(10.0, torch.empty(n).uniform_(-8, -2, generator=g))
    return x.to(dtype)


def assert_same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def edge_values(qmap):
    """Values in [-1, 1] where rounding can go wrong: every midpoint and its fp32 neighbours, +-0,
    subnormals, +-1, and the first/last float of every 2^16-float bucket of the lookup table."""
    t = ops.midpoints(qmap)
    inf = torch.tensor(float("inf"))
    mids = torch.cat([t, torch.nextafter(t, inf), torch.nextafter(t, -inf)])
    tiny = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 1.1754942e-38, 1.0, -1.0])
    top = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int64) << 16
    bucket_edges = torch.cat([top, top | 0xFFFF]).to(torch.int32).view(torch.float32)
    bucket_edges = bucket_edges[bucket_edges.abs() <= 1]
    return torch.cat([mids, tiny, bucket_edges])


@pytest.mark.parametrize("name", MAPS)
def test_searchsorted_codes_are_nearest_entries(name):
    # Brute force in float64: the code is the nearest codebook entry, except within one fp32 ulp of a
    # midpoint (the midpoint itself is an fp32 rounding), where it is one of the two neighbours; a value
    # exactly on an fp32 midpoint goes to the lower code.
    qmap = MAPS[name]
    t = ops.midpoints(qmap)
    y = torch.cat([edge_values(qmap), torch.empty(20000).uniform_(-1, 1)])
    codes = torch.searchsorted(t, y)
    dist = (y.double()[:, None] - qmap.double()[None, :]).abs()  # [n, 256]
    nearest = dist.argmin(dim=1)
    gap = torch.nextafter(t.abs(), torch.tensor(float("inf"))) - t.abs()  # one ulp at each midpoint
    near_mid = ((y[:, None] - t[None, :]).abs() <= gap[None, :]).any(dim=1)
    assert torch.equal(codes[~near_mid], nearest[~near_mid])
    assert bool(((codes - nearest).abs() <= 1).all())
    on_mid = torch.searchsorted(t, y, right=True) != codes  # y equals some t[j] exactly
    assert on_mid.any()
    assert torch.equal(t[codes[on_mid]], y[on_mid])  # code j for y == t[j]: the lower neighbour


@pytest.mark.parametrize("name", MAPS)
def test_lookup_table_equals_searchsorted_on_every_bucket(name):
    # Both ends of all 2^16 buckets (including |y| > 1, inf and NaN), each midpoint and its neighbours.
    t = ops.midpoints(MAPS[name])
    table = lut.code_table(t)
    assert table is not None
    top = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int64) << 16
    bits = torch.cat([top, top | 0xFFFF, top | 0x8000]).to(torch.int32)
    quiet = (bits & 0x7FC00000) != 0x7F800000  # y comes out of a division: never a signalling NaN
    y = torch.cat([bits[quiet | (bits & 0x7FFFFF == 0)].view(torch.float32), edge_values(MAPS[name])])
    codes = torch.empty(y.numel(), dtype=torch.uint8)
    backend_torch.lookup_codes(y, table, codes, cpu_runtime.Workspace(y.numel(), y.device))
    assert torch.equal(codes.long(), torch.searchsorted(t, y))


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_edge_values_end_to_end(name, backend):
    # Blocks of 256 that each contain 1.0 have absmax 1, so y == x: every edge value goes through
    # quantize_blockwise unchanged, in the bulk of a chunk and in a short last block.
    qmap = MAPS[name]
    y = edge_values(qmap)
    y = torch.cat([y, torch.zeros(-y.numel() % 255)]).view(-1, 255)
    x = torch.cat([y, torch.ones(y.shape[0], 1)], dim=1).reshape(-1)[:-100]
    codes, absmax = ops.quantize_blockwise(x, qmap, 256, backend=backend)
    full = x.numel() // 256 * 256
    assert torch.equal(absmax[:-1], torch.ones(absmax.numel() - 1))
    assert torch.equal(codes[:full].long(), torch.searchsorted(ops.midpoints(qmap), x[:full]))
    assert torch.equal(codes.long(), searchsorted_quantize(x, qmap, 256, "none")[0])


def sizes(block_size):
    return (0, 1, block_size - 1, block_size, block_size + 1, 98432, (37, 129))


@pytest.mark.parametrize("block_size", policy.BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,transform", [("signed", "none"), ("unsigned", "sqrt"), ("unsigned", "none")])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_quantize_equals_searchsorted(block_size, dtype, name, transform, backend):
    qmap = MAPS[name]
    for size in sizes(block_size):
        x = sample(size if isinstance(size, int) else size[0] * size[1], name == "signed", transform, dtype)
        x = x.view(size) if isinstance(size, tuple) else x
        codes, absmax = ops.quantize_blockwise(x, qmap, block_size, transform, backend)
        ref_codes, ref_absmax = searchsorted_quantize(x, qmap, block_size, transform)
        assert codes.dtype == torch.uint8 and torch.equal(codes.long(), ref_codes), size
        assert_same_bits(absmax, ref_absmax)
        out = ops.dequantize_blockwise(codes, absmax, qmap, block_size, transform, backend)
        scale = absmax.repeat_interleave(block_size)[: codes.numel()]
        ref = qmap[codes.long()] * scale
        assert_same_bits(out, ref * ref if transform == "sqrt" else ref)


@pytest.mark.parametrize("name,transform", [("signed", "none"), ("unsigned", "sqrt")])
def test_round_trip_error_is_within_half_a_codebook_gap(name, transform):
    # Bound: s = x / absmax (s = sqrt(x) / absmax for "sqrt") lies between the entries either side of
    # q[c], so |q[c] - s| <= gap(c) / 2 with gap(c) the larger of q[c]'s two gaps; hence
    # |x_hat - x| <= absmax * gap(c) / 2 (times (s_hat + s) * absmax for "sqrt"), plus fp32 rounding.
    qmap, block_size = MAPS[name], 256
    x = sample(1 << 18, name == "signed", transform, torch.float32, seed=3)
    codes, absmax = ops.quantize_blockwise(x, qmap, block_size, transform)
    x_hat = ops.dequantize_blockwise(codes, absmax, qmap, block_size, transform)
    gaps = qmap[1:] - qmap[:-1]
    gap = torch.maximum(torch.cat([gaps, gaps[-1:]]), torch.cat([gaps[:1], gaps]))[codes.long()]
    scale = absmax.repeat_interleave(block_size)
    err_s = scale * gap / 2 + 4 * torch.finfo(torch.float32).eps * scale
    if transform == "sqrt":
        err = err_s * (x_hat.sqrt() + x.sqrt())
    else:
        err = err_s
    assert bool(((x_hat - x).abs() <= err).all())
    assert float((x_hat - x).abs().max()) > 0  # the bound is not vacuous: rounding did happen


@pytest.mark.parametrize("transform", ops.TRANSFORMS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_chunks_and_threads_match_quantizing_the_parts(transform, backend):
    # Just over one CPU chunk, with a short last block: the pool runs two chunks.
    block_size, chunk = 256, cpu_runtime.CPU_CHUNK
    x = sample(chunk + 3 * block_size + 5, False, transform, torch.float32, seed=1)
    qmap = MAPS["unsigned"]
    codes, absmax = ops.quantize_blockwise(x, qmap, block_size, transform, backend)
    first = ops.quantize_blockwise(x[:chunk], qmap, block_size, transform, backend)
    rest = ops.quantize_blockwise(x[chunk:], qmap, block_size, transform, backend)
    assert torch.equal(codes, torch.cat([first[0], rest[0]]))
    assert_same_bits(absmax, torch.cat([first[1], rest[1]]))
    ref_codes, _ = searchsorted_quantize(x, qmap, block_size, transform)
    assert torch.equal(codes.long(), ref_codes)
    out = ops.dequantize_blockwise(codes, absmax, qmap, block_size, transform, backend)
    parts = [ops.dequantize_blockwise(c, a, qmap, block_size, transform, backend) for c, a in (first, rest)]
    assert_same_bits(out, torch.cat(parts))


def test_special_blocks():
    # All-zero and all-minus-zero blocks get absmax +0.0 and the code of 0; a block of equal values
    # quantizes to the code of 1.0; a non-contiguous input equals its contiguous copy.
    qmap = MAPS["signed"]
    x = torch.cat([torch.zeros(256), -torch.zeros(256), torch.full((256,), -3.0), torch.randn(256)])
    codes, absmax = ops.quantize_blockwise(x, qmap, 256)
    zero_code = int((qmap == 0).nonzero())
    assert torch.equal(codes[:512], torch.full((512,), zero_code, dtype=torch.uint8))
    assert_same_bits(absmax[:2], torch.zeros(2))
    assert torch.equal(codes[512:768], torch.zeros(256, dtype=torch.uint8))  # -1.0 is code 0
    m = torch.randn(300, 700).t()
    assert torch.equal(ops.quantize_blockwise(m, qmap)[0], ops.quantize_blockwise(m.contiguous(), qmap)[0])


def test_codebook_without_table_falls_back_to_searchsorted():
    # Two midpoints inside one 2^16-float bucket: no lookup table, same contract.
    qmap = torch.linspace(-1, 1, 256)
    qmap[128:131] = torch.tensor([0.5, 0.5 + 2**-20, 0.5 + 2**-19])
    qmap = qmap.sort().values
    assert lut.code_table(ops.midpoints(qmap)) is None
    x = torch.randn(5000)
    codes, absmax = ops.quantize_blockwise(x, qmap, 256)
    assert torch.equal(codes.long(), searchsorted_quantize(x, qmap, 256, "none")[0])


def test_bad_arguments_raise_usage_errors():
    with pytest.raises(UsageError, match="block size 100"):
        ops.quantize_blockwise(torch.randn(10), MAPS["signed"], 100)
    with pytest.raises(UsageError, match="transform 'log'"):
        ops.dequantize_blockwise(torch.zeros(10, dtype=torch.uint8), torch.ones(1), MAPS["signed"], 256, "log")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_backend_on_cuda_matches_cpu():
    x = sample(1 << 20, True, "none", torch.float32)
    qmap = MAPS["signed"]
    cpu = ops.quantize_blockwise(x, qmap, 256, "none", "torch")
    gpu = ops.quantize_blockwise(x.cuda(), qmap.cuda(), 256, "none", "torch")
    assert torch.equal(cpu[0], gpu[0].cpu()) and torch.equal(cpu[1], gpu[1].cpu())
    out = ops.dequantize_blockwise(gpu[0], gpu[1], qmap.cuda(), 256, "none", "torch")
    assert torch.equal(out.cpu(), ops.dequantize_blockwise(*cpu, qmap, 256, "none", "torch"))


def test_dequantize_into_out_buffer():
    x = torch.randn(5000) * 1e-3
    qmap = MAPS["signed"]
    codes, absmax = ops.quantize_blockwise(x, qmap, 256)
    out = torch.full((5000,), float("nan"))
    got = ops.dequantize_blockwise(codes, absmax, qmap, 256, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, ops.dequantize_blockwise(codes, absmax, qmap, 256))
    with pytest.raises(UsageError, match="out must be"):
        ops.dequantize_blockwise(codes, absmax, qmap, 256, out=torch.empty(4999))


def test_pair_gather_handles_odd_and_unaligned_code_views():
    x = torch.randn(4099) * 1e-3
    qmap = MAPS["signed"]
    codes, absmax = ops.quantize_blockwise(x, qmap, 64)
    ref = qmap[codes.long()] * absmax.repeat_interleave(64)[:4099]
    assert torch.equal(ops.dequantize_blockwise(codes, absmax, qmap, 64), ref)  # odd count
    shifted = torch.empty(4100, dtype=torch.uint8)[1:]  # storage offset 1: not 2-byte aligned
    shifted.copy_(codes)
    assert torch.equal(ops.dequantize_blockwise(shifted, absmax, qmap, 64), ref)


def test_large_outputs_on_huge_page_buffers_are_ordinary_tensors():
    """Past cpu_runtime.HUGE_MIN_BYTES outputs live in a THP-advised mapping: same values, usable as usual."""
    n = (cpu_runtime.HUGE_MIN_BYTES // 4) + 1001
    x = torch.randn(n) * 1e-3
    qmap = MAPS["signed"]
    codes, absmax = ops.quantize_blockwise(x, qmap, 256)
    y = ops.dequantize_blockwise(codes, absmax, qmap, 256)
    small = ops.dequantize_blockwise(codes[:4096], absmax[:16], qmap, 256)  # torch.empty path
    assert torch.equal(y[:4096], small) and y.shape == (n,) and y.dtype == torch.float32
    y.mul_(2).add_(1)  # writable
    assert torch.equal(torch.load(_save_load(y), weights_only=True), y)


def _save_load(t):
    import io

    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    return buf
