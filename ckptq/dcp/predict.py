"""What ``ckptq convert`` of a DCP folder would write, before it reads a value (``ckptq info``): the bytes of
each entry as ``FileSystemWriter`` stores it (every tensor and every small value through ``torch.save``) and
of its index entry in ``.metadata``, so that the prediction holds for small folders too, where those
overheads are most of the size."""

from __future__ import annotations

import functools
import io
import math
import pickle

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)

from ..sources.options import InfoOptions
from ..sources.reports import InfoReport, StateRow
from . import folder

MARKER_BYTES = 128  # the .ckptq marker a converted folder holds: a JSON line listing its few files


def _saved_len(obj) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.tell()


@functools.lru_cache(maxsize=None)
def _tensor_overhead(dtype: torch.dtype, ndim: int) -> int:
    return _saved_len(torch.zeros((1,) * ndim, dtype=dtype)) - dtype.itemsize


def tensor_bytes(shape, dtype: torch.dtype) -> int:
    """A tensor entry's bytes in a .distcp file (its data, then torch.save's records; within ~64 bytes)."""
    return math.prod(shape) * dtype.itemsize + _tensor_overhead(dtype, len(shape))


@functools.lru_cache(maxsize=4096)
def _value_bytes(text: str, value) -> int:
    buf = io.BytesIO()
    torch.save(value, buf, _use_new_zipfile_serialization=False)
    return buf.tell()


def value_bytes(value) -> int:
    """A small value's entry (torch.save of it, legacy format, as ``compact.CompactSavePlanner`` writes it)."""
    return _value_bytes(repr(value), value if not isinstance(value, list) else tuple(value))


def _index(entries: dict) -> dict:
    """{key: storage metadata} -> what .metadata holds for them (their metadata and where each lies)."""
    where = _StorageInfo("__0_0.distcp", 1 << 20, 1 << 20)
    return {**entries, **{MetadataIndex(k): where for k in entries}}


def _tensor_meta(shape, dtype: torch.dtype) -> TensorStorageMetadata:
    return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape),
                                 [ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))])


def _removed(m: TensorStorageMetadata) -> int:
    """The bytes an fp32 moment holds in the source folder's data files: its chunks (one per saving rank)."""
    return sum(tensor_bytes(tuple(c.sizes), m.properties.dtype) for c in m.chunks)


def _added(key: str, s: folder.Stored, block_size: int, index: dict) -> int:
    """The data bytes of the entries of a low-bit moment; their storage metadata go to ``index``."""
    total = 0
    for name, (shape, dtype) in folder.tensor_parts(s, block_size).items():
        total += tensor_bytes(shape, dtype)
        index[f"{key}.{name}"] = _tensor_meta(shape, dtype)
    for name, value in folder.scalar_parts(s, block_size).items():
        total += value_bytes(value)
        index[f"{key}.{name}"] = BytesStorageMetadata()
    return total


def _rewritten(p: folder.Plan, md) -> int:
    """What the folder's small values change by when convert writes them again (compactly)."""
    stored: dict = {}
    for index, where in md.storage_data.items():
        if isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata) and index.fqn in p.scalars:
            stored[index.fqn] = stored.get(index.fqn, 0) + where.length
    return sum(value_bytes(p.scalars[k]) - n for k, n in stored.items())


def predict(r: InfoReport, p: folder.Plan, opts: InfoOptions, md) -> None:
    """Fill ``r.would_store`` and ``r.would_write`` with what convert would store at ``opts.bits`` (before it
    reads the values: a moment holding NaN/Inf would stay exact); ``md`` is the folder's metadata."""
    if not p.params:
        return
    change, added, removed = MARKER_BYTES + _rewritten(p, md), {}, {}
    for param in p.params:
        ratio = "exp_avg" in param.roles and "exp_avg_sq" in param.roles
        for role, (key, m) in param.roles.items():
            divides = ratio and role == "exp_avg"
            width = folder.working_width(opts.bits)
            s = folder.Stored(param, role, width, ("exp_avg_sq", float(param.group.get("eps", 1e-8))) if divides else None)
            change += _added(key, s, opts.block_size, added) - _removed(m)
            removed[key] = m
            row = next((w for w in r.would_store if (w.role, w.bits) == (role, width)), None)
            if row is None:
                row = StateRow(role, width)
                r.would_store.append(row)
            row.tensors, row.elements = row.tensors + 1, row.elements + m.size.numel()
            parts = folder.tensor_parts(s, opts.block_size)
            row.stored_bytes += sum(math.prod(parts[n][0]) * parts[n][1].itemsize for n in ("codes", "absmax"))
    r.options = {"bits": opts.bits, "block_size": opts.block_size, "min_size": opts.min_size}
    change += len(pickle.dumps(_index(added))) - len(pickle.dumps(_index(removed)))  # .metadata
    r.would_write = r.bytes + change
    r.notes.append("sizes before convert reads the values (a moment holding NaN/Inf would stay exact)")
