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
import mmap
import os
import struct
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import ChecksumError, FormatError, InputError
from .tree import DTYPES, Stored

NAMES_TO_DTYPES = {v: k for k, v in DTYPES.items()}
_BIG = 10**15  # placeholder width for offsets/sizes while reserving header space
_MAX_HEADER = 100_000_000  # safetensors' own limit
# How far the producer may run ahead of the writer: tensors, and bytes it holds in memory.
AHEAD_TENSORS = 256
AHEAD_BYTES = 128 << 20


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
        return {"dtype": DTYPES[stored.dtype], "shape": list(stored.shape), "data_offsets": [start, start + stored.nbytes]}
    return {"dtype": "U8", "shape": [size], "data_offsets": [start, start + size]}


def _table_entry(s: Stored, crc: str, codec: dict) -> dict:
    return {"dtype": DTYPES[s.dtype], "shape": list(s.shape), "crc32": crc, "codec": codec}


def _header_bytes(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()


def reserved_header_bytes(stored: list[Stored], metadata: dict[str, str], compressing: bool = False) -> int:
    """The header space ``write_file`` reserves: an uncompressed file is 8 + this + the tensors' bytes."""
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
) -> dict:
    """Write ``stored`` to ``path`` (the caller makes it atomic). ``metadata`` values are str; the
    writer adds ``ckptq.tensors``: per tensor the logical dtype and shape, the codec, and the crc32 of
    the bytes on disk. Returns that table."""
    table = {s.name: _table_entry(s, "0" * 8, {"codec": "raw"}) for s in stored}
    reserve = reserved_header_bytes(stored, metadata, compressing=encode is not None)
    with open(path, "wb") as f:
        f.seek(8 + reserve)
        header = _stream(f, stored, table, encode, on_tensor)
        head = _header_bytes({"__metadata__": {**metadata, "ckptq.tensors": json.dumps(table, separators=(",", ":"))}, **header})
        if len(head) > reserve:  # compressor params larger than planned: rare, costs one copy
            head = _relocate(f, path, head, 8 + reserve)
        else:
            f.seek(0)
            f.write(struct.pack("<Q", reserve) + head + b" " * (reserve - len(head)))
        f.flush()
        os.fsync(f.fileno())
    return table


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


def _relocate(f, tmp, head, data_start) -> bytes:
    reserve = (len(head) + 7) // 8 * 8
    f.flush()
    with open(tmp, "rb") as src, open(tmp + ".r", "wb") as dst:
        dst.write(struct.pack("<Q", reserve) + head + b" " * (reserve - len(head)))
        src.seek(data_start)
        while chunk := src.read(1 << 24):
            dst.write(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp + ".r", tmp)
    return head


class Reader:
    """A safetensors file, validated on open, tensors memory-mapped copy-on-write (writable views that
    never touch the file)."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._file = open(path, "rb")
        except OSError as e:
            raise InputError(f"cannot open {path}: {e.strerror}") from None
        size = os.fstat(self._file.fileno()).st_size
        if size < 8:
            raise FormatError(f"{path} is not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", self._file.read(8))
        if n > min(_MAX_HEADER, size - 8):
            raise FormatError(f"{path} is truncated or not a safetensors file (header length {n}, file {size} bytes)")
        try:
            header = json.loads(self._file.read(n))
            if not isinstance(header, dict):
                raise TypeError("the header is not a JSON object")
            self.metadata = header.pop("__metadata__", None) or {}
            self.table = json.loads(self.metadata.get("ckptq.tensors", "{}"))
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, TypeError) as e:
            raise FormatError(f"{path}: the safetensors header is corrupt ({e})") from None
        self.entries = header
        self._data_start = 8 + n
        self._validate(size)
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY) if size else None

    def _validate(self, size: int) -> None:
        for name, e in self.entries.items():
            offsets = e.get("data_offsets") if isinstance(e, dict) else None
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                    and isinstance(e.get("dtype"), str) and isinstance(e.get("shape"), list)):
                raise FormatError(f"{self.path}: header entry {name!r} is malformed; the file is corrupt")
        spans = sorted((e["data_offsets"][0], e["data_offsets"][1], k) for k, e in self.entries.items())
        pos = 0
        for a, b, name in spans:
            if a != pos or b < a:
                raise FormatError(f"{self.path}: tensor {name!r} has bad data offsets [{a}, {b}]; the file is corrupt")
            pos = b
        if self._data_start + pos != size:
            raise FormatError(f"{self.path} is truncated or has trailing bytes: the header describes "
                              f"{self._data_start + pos} bytes, the file has {size}; re-create it")

    def raw(self, name: str, verify: bool = True) -> memoryview:
        e = self.entries.get(name)
        if e is None:
            raise FormatError(f"{self.path}: tensor {name!r} is missing; the file is incomplete or corrupt")
        a, b = e["data_offsets"]
        view = memoryview(self._map)[self._data_start + a : self._data_start + b] if self._map else memoryview(b"")
        want = self.table.get(name, {}).get("crc32")
        if verify and want is not None and f"{zlib.crc32(view):08x}" != want:
            raise ChecksumError(f"{self.path}: tensor {name!r} fails its checksum (crc32 {zlib.crc32(view):08x}, "
                                f"recorded {want}): the file is corrupt; re-create it from the source checkpoint")
        return view

    def tensor(self, name: str, verify: bool = True) -> torch.Tensor:
        """The stored tensor as written (still compressed if it was; see ``codec``)."""
        view = self.raw(name, verify)
        e = self.entries[name]
        dtype = NAMES_TO_DTYPES.get(e["dtype"])
        if dtype is None:
            raise FormatError(f"{self.path}: tensor {name!r} has dtype {e['dtype']} which this ckptq cannot read")
        if len(view) == 0:
            return torch.empty(e["shape"], dtype=dtype)
        return torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(e["shape"])

    def codec(self, name: str) -> dict:
        return self.table.get(name, {}).get("codec", {"codec": "raw"})

    def close(self) -> None:
        self._file.close()
