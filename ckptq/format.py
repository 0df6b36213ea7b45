"""The ckptq file format, version 1 (spec: docs/FORMAT.md): a skeleton + stored tensors in one
safetensors file, or in Hugging Face-style shards with an index.

Metadata keys (all str, in ``__metadata__``): ``format`` = ``"pt"``; ``ckptq.format`` = ``"ckptq"``;
``ckptq.version`` = ``"1"``; ``ckptq.skeleton`` (JSON); ``ckptq.info`` (JSON: options, sizes);
``ckptq.tensors`` (JSON: per tensor dtype, shape, codec, crc32). A sharded set keeps skeleton and info
in the index's ``metadata``; each shard carries its own ``ckptq.tensors``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from . import safetensors_io, tree
from .errors import FormatError, InputError, OutputExistsError

FORMAT_NAME = "ckptq"
FORMAT_VERSION = 1
READS_VERSIONS = (1,)
SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"


@dataclass
class Compression:
    level: int = 3
    threads: int = 0


@contextmanager
def atomic_outputs(finals: list[str], force: bool) -> Iterator[list[str]]:
    """Temp paths beside each final path; all renamed into place on success, all removed on failure
    (including Ctrl-C)."""
    for p in finals:
        if os.path.exists(p) and not force:
            raise OutputExistsError(f"{p} exists; pass --force (Python: force=True) to overwrite it")
    tmps = []
    try:
        for p in finals:
            folder = os.path.dirname(os.path.abspath(p))
            if not os.path.isdir(folder):
                raise InputError(f"output folder {folder} does not exist")
            fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(p) + ".", suffix=".tmp")
            os.close(fd)
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
            tmps.append(tmp)
        yield tmps
        for tmp, p in zip(tmps, finals):
            os.replace(tmp, p)
    except BaseException:
        for tmp in tmps:
            for leftover in (tmp, tmp + ".r"):
                if os.path.exists(leftover):
                    os.unlink(leftover)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _encoder(compression: Compression | None):
    if compression is None:
        return None
    from . import compress

    def encode(s: tree.Stored, t: torch.Tensor) -> safetensors_io.Encoded:
        payload, params = compress.compress(t, compression.level, compression.threads)
        return safetensors_io.Encoded(payload if params.get("codec") != "raw" else t, params)

    return encode


def shard_plan(stored: list[tree.Stored], max_shard_size: int | None) -> list[list[tree.Stored]]:
    """Greedy in write order, like transformers: a new shard when the next tensor would overflow."""
    shards: list[list[tree.Stored]] = [[]]
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


def planned_bytes(skeleton: Any, stored: list[tree.Stored], info: dict) -> int:
    """The size ``write`` gives these tensors as one uncompressed file (what ``ckptq info`` predicts)."""
    base, top = _metadata(skeleton, info)
    return 8 + safetensors_io.reserved_header_bytes(stored, {**base, **top}) + sum(s.nbytes for s in stored)


def write(
    path: str,
    skeleton: Any,
    stored: list[tree.Stored],
    info: dict,
    *,
    force: bool = False,
    compression: Compression | None = None,
    max_shard_size: int | None = None,
    on_tensor: Callable[[tree.Stored], None] | None = None,
) -> list[str]:
    """Write a converted checkpoint; returns the paths written (the file, or index + shards)."""
    base, top = _metadata(skeleton, info)
    shards = shard_plan(stored, max_shard_size)
    encode = _encoder(compression)
    if len(shards) == 1:
        with atomic_outputs([path], force) as (tmp,):
            safetensors_io.write_file(tmp, stored, {**base, **top}, encode, on_tensor)
        return [path]
    names = shard_paths(path, len(shards))
    index_path = path + ".index.json" if path.endswith(SUFFIX) else path + INDEX_SUFFIX
    with atomic_outputs([*names, index_path], force) as tmps:
        weight_map = {}
        for i, (group, tmp) in enumerate(zip(shards, tmps)):
            meta = {**base, "ckptq.shard": f"{i + 1}/{len(shards)}"}
            safetensors_io.write_file(tmp, group, meta, encode, on_tensor)
            weight_map.update({s.name: os.path.basename(names[i]) for s in group})
        index = {"metadata": {"total_size": sum(s.nbytes for s in stored), **base, **top}, "weight_map": weight_map}
        with open(tmps[-1], "w") as f:
            json.dump(index, f, indent=1)
    return [index_path, *names]


def is_safetensors(path: str) -> bool:
    """A file that starts like safetensors (8-byte length, then a JSON object)."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{"


