"""Reading torch.distributed.checkpoint (DCP) folders that someone else wrote, without running their code.

torch treats a DCP folder as trusted: ``FileSystemReader.read_metadata`` is a bare ``pickle.load`` of
``.metadata``, and ``DefaultLoadPlanner.load_bytes`` is ``torch.load(weights_only=False)`` of every
non-tensor entry (``optimizer.param_groups.0.lr``); a crafted pickle in either runs whatever it names.
Inspecting checkpoints from others is ckptq's job, so it reads DCP this way instead:

- ``.metadata`` through an unpickler that admits only the classes DCP's ``Metadata`` is made of (names
  matched exactly: ``METADATA_GLOBALS``, torch's dtypes and layouts), then checked (``check_metadata``):
  sizes >= 0 and at most 2**48 elements, chunks inside their tensor, covering it without overlap, each
  stored in as many bytes as it needs, inside its data file; data files named by plain names in the folder;
- byte entries through ``torch.load(weights_only=True)`` (``load_entry``), nested at most
  ``files.MAX_NESTING`` deep;
- data files opened only if they are regular files: a FIFO would block ``open`` forever.

- the other files, which convert copies (``companions``): regular files and folders only.

``SafeFileSystemReader`` and ``SafeLoadPlanner`` do this inside any ``dcp.load`` (docs/security.md);
``read_items`` is the one-process read that ``ckptq.dcp.folder`` uses.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import math
import os
import pickle
import re
import stat
import warnings
from contextlib import contextmanager

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from ..errors import CkptqError, InputError
from ..format import files, spans as spans_
from . import boxes as boxes_, metadata_pickle
from .metadata_pickle import first_line as _first_line

MAX_ELEMENTS = 2**48  # per tensor: 1 PiB of bytes; more is a crafted size, not a checkpoint

METADATA_GLOBALS = metadata_pickle.METADATA_GLOBALS  # the classes a .metadata pickle may name, by exact name


def load_metadata(folder: str, name: str = ".metadata") -> Metadata:
    """The checked ``Metadata`` of a DCP folder (``name``: ``__<rank>.metadata`` for rank-local metadata).
    Each ``dcp.load`` reads it again (convert loads a folder one parameter at a time), so the checked
    result is kept for the same bytes and the same data files (device, inode, size, mtime), and handed out
    as a copy with its own ``storage_meta``."""
    path = os.path.join(folder, name)
    with files.open_regular(path, "DCP metadata") as f:
        raw = f.read()
    key = (os.path.realpath(folder), name, hashlib.blake2b(raw, digest_size=20).digest())
    md, seen = _checked.pop(key, (None, None))
    if md is None or _data_files(folder, md) != seen:
        md = metadata_pickle.unpickle(raw, path)
        check_metadata(md, folder, path)
        seen = _data_files(folder, md)
    _checked[key] = (md, seen)
    while len(_checked) > 4:
        _checked.pop(next(iter(_checked)))
    storage_meta = copy.copy(md.storage_meta) if md.storage_meta is not None else None
    return dataclasses.replace(md, storage_meta=storage_meta)


_checked: dict[tuple, tuple] = {}  # (folder, name, digest) -> (checked metadata, its data files), newest last


def _data_files(folder: str, md) -> tuple | None:
    """(name, device, inode, size, mtime) of each data file ``md`` names; None if one cannot be stat'ed."""
    try:
        stats = {n: os.stat(os.path.join(folder, n)) for n in {i.relative_path for i in md.storage_data.values()}}
    except OSError:
        return None
    return tuple(sorted((n, s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns) for n, s in stats.items()))


def _bad(path: str, what: str) -> InputError:
    return InputError(f"{path}: {what[:300]}; the folder is damaged or crafted")


def check_metadata(md, folder: str, path: str) -> None:
    """InputError (one line) unless ``md`` is DCP metadata whose every entry can be read as it says."""
    if not (isinstance(md, Metadata) and _complete(md) and isinstance(md.state_dict_metadata, dict)
            and isinstance(md.storage_data, dict)):
        raise InputError(f"{path} is not readable DCP metadata: no Metadata with state_dict_metadata and storage_data")
    if md.storage_meta is not None and not (isinstance(md.storage_meta, StorageMeta) and _complete(md.storage_meta)):
        raise _bad(path, "storage_meta is not a StorageMeta")
    files.check_nesting(md.planner_data, f"{path}: planner_data")
    stored = _check_storage(md.storage_data, folder, path)
    for key, m in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise _bad(path, f"entry name {key!r:.80} is not a string")
        if isinstance(m, TensorStorageMetadata):
            _check_tensor(key, m, stored, path)
        elif not isinstance(m, BytesStorageMetadata):
            raise _bad(path, f"{key}: {type(m).__name__} is neither tensor nor bytes storage metadata")
        elif MetadataIndex(key) not in stored:
            raise _bad(path, f"{key}: no stored data")


