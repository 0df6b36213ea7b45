"""A streaming safetensors writer and a validating, memory-mapped reader.

safetensors' own ``save_file`` needs every tensor in memory at once. Here the header is planned from
dtypes and shapes before any data exists, the data is streamed tensor by tensor (the next tensor is
produced on a worker thread while the current one is written), and the final header is written over
a reserved, space-padded region at the end (JSON allows trailing spaces; safetensors pads the same way).

Files are written to a temporary name in the target folder and renamed into place only when complete:
an error or Ctrl-C leaves nothing under the final name.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from . import integrity, journal
from .dtypes import SAFETENSORS_NAMES

_BIG = 10**15  # placeholder width for offsets/sizes while reserving header space
# How far the producer may run ahead of the writer: tensors, and bytes it holds in memory.
AHEAD_TENSORS = 256
AHEAD_BYTES = 128 << 20


@dataclass
class Stored:
    """One tensor of the output file. ``produce()`` returns it (contiguous, CPU, ``dtype``, ``shape``);
    it is called once, when the writer reaches it, so large inputs are touched one at a time."""

    name: str
    dtype: torch.dtype
    shape: tuple
    produce: Callable[[], torch.Tensor]
    role: str = "exact"  # "exact" | "codes" | "absmax" | "codebook"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Encoded:
    """What the writer puts on disk for one Stored tensor."""

    payload: torch.Tensor | bytes | memoryview  # contiguous CPU tensor (raw) or compressed bytes
    codec: dict  # {"codec": "raw"} or the compressor's params


def _as_bytes(x) -> memoryview:
    if isinstance(x, torch.Tensor):
        return memoryview(x.reshape(-1).view(torch.uint8).numpy()) if x.numel() else memoryview(b"")
    return memoryview(x)


def _entry(stored: Stored, enc: Encoded | None, start: int, size: int | None) -> dict:
    if enc is None or enc.codec.get("codec") == "raw":
        return {"dtype": SAFETENSORS_NAMES[stored.dtype], "shape": list(stored.shape), "data_offsets": [start, start + stored.nbytes]}
    return {"dtype": "U8", "shape": [size], "data_offsets": [start, start + size]}


def _table_entry(s: Stored, crc: str, codec: dict) -> dict:
    return {"dtype": SAFETENSORS_NAMES[s.dtype], "shape": list(s.shape), "crc32": crc, "codec": codec}


def _header_bytes(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()


def reserved_header_bytes(stored: list[Stored], metadata: dict[str, str], compressing: bool = False) -> int:
    """The header space ``write_file`` reserves: an uncompressed file is 8 + this + the tensors' bytes."""
    metadata = {**metadata, integrity.KEY: integrity.PLACEHOLDER}
    slack = 512 * len(stored) if compressing else 0
    table = {s.name: _table_entry(s, "0" * 8, {"codec": "raw"}) for s in stored}
    plan = {s.name: _entry(s, None if not compressing else Encoded(b"", {"codec": "?"}), _BIG, _BIG) for s in stored}
    reserve = len(_header_bytes({"__metadata__": {**metadata, "ckptq.tensors": json.dumps(table)}, **plan})) + slack
    return (reserve + 4096 + 7) // 8 * 8


def write_file(
    path: str,
    stored: list[Stored],
    metadata: dict[str, str],
    encode: Callable[[Stored, torch.Tensor], Encoded] | None = None,
    on_tensor: Callable[[Stored], None] | None = None,
) -> str:
    """Write ``stored`` to ``path`` (the caller makes it atomic). ``metadata`` values are str; the
    writer adds ``ckptq.tensors`` (per tensor the logical dtype and shape, the codec, and the crc32 of
    the bytes on disk) and ``ckptq.header_crc32`` (the header's own checksum, which it returns)."""
    metadata = {**metadata, integrity.KEY: integrity.PLACEHOLDER}
    table = {s.name: _table_entry(s, "0" * 8, {"codec": "raw"}) for s in stored}
    reserve = reserved_header_bytes(stored, metadata, compressing=encode is not None)
    with open(path, "wb") as f:
        f.seek(8 + reserve)
        header = _stream(f, stored, table, encode, on_tensor)
        head = _header_bytes({"__metadata__": {**metadata, "ckptq.tensors": json.dumps(table, separators=(",", ":"))}, **header})
        if len(head) > reserve:  # compressor params larger than planned: rare, costs one copy
            crc = _relocate(f, path, head, 8 + reserve)
        else:
            sealed, crc = _sealed(head, reserve)
            f.seek(0)
            f.write(sealed)
        f.flush()
        os.fsync(f.fileno())
    return crc


def _stream(f, stored, table, encode, on_tensor) -> dict:
    """Write each tensor's bytes in order while a worker thread produces (quantizes, compresses) the
    ones ahead. Exact tensors of a memory-mapped input cost no memory to hold, so the worker runs ahead
    through them and quantizes while the weights are being written; what it holds in memory (codes,
    compressed payloads) is capped at AHEAD_BYTES. The writer, which mostly waits, computes checksums."""
    header, pos = {}, 0

    def job(s: Stored) -> tuple[Encoded, memoryview]:
        t = s.produce()
        enc = encode(s, t) if encode else Encoded(t, {"codec": "raw"})
        return enc, _as_bytes(enc.payload)

    def cost(s: Stored) -> int:  # memory a produced tensor holds until written
        return s.nbytes if (encode or s.role != "exact") else 0

    pool = ThreadPoolExecutor(max_workers=1)
    pending: deque = deque()
    held, nxt = 0, 0
    try:
        for s in stored:
            while nxt < len(stored) and len(pending) < AHEAD_TENSORS and (
                    not pending or held + cost(stored[nxt]) <= AHEAD_BYTES):
                pending.append(pool.submit(job, stored[nxt]))
                held += cost(stored[nxt])
                nxt += 1
            enc, data = pending.popleft().result()
            held -= cost(s)
            if enc.codec.get("codec") == "raw" and len(data) != s.nbytes:
                raise AssertionError(f"{s.name}: produced {len(data)} bytes, planned {s.nbytes}")
            _write_tensor(f, data)
            table[s.name] = _table_entry(s, f"{zlib.crc32(data):08x}", enc.codec)
            header[s.name] = _entry(s, enc, pos, len(data))
            pos += len(data)
            if on_tensor:
                on_tensor(s)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # on error: drop what was not started yet
    return header


def _write_tensor(f, data: memoryview) -> None:
    f.write(data)


def _sealed(head: bytes, reserve: int) -> tuple[bytes, str]:
    """Length prefix + header + space padding, with the header checksum filled in; and that checksum."""
    raw = bytearray(struct.pack("<Q", reserve) + head + b" " * (reserve - len(head)))
    crc = integrity.seal(raw)
    return bytes(raw), crc


def _relocate(f, tmp, head, data_start) -> str:
    reserve = (len(head) + 7) // 8 * 8
    f.flush()
    sealed, crc = _sealed(head, reserve)
    fd = os.open(tmp + ".r", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # never a file already there
    journal.record_temp(tmp + ".r")
    with open(tmp, "rb") as src, os.fdopen(fd, "wb") as dst:
        dst.write(sealed)
        src.seek(data_start)
        while chunk := src.read(1 << 24):
            dst.write(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp + ".r", tmp)
    return crc
