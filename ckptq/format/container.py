"""The ckptq file format, version 3 (spec: docs/FORMAT.md): a skeleton + stored tensors in one
safetensors file, or in Hugging Face-style shards with an index. Versions 1 and 2 are read too (3 adds
the row layout of quantized states; the bytes around them are version 2's).

Metadata keys (all str, in ``__metadata__``): ``format`` = ``"pt"``; ``ckptq.format`` = ``"ckptq"``;
``ckptq.version`` = ``"3"``; ``ckptq.skeleton`` (JSON); ``ckptq.info`` (JSON: options, sizes);
``ckptq.tensors`` (JSON: per tensor dtype, shape, codec, crc32); ``ckptq.header_crc32`` (from version 2: the
header's own checksum, see ``ckptq.format.integrity``). A sharded set keeps skeleton and info in the index's
``metadata``, with ``ckptq.shards`` (each shard's header checksum); each shard carries its own
``ckptq.tensors`` and header checksum.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import index, integrity, reader, safetensors_io
from ..errors import FormatError
from .dtypes import FROM_SAFETENSORS
from .atomic import atomic_outputs
from .files import open_regular
from .safetensors_io import Stored
from .index import INDEX_SUFFIX, SUFFIX
from .header import FORMAT_NAME, parse_json

FORMAT_VERSION = 3
READS_VERSIONS = (1, 2, 3)


@dataclass
class Compression:
    level: int = 3
    threads: int = 0


def _encoder(compression: Compression | None):
    if compression is None:
        return None
    from . import compress

    def encode(s: Stored, t: torch.Tensor) -> safetensors_io.Encoded:
        payload, params = compress.compress(t, compression.level, compression.threads)
        return safetensors_io.Encoded(payload if params.get("codec") != "raw" else t, params)

    return encode


def shard_plan(stored: list[Stored], max_shard_size: int | None) -> list[list[Stored]]:
    """Greedy in write order, like transformers: a new shard when the next tensor would overflow."""
    shards: list[list[Stored]] = [[]]
    size = 0
    for s in stored:
        if max_shard_size and shards[-1] and size + s.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def shard_paths(path: str, n: int) -> list[str]:
    stem = path[: -len(SUFFIX)] if path.endswith(SUFFIX) else path
    return [f"{stem}-{i:05d}-of-{n:05d}{SUFFIX}" for i in range(1, n + 1)]


def _metadata(skeleton: Any, info: dict) -> tuple[dict, dict]:
    base = {"format": "pt", "ckptq.format": FORMAT_NAME, "ckptq.version": str(FORMAT_VERSION)}
    return base, {"ckptq.skeleton": json.dumps(skeleton, separators=(",", ":")), "ckptq.info": json.dumps(info)}


def planned_bytes(skeleton: Any, stored: list[Stored], info: dict) -> int:
    """The size ``write`` gives these tensors as one uncompressed file (what ``ckptq info`` predicts)."""
    base, top = _metadata(skeleton, info)
    return 8 + safetensors_io.reserved_header_bytes(stored, {**base, **top}) + sum(s.nbytes for s in stored)


def write(
    path: str,
    skeleton: Any,
    stored: list[Stored],
    info: dict,
    *,
    force: bool = False,
    compression: Compression | None = None,
    max_shard_size: int | None = None,
    on_tensor: Callable[[Stored], None] | None = None,
) -> list[str]:
    """Write a converted checkpoint; returns the paths written (the file, or index + shards)."""
    base, top = _metadata(skeleton, info)
    shards = shard_plan(stored, max_shard_size)
    encode = _encoder(compression)
    if len(shards) == 1:
        with atomic_outputs([path], force, "ckptq") as (tmp,):
            safetensors_io.write_file(tmp, stored, {**base, **top}, encode, on_tensor)
        return [path]
    names = shard_paths(path, len(shards))
    index_path = path + ".index.json" if path.endswith(SUFFIX) else path + INDEX_SUFFIX
    with atomic_outputs([*names, index_path], force, "ckptq") as tmps:
        weight_map, crcs = {}, {}
        for i, (group, tmp) in enumerate(zip(shards, tmps)):
            meta = {**base, "ckptq.shard": f"{i + 1}/{len(shards)}"}
            crcs[os.path.basename(names[i])] = safetensors_io.write_file(tmp, group, meta, encode, on_tensor)
            weight_map.update({s.name: os.path.basename(names[i]) for s in group})
        meta = {"total_size": sum(s.nbytes for s in stored), **base, **top}
        with open(tmps[-1], "wb") as f:
            f.write(index.index_bytes(meta, weight_map, crcs))
            f.flush()
            os.fsync(f.fileno())
    return [index_path, *names]


def is_safetensors(path: str) -> bool:
    """A file that starts like safetensors (8-byte length, then a JSON object). Raises InputError for
    what is not a regular file (a FIFO would block)."""
    with open_regular(path) as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{"


def _version(meta: dict, path: str) -> int:
    if meta.get("ckptq.format") != FORMAT_NAME:
        raise FormatError(f"{path} is a safetensors file but not one written by ckptq "
                          "(no ckptq.format in its metadata); convert a torch checkpoint first")
    version = meta.get("ckptq.version")
    if not (isinstance(version, str) and re.fullmatch("[1-9][0-9]{0,5}", version)) or int(version) not in READS_VERSIONS:
        raise FormatError(f"{path} uses ckptq format version {str(version)[:20]!r}; this ckptq reads "
                          f"{READS_VERSIONS}: upgrade ckptq, or the file is corrupt")
    return int(version)


class Container:
    """An open ckptq file or shard set at the byte level: headers, checksums and the set validated on
    open; the skeleton parsed as JSON (``ckptq.codec.tree.Converted`` checks and decodes it)."""

    def __init__(self, path: str, verify: bool = True):
        self.path, self.verify = path, verify
        self.readers: list[reader.Reader] = []
        try:
            self._open(index.resolve(path))
        except BaseException:
            self.close()
            raise

    def _open(self, path: str) -> None:
        if path.endswith(".json"):
            meta, wmap, files = index.read_index(path)
            self.readers = [reader.Reader(f) for f in files]
            self.files = [path, *files]
        else:
            self.readers = [reader.Reader(path)]
            meta, self.files = self.readers[0].metadata, [path]
        self.version = _version(meta, path)
        for r in self.readers:  # every shard is tagged and, from version 2, sealed too
            if _version(r.metadata, r.path) != self.version:
                raise FormatError(f"{r.path} has format version {r.metadata['ckptq.version']}, its index "
                                  f"{self.version}: the set mixes two writes; re-create it")
        sealed = str(self.version) in integrity.SEALED_VERSIONS
        if sealed and not all(integrity.KEY in m for m in [meta] + [r.metadata for r in self.readers]):
            raise FormatError(f"{path}: a version {self.version} header has no {integrity.KEY}; the file is corrupt")
        if len(self.files) > 1:
            index.check_set(path, meta, wmap, self.readers, sealed)
        if not isinstance(meta.get("ckptq.skeleton"), str):
            hint = (f"it is shard {meta['ckptq.shard']} of a set: open the set's {INDEX_SUFFIX} or its folder"
                    if "ckptq.shard" in meta else "the file is corrupt")
            raise FormatError(f"{path}: ckptq metadata has no ckptq.skeleton; {hint}")
        self.skeleton = parse_json(meta["ckptq.skeleton"], f"{path}: the skeleton")
        info = parse_json(meta.get("ckptq.info", "{}"), f"{path}: ckptq.info")
        self.info = info if isinstance(info, dict) else {}
        self._where = {name: r for r in self.readers for name in r.entries}

    @property
    def tensors(self) -> dict[str, dict]:
        return {name: r.table.get(name, {}) for r in self.readers for name in r.entries}

    def fetch(self, name: str) -> torch.Tensor:
        """A stored tensor, decompressed and checksum-verified, in its logical dtype and shape."""
        r = self._where.get(name)
        if r is None:
            raise FormatError(f"{self.path}: tensor {name!r} is missing; the file set is incomplete")
        params = r.codec(name)
        if params.get("codec", "raw") == "raw":
            return r.tensor(name, self.verify)
        from . import compress

        entry = r.table[name]
        dtype, shape = FROM_SAFETENSORS[entry["dtype"]], tuple(entry["shape"])
        flat = compress.decompress(r.raw(name, self.verify), params, dtype, int(torch.Size(shape).numel()))
        return flat.reshape(shape)

    def numel_as(self, name: str, dtype: torch.dtype) -> int | None:
        """Elements of stored tensor ``name`` if it is stored as ``dtype`` (else None: not viewable lazily)."""
        r = self._where.get(name)
        entry = r.table.get(name, {}) if r else {}
        if FROM_SAFETENSORS.get(entry.get("dtype")) != dtype:
            return None
        return int(torch.Size(entry["shape"]).numel())

    def stored_bytes(self, name: str) -> int:
        """Bytes stored tensor ``name`` takes in its file (compressed, if it was)."""
        a, b = self._where[name].entries[name]["data_offsets"]
        return b - a

    def close(self) -> None:
        for r in getattr(self, "readers", []):
            r.close()
