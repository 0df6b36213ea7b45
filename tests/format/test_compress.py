import json

import numpy as np
import pytest
import torch
import zstandard

from ckptq.format.compress import MIN_BYTES, compress, decompress
from ckptq.errors import FormatError

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.uint8, torch.int64, torch.bool]
SIZES = [0, 1, 7, 1023, 4097, 50_001]
CHUNK = 4096  # small chunks so that 50_001 elements span several chunks for every dtype


def weight_like(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values shaped like trained tensors: small normal floats, skewed small ints, sparse bools."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 0.02).to(dtype)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.9
    return torch.randn(n, generator=g).abs().mul(20).to(dtype)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def roundtrip(t: torch.Tensor, **kw) -> torch.Tensor:
    payload, params = compress(t, chunk_bytes=CHUNK, **kw)
    out = decompress(bytes(payload), json.loads(json.dumps(params)), t.dtype, t.numel())
    assert out.dtype == t.dtype and out.shape == (t.numel(),) and out.is_contiguous()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_roundtrip_is_bit_exact(dtype, n):
    t = weight_like(n, dtype)
    assert as_bytes(roundtrip(t)) == as_bytes(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_nan_inf_and_signed_zero_payloads_survive(dtype):
    k = torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(0, 256, (20_000 * k,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    t = weight_like(20_000, dtype).clone()
    t[::7] = bits.view(dtype)[::7]  # arbitrary bit patterns, including NaNs with payloads
    t[1::11] = float("inf")
    t[2::13] = float("-inf")
    t[3::17] = -0.0
    assert as_bytes(roundtrip(t)) == as_bytes(t)


def test_weights_compress_and_keep_shape_of_params():
    t = weight_like(50_000, torch.float32)
    payload, params = compress(t, chunk_bytes=CHUNK)
    assert params["codec"] == "bgzstd" and params["transform"] == "rotl1" and params["elem_bytes"] == 4
    assert len(payload) < 0.9 * t.numel() * 4  # the exponent plane alone saves > 15% on N(0, 0.02) values


def test_incompressible_data_falls_back_to_raw():
    t = torch.randint(0, 256, (100_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    payload, params = compress(t, chunk_bytes=CHUNK)
    assert params == {"codec": "raw"} and bytes(payload) == as_bytes(t)


def test_tiny_tensor_is_stored_raw():
    t = torch.zeros(MIN_BYTES // 4 - 1)
    assert compress(t)[1] == {"codec": "raw"}


def test_random_planes_are_stored_raw():
    t = weight_like(50_000, torch.float32)
    payload, params = compress(t, chunk_bytes=CHUNK)
    n_seg = -(-t.numel() // params["chunk_elems"]) * 4
    methods = np.frombuffer(bytes(payload)[8 * n_seg : 9 * n_seg], dtype=np.uint8).reshape(-1, 4)
    assert (methods[:, 0] == 0).all()  # lowest mantissa byte: random, raw
    assert (methods[:, 3] == 1).all()  # exponent byte: zstd


def test_parallel_decode_equals_serial_decode():
    t = weight_like(200_000, torch.bfloat16)
    payload, params = compress(t, chunk_bytes=CHUNK, threads=4)
    assert bytes(payload) == bytes(compress(t, chunk_bytes=CHUNK, threads=1)[0])
    serial = decompress(payload, params, t.dtype, t.numel(), threads=1)
    parallel = decompress(payload, params, t.dtype, t.numel(), threads=4)
    assert as_bytes(serial) == as_bytes(parallel) == as_bytes(t)


def test_high_level_is_never_larger():
    t = weight_like(50_000, torch.float32)
    assert len(compress(t, level=19, chunk_bytes=CHUNK)[0]) <= len(compress(t, level=3, chunk_bytes=CHUNK)[0])


def test_chunks_decode_independently():
    # A third-party decoder with zstandard + numpy: chunk 1, plane 3 is a self-contained zstd frame.
    t = weight_like(50_000, torch.float32)
    payload, params = compress(t, chunk_bytes=CHUNK)
    n, k = params["chunk_elems"], 4
    n_seg = -(-t.numel() // n) * k
    lengths = np.frombuffer(bytes(payload)[: 8 * n_seg], dtype="<u8")
    i = 1 * k + 3
    start = 9 * n_seg + int(lengths[:i].sum())
    plane = zstandard.ZstdDecompressor().decompress(bytes(payload)[start : start + int(lengths[i])])
    u = t.view(torch.int32).numpy().view(np.uint32)[n : 2 * n]
    expect = ((u << 1) | (u >> 31)).view(np.uint8).reshape(-1, 4)[:, 3]
    assert plane == expect.tobytes()


@pytest.fixture(scope="module")
def packed():
    t = weight_like(50_000, torch.float32)
    payload, params = compress(t, chunk_bytes=CHUNK)
    assert params["codec"] == "bgzstd"
    return t, bytes(payload), params


@pytest.mark.parametrize("cut", [0, 5, 100, -1])
def test_truncated_payload_raises_format_error(packed, cut):
    t, payload, params = packed
    with pytest.raises(FormatError, match="truncated"):
        decompress(payload[:cut], params, t.dtype, t.numel())


def test_corrupt_zstd_frame_raises_format_error(packed):
    t, payload, params = packed
    bad = bytearray(payload)
    bad[-20] ^= 0xFF  # inside the last segment, the exponent plane of the last chunk (zstd)
    with pytest.raises(FormatError, match="chunk"):
        decompress(bytes(bad), params, t.dtype, t.numel())


def test_corrupt_table_raises_format_error(packed):
    t, payload, params = packed
    bad = bytearray(payload)
    bad[0] ^= 0x01  # first segment length off by one
    with pytest.raises(FormatError):
        decompress(bytes(bad), params, t.dtype, t.numel())
    n_seg = -(-t.numel() // params["chunk_elems"]) * 4
    bad = bytearray(payload)
    bad[8 * n_seg] = 7  # unknown plane method
    with pytest.raises(FormatError, match="method"):
        decompress(bytes(bad), params, t.dtype, t.numel())


@pytest.mark.parametrize(
    "change",
    [{"codec": "lz77"}, {"version": 2}, {"elem_bytes": 2}, {"chunk_elems": 0}, {"transform": "rotr3"}],
)
def test_unknown_params_raise_format_error(packed, change):
    t, payload, params = packed
    with pytest.raises(FormatError):
        decompress(payload, {**params, **change}, t.dtype, t.numel())


def test_raw_payload_of_wrong_size_raises_format_error():
    with pytest.raises(FormatError, match="raw payload"):
        decompress(b"\x00" * 10, {"codec": "raw"}, torch.float32, 3)
