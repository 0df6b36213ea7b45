"""Lossless compression of tensor bytes: byte planes + zstd, in independent chunks.

Float bits are split into byte planes before entropy coding, as in ZipNN (Hershcovitch et al., "ZipNN:
Lossless Compression for AI Models", 2024): the exponent bits of trained weights take a few values
(~2.7 bits of entropy per fp32 weight) while the low mantissa bytes are close to random. Each float is
first rotated left by one bit so that the sign leaves the top byte, which then holds 8 exponent bits
(fp32, bf16) and nothing else; the sign joins the top mantissa bits, which are random anyway.

Payload of codec ``"bgzstd"`` version 1 (all integers little-endian; this is the spec in docs/FORMAT.md)::

    params = {"codec": "bgzstd", "version": 1, "elem_bytes": k, "chunk_elems": N, "transform": T}
    C = ceil(numel / N) chunks; chunk c holds elements [c*N, min((c+1)*N, numel)), n_c of them
    payload = lengths: u64[C*k] || methods: u8[C*k] || segment[0] || segment[1] || ... || segment[C*k-1]
    segment i = c*k + p holds plane p of chunk c: byte p (little-endian byte order) of each of the n_c
        elements, after transform T; method 0 = stored raw (exactly n_c bytes),
        method 1 = one zstd frame (content size n_c in its header, content checksum on)
    T = "rotl1": each element, read as a k-byte unsigned integer, was rotated left by 1 bit
        (x << 1 | x >> (8k-1)); decoding rotates right by 1. T = "none": no transform.

``params = {"codec": "raw"}`` means the payload is the tensor's bytes as they are.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import zstandard

from ..errors import FormatError, UsageError

CODEC = "bgzstd"
VERSION = 1
DEFAULT_CHUNK_BYTES = 4 << 20  # 4 MiB of elements per chunk: ~100 chunks/GB, enough for parallel decode
MIN_BYTES = 1024  # below this, table and frame headers eat the gain
MIN_RATIO = 1.02  # whole tensor: compress only if it saves at least ~2%
PLANE_KEEP = 0.99  # one plane of one chunk: keep zstd only if it saves >= 1% (decoding raw is a memcpy)
RAW, ZSTD = 0, 1
# Readers refuse bigger chunks: a chunk's frames are decoded whole, so this bounds what one frame may
# make a reader allocate beyond the tensor itself (ckptq writes DEFAULT_CHUNK_BYTES).
MAX_CHUNK_BYTES = 64 << 20
_ROTATED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}

# Strategy "fast" with min_match 7 finds almost no matches in byte planes and leaves zstd's Huffman
# literal coder to do the work: on MiniLM fp32 weights the exponent plane reaches 2.87x at ~230 MB/s,
# against 2.45x at 67 MB/s for level 3 and 2.99x at 1.3 MB/s for level 19 (tools/bench/compress.py).
_ENTROPY_PROFILE = dict(window_log=20, strategy=zstandard.STRATEGY_FAST, min_match=7, hash_log=17, search_log=1)


def compress(
    t: torch.Tensor, level: int = 3, threads: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> tuple[bytes | bytearray | memoryview, dict]:
    """Compress the bytes of a contiguous CPU tensor losslessly.

    Returns ``(payload, params)``; ``params`` is a small JSON-serializable dict that ``decompress`` needs
    (layout in this module's docstring). Levels 1-3 use the fast entropy profile; level >= 4 also tries
    zstd's own level on every plane and keeps the smaller. ``threads=0`` uses every CPU core. When
    compression does not save ``MIN_RATIO``, returns the raw bytes with ``{"codec": "raw"}``.
    """
    if not 1 <= level <= 22:
        raise UsageError(f"compression level {level} is out of range; use 1..22")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise UsageError(f"compress needs a contiguous CPU tensor, got device {t.device}; call .contiguous().cpu()")
    raw = _byte_view(t)
    if raw.size < MIN_BYTES:
        return memoryview(raw), {"codec": "raw"}
    k = t.element_size()
    params = {"codec": CODEC, "version": VERSION, "elem_bytes": k,
              "chunk_elems": max(1, chunk_bytes // k), "transform": "rotl1" if t.dtype in _ROTATED else "none"}
    step = params["chunk_elems"] * k
    jobs = [raw[i : i + step] for i in range(0, raw.size, step)]
    chunks = _map(lambda b: _compress_chunk(b, params, level), jobs, threads)
    segments = [seg for chunk in chunks for seg in chunk]
    size = sum(len(s) for _, s in segments) + 9 * len(segments)
    if size * MIN_RATIO > raw.size:
        return memoryview(raw), {"codec": "raw"}
    lengths = np.array([len(s) for _, s in segments], dtype="<u8")
    methods = np.array([m for m, _ in segments], dtype=np.uint8)
    return b"".join([lengths.tobytes(), methods.tobytes(), *(s for _, s in segments)]), params


def decompress(
    payload: bytes | memoryview, params: dict, dtype: torch.dtype, numel: int, threads: int = 0
) -> torch.Tensor:
    """Inverse of ``compress``: a 1-D contiguous CPU tensor of ``numel`` elements of ``dtype``.

    Raises FormatError, naming the fault, on unknown params or a corrupt or truncated payload.
    """
    k = torch.empty((), dtype=dtype).element_size()
    buf = memoryview(payload).cast("B")
    codec = params.get("codec")
    if codec == "raw":
        if len(buf) != numel * k:
            raise FormatError(f"raw payload has {len(buf)} bytes, expected {numel} x {k}; the file is truncated or corrupt")
        out = np.frombuffer(buf, dtype=np.uint8).copy()
    elif codec == CODEC:
        out = _decode_bgzstd(buf, params, k, numel, threads)
    else:
        raise FormatError(f"unknown compression codec {codec!r} (this ckptq reads 'raw' and {CODEC!r}); upgrade ckptq")
    if numel == 0:  # numpy gives empty arrays stride 0, which torch cannot view as a wider dtype
        return torch.empty(0, dtype=dtype)
    return torch.from_numpy(out).view(dtype)


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array [numel * element_size] sharing its memory."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _map(fn, items: list, threads: int) -> list:
    # zstandard and numpy's copies release the GIL, so threads give real parallelism here.
    n = min(len(items), threads if threads > 0 else (os.cpu_count() or 1))
    if n <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, items))


def _rotate(chunk: np.ndarray, k: int, left: bool) -> np.ndarray:
    """Rotate each k-byte element of a flat uint8 array [n * k] by one bit; returns a new array."""
    x = chunk.view(_UINT[k])
    hi, lo = (x << 1, x >> (8 * k - 1)) if left else (x >> 1, x << (8 * k - 1))
    return (hi | lo).view(np.uint8)


def _compressors(level: int) -> list:
    profile = zstandard.ZstdCompressionParameters(**_ENTROPY_PROFILE, write_checksum=1)
    zcs = [zstandard.ZstdCompressor(compression_params=profile)]
    if level >= 4:
        zcs.append(zstandard.ZstdCompressor(level=level, write_checksum=True))
    return zcs


def _compress_chunk(chunk: np.ndarray, params: dict, level: int) -> list[tuple[int, bytes]]:
    """One chunk's bytes [n * k] -> k (method, segment) pairs, plane 0 first."""
    k = params["elem_bytes"]
    if params["transform"] == "rotl1":
        chunk = _rotate(chunk, k, left=True)
    planes = np.ascontiguousarray(chunk.reshape(-1, k).T)  # [k, n]: row p = byte p of every element
    zcs = _compressors(level)
    out = []
    for plane in planes:
        best = min((zc.compress(plane) for zc in zcs), key=len)
        out.append((ZSTD, best) if len(best) <= PLANE_KEEP * plane.size else (RAW, plane.tobytes()))
    return out


def _check_params(params: dict, k: int) -> None:
    if params.get("version") != VERSION:
        raise FormatError(f"{CODEC} payload version {params.get('version')!r}; this ckptq reads {VERSION}: upgrade ckptq")
    if params.get("elem_bytes") != k:
        raise FormatError(f"{CODEC} params say {params.get('elem_bytes')!r}-byte elements but the dtype has {k}")
    n = params.get("chunk_elems")
    if type(n) is not int or not 1 <= n <= MAX_CHUNK_BYTES // k:
        raise FormatError(f"{CODEC} params have chunk_elems={str(n)[:20]}; it must be an integer from 1 to "
                          f"{MAX_CHUNK_BYTES // k} for {k}-byte elements: the file is corrupt")
    if params.get("transform") not in ("rotl1", "none") or (params["transform"] == "rotl1" and k not in _UINT):
        raise FormatError(f"{CODEC} params have transform {params.get('transform')!r} for {k}-byte elements")


def _segment_table(buf: memoryview, n_seg: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse the table; returns (start offsets, lengths, methods), each [n_seg], checked against the payload."""
    head = 9 * n_seg
    if len(buf) < head:
        raise FormatError(f"{CODEC} payload has {len(buf)} bytes, less than its {head}-byte chunk table: truncated")
    lengths = np.frombuffer(buf[: 8 * n_seg], dtype="<u8").astype(np.int64)
    methods = np.frombuffer(buf[8 * n_seg : head], dtype=np.uint8)
    if (lengths < 0).any() or head + int(lengths.sum()) != len(buf):
        raise FormatError(f"{CODEC} payload has {len(buf)} bytes but its chunk table adds up to "
                          f"{head + int(lengths.sum())}: truncated or corrupt")
    if not np.isin(methods, (RAW, ZSTD)).all():
        raise FormatError(f"{CODEC} chunk table has unknown plane methods {sorted(set(methods.tolist()) - {RAW, ZSTD})}")
    starts = head + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return starts, lengths, methods


def _decode_bgzstd(buf: memoryview, params: dict, k: int, numel: int, threads: int) -> np.ndarray:
    _check_params(params, k)
    n = params["chunk_elems"]
    n_chunks = -(-numel // n)
    starts, lengths, methods = _segment_table(buf, n_chunks * k)
    _check_declared_sizes(buf, starts, lengths, methods, n, numel, k)  # before allocating the output
    out = np.empty(numel * k, dtype=np.uint8)

    def one_chunk(c: int) -> None:
        n_c = min(n, numel - c * n)
        dst = out[c * n * k : (c * n + n_c) * k]
        dctx = zstandard.ZstdDecompressor()
        for p in range(k):  # column by column: ~3x faster in numpy than one transposed copy
            i = c * k + p
            seg = buf[starts[i] : starts[i] + lengths[i]]
            dst.reshape(n_c, k)[:, p] = np.frombuffer(_decode_plane(dctx, seg, methods[i], n_c, c, p), np.uint8)
        if params["transform"] == "rotl1":
            dst[:] = _rotate(dst, k, left=False)

    _map(one_chunk, list(range(n_chunks)), threads)
    return out


def _check_declared_sizes(buf, starts, lengths, methods, n: int, numel: int, k: int) -> None:
    """Every segment must declare exactly its plane's size (raw: its length; zstd: its frame header)."""
    for i in range(len(lengths)):
        c, p = divmod(i, k)
        n_c = min(n, numel - c * n)
        seg = buf[starts[i] : starts[i] + lengths[i]]
        if methods[i] == RAW:
            declared = len(seg)
        else:
            try:
                declared = zstandard.frame_content_size(seg)
            except zstandard.ZstdError as e:
                raise FormatError(f"{CODEC} chunk {c} plane {p}: zstd frame header is corrupt ({e})") from None
        if declared != n_c:
            raise FormatError(f"{CODEC} chunk {c} plane {p} declares {declared} bytes, expected {n_c}: corrupt")


def _decode_plane(dctx, seg: memoryview, method: int, n_c: int, c: int, p: int) -> bytes | memoryview:
    where = f"{CODEC} chunk {c} plane {p}"
    if method == RAW:
        if len(seg) != n_c:
            raise FormatError(f"{where} is stored raw with {len(seg)} bytes, expected {n_c}: corrupt")
        return seg
    try:
        if zstandard.frame_content_size(seg) != n_c:
            raise FormatError(f"{where}: zstd frame does not declare the expected {n_c} bytes: corrupt")
        return dctx.decompress(seg, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise FormatError(f"{where}: zstd frame is corrupt ({e})") from e