def _resolve(path: str) -> tuple[str | None, list[str]]:
    """(index path or None, safetensors files) for a file, an index, or a folder holding one index."""
    if os.path.isdir(path):
        idx = [f for f in os.listdir(path) if f.endswith(INDEX_SUFFIX)]
        if len(idx) != 1:
            raise InputError(f"{path}: expected one *{INDEX_SUFFIX} in the folder, found {len(idx)}; name the file")
        path = os.path.join(path, idx[0])
    if not os.path.exists(path):
        raise InputError(f"{path}: no such file")
    if path.endswith(".json"):
        try:
            with open(path) as f:
                index = json.load(f)
            files = sorted(set(index["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise FormatError(f"{path} is not a valid safetensors index ({e})") from None
        return path, [os.path.join(os.path.dirname(path), f) for f in files]
    return None, [path]


class Converted:
    """An open converted checkpoint (single file or shards)."""

    def __init__(self, path: str, verify: bool = True):
        self.path, self.verify = path, verify
        index_path, files = _resolve(path)
        self.readers = [safetensors_io.Reader(f) for f in files]
        if index_path:
            with open(index_path) as f:
                meta = json.load(f).get("metadata", {})
        else:
            meta = self.readers[0].metadata
        for m in [meta] + [r.metadata for r in self.readers]:  # every shard is tagged too
            self._check_version(m)
        self.version = int(meta["ckptq.version"])
        self.files = ([index_path] if index_path else []) + files
        try:
            self.skeleton = json.loads(meta["ckptq.skeleton"])
            self.info = json.loads(meta.get("ckptq.info", "{}"))
        except (KeyError, ValueError) as e:
            raise FormatError(f"{path}: ckptq metadata is missing or corrupt ({e})") from None
        self._where = {name: r for r in self.readers for name in r.entries}

    def _check_version(self, meta: dict) -> None:
        if meta.get("ckptq.format") != FORMAT_NAME:
            raise FormatError(f"{self.path} is a safetensors file but not one written by ckptq "
                              "(no ckptq.format in its metadata); convert a torch checkpoint first")
        version = meta.get("ckptq.version", "")
        if not version.isdigit() or int(version) not in READS_VERSIONS:
            raise FormatError(f"{self.path} uses ckptq format version {version!r}; this ckptq reads "
                              f"{READS_VERSIONS}: upgrade ckptq")

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
        dtype, shape = tree.dtype_from_name(_ST_TO_TORCH.get(entry["dtype"], "?")), tuple(entry["shape"])
        flat = compress.decompress(r.raw(name, self.verify), params, dtype, int(torch.Size(shape).numel()))
        return flat.reshape(shape)

    def read(self, dequantize: bool = False, lazy: bool = False) -> Any:
        return tree.unflatten(self.skeleton, self.fetch, dequantize, lazy, self._numel_as)

    def _numel_as(self, name: str, dtype: torch.dtype) -> int | None:
        """Elements of stored tensor ``name`` if it is stored as ``dtype`` (else None: not viewable lazily)."""
        r = self._where.get(name)
        entry = r.table.get(name, {}) if r else {}
        if _ST_TO_TORCH.get(entry.get("dtype")) != tree.dtype_name(dtype):
            return None
        return int(torch.Size(entry["shape"]).numel())

    def close(self) -> None:
        for r in self.readers:
            r.close()


_ST_TO_TORCH = {v: tree.dtype_name(k) for k, v in tree.DTYPES.items()}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """'300MB', '5GB', '1.5GiB', '123' -> bytes."""
    m = _SIZE.match(str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        from .errors import UsageError

        raise UsageError(f"size {text!r} is not understood; write it like 300MB, 5GB or 2GiB")
    return int(float(m.group(1)) * _UNITS[unit])