def _complete(obj) -> bool:
    """Whether a dataclass instance has all its fields (a crafted BUILD state may leave some out)."""
    return all(hasattr(obj, f.name) for f in dataclasses.fields(obj))


def _plain_name(name) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and os.path.basename(name) == name)


def _check_storage(storage: dict, folder: str, path: str) -> dict:
    """Where each item is stored: plain file names in ``folder``, regular files, byte ranges inside them."""
    sizes: dict[str, int] = {}
    ranges: dict[str, list] = {}
    for index, info in storage.items():
        if not (isinstance(index, MetadataIndex) and _complete(index) and isinstance(index.fqn, str)
                and isinstance(info, _StorageInfo) and _complete(info)):
            raise _bad(path, f"storage_data holds {type(index).__name__} -> {type(info).__name__} (or lacks fields)")
        name = info.relative_path
        if not _plain_name(name):
            raise InputError(f"{path} names data file {str(name)[:80]!r}; DCP metadata may only name files in its "
                             "own folder")
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and transforms != [] and transforms != ():
            raise InputError(f"{path}: {index.fqn} is stored through DCP stream transforms {transforms!r:.80}; "
                             "ckptq reads only untransformed DCP data")
        if not (_count(info.offset) and _count(info.length)):
            raise _bad(path, f"{index.fqn}: offset {_short(info.offset)} and length {_short(info.length)} must be "
                             "integers from 0 to 2**63")
        if name not in sizes:
            if not os.path.lexists(os.path.join(folder, name)):
                raise InputError(f"{folder}: cannot read {name}, which its metadata names: no such file")
            with files.open_regular(os.path.join(folder, name), "DCP data file") as f:
                sizes[name] = os.fstat(f.fileno()).st_size
        if info.offset + info.length > sizes[name]:
            raise _bad(path, f"{index.fqn}: its data at bytes {info.offset}..{info.offset + info.length} lies beyond "
                             f"the end of {name} ({sizes[name]} bytes)")
        ranges.setdefault(name, []).append((info.offset, info.length, index.fqn))
    for name, spans in ranges.items():  # items that share bytes would give one input byte many outputs
        pair = spans_.overlapping_ranges(spans)
        if pair:
            raise _bad(path, f"{pair[0][2]} and {pair[1][2]} are stored in the same bytes of {name} "
                             f"({pair[1][0]}..{min(pair[0][0] + pair[0][1], pair[1][0] + pair[1][1])})")
    return storage


def _short(v) -> str:
    """``v`` for a message: an integer of thousands of digits cannot even be printed (Python's limit)."""
    if type(v) is int and abs(v) >= 2**64:
        return f"an integer of {v.bit_length()} bits"
    return f"{v!r:.40}"


def _count(v) -> bool:
    return type(v) is int and 0 <= v < 2**63


def _dims(v, what: str, key: str, path: str) -> tuple:
    if not isinstance(v, torch.Size):
        raise _bad(path, f"{key}: {what} {v!r:.80} is not a torch.Size")
    if any(d < 0 for d in v):
        raise _bad(path, f"{key}: {what} {tuple(v)} has a negative dimension")
    return tuple(v)


