"""A validating, memory-mapped safetensors reader.

On open, before any tensor is touched: the file must be a regular file; the header must be a JSON
object without duplicate keys; ``__metadata__`` must map str to str; if it records a header checksum
(format version 2) the header bytes must match it; every entry must be well-formed, the entries must
tile the data section exactly, and every entry must agree with its row in the ckptq tensor table
(dtype, shape, byte length; a raw entry's length is exactly its elements times the dtype's size), which
must have a crc32 for every entry and nothing else.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
import zlib

import torch

from . import integrity
from ..errors import ChecksumError, FormatError
from .files import open_regular
from .dtypes import FROM_SAFETENSORS as NAMES_TO_DTYPES
from .header import MAX_HEADER, MAX_JSON_DEPTH, json_depth, parse_json  # noqa: F401 (the reader's face)

MAX_NUMEL = 2**48  # no real tensor is larger; keeps every size computation far from overflow


def _known(dtype) -> bool:
    return isinstance(dtype, str) and dtype in NAMES_TO_DTYPES


def check_shape(shape, what: str) -> tuple:
    if not (isinstance(shape, list) and all(type(d) is int and 0 <= d for d in shape)) or len(shape) > 64 \
            or math.prod(shape) > MAX_NUMEL:
        raise FormatError(f"{what} has an invalid shape {str(shape)[:60]}; the file is corrupt")
    return tuple(shape)


class Reader:
    """A safetensors file, validated on open, tensors memory-mapped copy-on-write (writable views that
    never touch the file)."""

    def __init__(self, path: str):
        self.path = path
        self._file = open_regular(path)
        self._map = None
        try:
            self._open()
        except BaseException:
            self._file.close()
            raise

    def _open(self) -> None:
        size = os.fstat(self._file.fileno()).st_size
        if size < 8:
            raise FormatError(f"{self.path} is not a safetensors file (only {size} bytes)")
        prefix = self._file.read(8)
        (n,) = struct.unpack("<Q", prefix)
        if n > min(MAX_HEADER, size - 8):
            raise FormatError(f"{self.path} is truncated or not a safetensors file (header length {n}, file {size} bytes)")
        raw = prefix + self._file.read(n)
        integrity.precheck(raw, self.path)
        header = parse_json(raw[8:], f"{self.path}: the safetensors header")
        if not isinstance(header, dict):
            raise FormatError(f"{self.path}: the safetensors header is corrupt (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        if not (isinstance(self.metadata, dict) and all(isinstance(v, str) for v in self.metadata.values())):
            raise FormatError(f"{self.path}: the safetensors header is corrupt (__metadata__ is not a str->str map)")
        if self.metadata.get("ckptq.version") in integrity.SEALED_VERSIONS and integrity.KEY in self.metadata:
            integrity.verify(raw, self.metadata[integrity.KEY], self.path)
        self.table = parse_json(self.metadata.get("ckptq.tensors", "{}"), f"{self.path}: the tensor table")
        self.entries = header
        self._data_start = 8 + n
        self._validate(size)
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)

    def _validate(self, size: int) -> None:
        if not isinstance(self.table, dict):
            raise FormatError(f"{self.path}: the tensor table is corrupt (not a JSON object)")
        for name, e in self.entries.items():
            self._check_entry(name, e)
        spans = sorted((e["data_offsets"][0], e["data_offsets"][1], k) for k, e in self.entries.items())
        pos = 0
        for a, b, name in spans:
            if a != pos or b < a:
                raise FormatError(f"{self.path}: tensor {name!r} has bad data offsets [{a}, {b}]; the file is corrupt")
            pos = b
        if self._data_start + pos != size:
            raise FormatError(f"{self.path} is truncated or has trailing bytes: the header describes "
                              f"{self._data_start + pos} bytes, the file has {size}; re-create it")
        extra = sorted(set(self.table) - set(self.entries))
        if extra and self.metadata.get("ckptq.format") == "ckptq":
            raise FormatError(f"{self.path}: the tensor table lists {extra[0][:80]!r}, which the file does not hold; "
                              "the file is corrupt")

    def _check_entry(self, name: str, e) -> None:
        where = f"{self.path}: tensor {name[:80]!r}"
        offsets = e.get("data_offsets") if isinstance(e, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and _known(e.get("dtype")) and isinstance(e.get("shape"), list)):
            raise FormatError(f"{self.path}: header entry {name[:80]!r} is malformed; the file is corrupt")
        shape = check_shape(e["shape"], where)
        row = self.table.get(name)
        if self.metadata.get("ckptq.format") != "ckptq":
            return  # a foreign safetensors file: refused later, with a message saying so
        if not (isinstance(row, dict) and isinstance(row.get("crc32"), str) and re.fullmatch("[0-9a-f]{8}", row["crc32"])
                and isinstance(row.get("codec"), dict) and _known(row.get("dtype"))):
            raise FormatError(f"{where} has no valid row (dtype, shape, codec, crc32) in the tensor table; "
                              "the file is corrupt")
        check_shape(row.get("shape"), where + " (table)")
        nbytes = offsets[1] - offsets[0]
        if row["codec"].get("codec", "raw") == "raw":
            same = e["dtype"] == row["dtype"] and list(shape) == row["shape"]
            ok = same and nbytes == math.prod(shape) * NAMES_TO_DTYPES[e["dtype"]].itemsize
        else:
            ok = e["dtype"] == "U8" and list(shape) == [nbytes]
        if not ok:
            raise FormatError(f"{where}: its header entry ({e['dtype']} {list(shape)[:8]}, {nbytes} bytes) does not "
                              f"match its table row ({row['dtype']} {row['shape'][:8]}, codec "
                              f"{str(row['codec'].get('codec'))[:20]}); the file is corrupt")

    def raw(self, name: str, verify: bool = True) -> memoryview:
        e = self.entries.get(name)
        if e is None:
            raise FormatError(f"{self.path}: tensor {name!r} is missing; the file is incomplete or corrupt")
        a, b = e["data_offsets"]
        view = memoryview(self._map)[self._data_start + a : self._data_start + b]
        want = self.table.get(name, {}).get("crc32")
        if verify and f"{zlib.crc32(view):08x}" != want:
            raise ChecksumError(f"{self.path}: tensor {name!r} fails its checksum (crc32 {zlib.crc32(view):08x}, "
                                f"recorded {want}): the file is corrupt; re-create it from the source checkpoint")
        return view

    def tensor(self, name: str, verify: bool = True) -> torch.Tensor:
        """The stored tensor as written (still compressed if it was; see ``codec``)."""
        view = self.raw(name, verify)
        e = self.entries[name]
        dtype = NAMES_TO_DTYPES[e["dtype"]]
        if len(view) == 0:  # the entry's shape has no elements (checked on open)
            return torch.empty(e["shape"], dtype=dtype)
        return torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(e["shape"])

    def codec(self, name: str) -> dict:
        return self.table.get(name, {}).get("codec", {"codec": "raw"})

    def close(self) -> None:
        self._file.close()
