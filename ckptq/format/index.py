"""Sharded sets: writing and reading the Hugging Face-style index, and tying shards to it.

An index may name only plain file names in its own folder (no paths, no ``..``), and each must be a
regular file. From format version 2 the index records every shard's header checksum
(``ckptq.shards``), and each shard's header checksum covers its tensor table, which holds every tensor's
crc32: a set mixing shards of two writes (a crash between the renames of an overwrite) is refused.
"""

from __future__ import annotations

import json
import os

from . import integrity
from ..errors import FormatError, InputError
from .files import open_regular
from .header import MAX_HEADER, SHARDS_KEY, parse_json

SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"


def index_bytes(metadata: dict, weight_map: dict, shard_crcs: dict[str, str]) -> bytes:
    """The sealed index file."""
    meta = {**metadata, SHARDS_KEY: json.dumps(shard_crcs, separators=(",", ":")), integrity.KEY: integrity.PLACEHOLDER}
    raw = bytearray(json.dumps({"metadata": meta, "weight_map": weight_map}, indent=1, separators=(",", ":")).encode())
    integrity.seal(raw)
    return bytes(raw)


def resolve(path: str) -> str:
    """A file or an index; a folder must hold exactly one index."""
    if os.path.isdir(path):
        idx = [f for f in os.listdir(path) if f.endswith(INDEX_SUFFIX)]
        if len(idx) != 1:
            raise InputError(f"{path}: expected one *{INDEX_SUFFIX} in the folder, found {len(idx)}; name the file")
        path = os.path.join(path, idx[0])
    return path


def _plain_name(name) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and os.path.basename(name) == name)


def read_index(path: str) -> tuple[dict, dict[str, str], list[str]]:
    """(metadata, weight_map, shard paths) of a validated index."""
    with open_regular(path) as f:
        raw = f.read(MAX_HEADER + 1)
    if len(raw) > MAX_HEADER:
        raise FormatError(f"{path} is over {MAX_HEADER} bytes: not a ckptq index")
    integrity.precheck(raw, path)
    index = parse_json(raw, f"{path}: the index")
    meta = index.get("metadata") if isinstance(index, dict) else None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not (isinstance(meta, dict) and isinstance(wmap, dict) and wmap):
        raise FormatError(f"{path} is not a valid safetensors index (needs 'metadata' and a non-empty 'weight_map')")
    if meta.get("ckptq.version") in integrity.SEALED_VERSIONS and integrity.KEY in meta:
        integrity.verify(raw, meta[integrity.KEY], path)
    bad = [v for v in wmap.values() if not _plain_name(v)]
    if bad or not all(isinstance(k, str) for k in wmap):
        raise FormatError(f"{path} names shard {str(bad[:1])[:80]}; an index may only name files in its own folder")
    folder = os.path.dirname(path)
    return meta, wmap, [os.path.join(folder, f) for f in sorted(set(wmap.values()))]


def check_set(path: str, meta: dict, wmap: dict, readers: list, sealed: bool) -> None:
    """Every tensor is where the index says; with ``sealed`` (version 2), every shard is the one the
    index was written with."""
    by_file = {os.path.basename(r.path): r for r in readers}
    for name, file in wmap.items():
        if name not in by_file[file].entries:
            raise FormatError(f"{path}: tensor {name[:80]!r} is not in shard {file}; the set is incomplete or mixed")
    held = sum(len(r.entries) for r in readers)
    if held != len(wmap):
        raise FormatError(f"{path}: the shards hold {held} tensors, the index names {len(wmap)}; the set is mixed")
    if sealed:
        recorded = parse_json(meta.get(SHARDS_KEY, "null"), f"{path}: {SHARDS_KEY}")
        if not (isinstance(recorded, dict) and set(recorded) == set(by_file)):
            raise FormatError(f"{path}: {SHARDS_KEY} does not list the shards the index names; the file is corrupt")
        for file, r in by_file.items():
            if r.metadata.get(integrity.KEY) != recorded[file]:
                raise FormatError(f"{path}: shard {file} is not the one this index was written with (header "
                                  f"checksum {r.metadata.get(integrity.KEY)}, index records {recorded[file]}): "
                                  "the set mixes two writes; re-create it")
    _check_numbering(path, readers)


def _check_numbering(path: str, readers: list) -> None:
    k = len(readers)
    tags = sorted(r.metadata.get("ckptq.shard", "") for r in readers)
    want = sorted(f"{i}/{k}" for i in range(1, k + 1))
    if tags != want:
        raise FormatError(f"{path}: the shards are tagged {tags[:4]}, expected {want[:4]}; the set is mixed or incomplete")