def _check_tensor(key: str, m: TensorStorageMetadata, stored: dict, path: str) -> None:
    """Size and chunks of one tensor: what torch's own save planner checks (``_validate_global_plan``),
    plus the bytes each chunk needs (its torch.save record holds them uncompressed)."""
    if not _complete(m):
        raise _bad(path, f"{key}: its tensor metadata lacks fields")
    props = m.properties
    if not (isinstance(props, TensorProperties) and hasattr(props, "dtype") and isinstance(props.dtype, torch.dtype)):
        raise _bad(path, f"{key}: its properties name no dtype")
    size = _dims(m.size, "size", key, path)
    numel = math.prod(size)
    if numel > MAX_ELEMENTS:
        raise _bad(path, f"{key}: size {size} has more than 2**48 elements")
    if not isinstance(m.chunks, list) or not all(isinstance(c, ChunkStorageMetadata) and _complete(c) for c in m.chunks):
        raise _bad(path, f"{key}: its chunks are not a list of ChunkStorageMetadata")
    total, boxes = 0, []
    for c in m.chunks:
        offsets, sizes = _dims(c.offsets, "chunk offsets", key, path), _dims(c.sizes, "chunk size", key, path)
        if not len(offsets) == len(sizes) == len(size):
            raise _bad(path, f"{key}: a chunk has {len(sizes)} dimensions, the tensor {len(size)}")
        if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise _bad(path, f"{key}: the chunk at {offsets} of size {sizes} lies outside the tensor's size {size}")
        info = stored.get(MetadataIndex(key, offsets))
        if info is None:
            raise _bad(path, f"{key}: no stored data for its chunk at {offsets}")
        volume = math.prod(sizes)
        if volume * props.dtype.itemsize > info.length:
            raise _bad(path, f"{key}: a chunk of {volume} elements ({volume * props.dtype.itemsize} bytes) is stored "
                             f"in {info.length} bytes")
        total += volume
        if volume:
            boxes.append((offsets, sizes))
    if total != numel:
        raise _bad(path, f"{key}: its chunks cover {total} of its {numel} elements")
    try:
        pair = boxes_.overlapping(boxes)
    except boxes_.TooIrregular:
        raise _bad(path, f"{key}: its {len(boxes)} chunks of {len(size)} dimensions form no grid, which no sharding "
                         "writes, and are too many to check") from None
    if pair:
        raise _bad(path, f"{key}: chunks at {pair[0]} and {pair[1]} overlap")


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_entry(data: io.BytesIO, key: str):
    """A DCP byte entry (a torch.save record) through ``torch.load(weights_only=True)``."""
    try:
        obj = torch.load(data, weights_only=True)
    except pickle.UnpicklingError as e:
        found = _GLOBAL.search(str(e))
        if found:
            raise InputError(f"DCP entry {key} needs arbitrary unpickling of {found[1]}, which ckptq refuses "
                             "(torch.load weights_only=True)") from None
        raise InputError(f"DCP entry {key} is not readable: {_first_line(e)}") from None
    except RecursionError:
        raise InputError(f"DCP entry {key} is nested too deep to read; ckptq refuses it") from None
    except Exception as e:  # a damaged record: zip, pickle and storage errors of many types
        raise InputError(f"DCP entry {key} is not readable: {_first_line(e)}") from None
    files.check_nesting(obj, f"DCP entry {key}")
    return obj


def read_items(folder: str, items: dict) -> dict:
    """``dcp.load`` of ``items`` ({key: template}) from ``folder`` in this process only (no collectives),
    through ``SafeFileSystemReader`` and ``SafeLoadPlanner``; every failure one InputError."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(items, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(), no_dist=True)
    except CkptqError:
        raise
    except (Exception, CheckpointException) as e:  # a short .distcp file, a key the files lack
        ours = [f[0] for f in getattr(e, "failures", {}).values() if isinstance(f, tuple) and isinstance(f[0], CkptqError)]
        if ours:  # what this module refused, as DCP caught it on the rank that read it
            raise ours[0] from None
        last = [line for line in str(e).splitlines() if line.strip()][-1:] or [type(e).__name__]
        raise InputError(f"{folder}: cannot read {', '.join(map(str, list(items)[:3]))}: {last[0].strip()[:200]}") from None
    return items


def companions(folder: str) -> list[tuple[str, str]]:
    """The other files of a DCP folder (Lightning's ``meta.pt``), which convert copies as they are:
    (path relative to ``folder``, "file" | "folder" | "link"), folders before what they hold. Top-level
    symlinks are left out; inside folders links stay links (never read). A FIFO, socket or device is
    refused before anything is copied: copying it would block or fail midway."""
    found, pending = [], [""]
    while pending:
        rel = pending.pop()
        for entry in sorted(os.scandir(os.path.join(folder, rel)), key=lambda e: e.name):
            name = os.path.join(rel, entry.name)
            if not rel and (entry.name == ".metadata" or entry.name.endswith(".distcp") or entry.is_symlink()):
                continue
            if entry.is_symlink():
                found.append((name, "link"))
            elif entry.is_dir(follow_symlinks=False):
                found.append((name, "folder"))
                pending.append(name)
            elif entry.is_file(follow_symlinks=False):
                found.append((name, "file"))
            else:
                kind = "a FIFO" if stat.S_ISFIFO(entry.stat(follow_symlinks=False).st_mode) else "not a regular file"
                raise InputError(f"{entry.path} is {kind}; convert copies only regular files beside the DCP data "
                                 "(move it out of the folder)")
    return found


class _RegularFiles(FileSystem):
    """DCP's file system, opening files for reading only if they are regular files (never blocking)."""

    @contextmanager
    def create_stream(self, path, mode: str):
        if "r" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with files.open_regular(str(path), "DCP data file") as stream:
            yield stream


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` for folders written by others: ``.metadata`` read through the restricted
    unpickler and checked, data files opened only if regular. ``dcp.load`` reads ``.metadata`` through its
    storage reader before any planner runs, so this reader, not the planner, is what keeps a crafted
    ``.metadata`` from running code: ``dcp.load(sd, storage_reader=SafeFileSystemReader(path),
    planner=ckptq.dcp.LowBitLoadPlanner())``."""

    def __init__(self, path, *args, **kwargs):
        super().__init__(path, *args, **kwargs)
        self.fs = _RegularFiles()

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        md = load_metadata(str(self.path), ".metadata" if rank is None else f"__{rank}.metadata")
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose byte entries go through ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_entry(value, fqn)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
