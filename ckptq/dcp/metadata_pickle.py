"""A DCP folder's ``.metadata`` pickle, read as plain data: what ckptq checks is what torch then reads.

An unpickler that admits classes by name is not enough on its own. A pickle ``BUILD`` writes any
instance ``__dict__`` state onto the objects it made, so an admitted ``OrderedDict`` can carry an
``items`` attribute that hides its entries from a check that iterates ``.items()``, while torch, which
looks entries up by key, still reads them; a ``MetadataIndex`` can be edited after it became a dict key.
So ``unpickle`` admits the classes DCP's ``Metadata`` is made of (names matched exactly:
``METADATA_GLOBALS``, torch's dtypes and layouts) and then rebuilds the result (``_Rebuild``): every
dataclass anew from its fields (exactly that class, no state beyond its fields), every dict a fresh
``dict`` read through ``dict.items`` (an ``OrderedDict`` with instance state is refused), every size a
``torch.Size`` of ``int``. The rebuilt ``Metadata`` is the one ckptq checks and hands to ``dcp.load``.

OLMo-core writes its own ``olmo_core.distributed.checkpoint.filesystem._StorageInfo`` (the same three
fields as torch's): admitted by name as an inert stand-in, without importing OLMo-core, and rebuilt as
torch's ``_StorageInfo``.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import importlib
import io
import pickle
from pathlib import PurePosixPath, PureWindowsPath

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from ..errors import InputError
from ..format import files

_DCP = "torch.distributed.checkpoint"
OLD_PROPERTIES = "torch.distributed._shard.sharded_tensor.metadata"  # where torch < 2.2 kept TensorProperties
OLMO_STORAGE_INFO = "olmo_core.distributed.checkpoint.filesystem._StorageInfo"
METADATA_GLOBALS = frozenset({
    f"{_DCP}.metadata.Metadata", f"{_DCP}.metadata.TensorStorageMetadata", f"{_DCP}.metadata.BytesStorageMetadata",
    f"{_DCP}.metadata.ChunkStorageMetadata", f"{_DCP}.metadata.TensorProperties", f"{_DCP}.metadata.MetadataIndex",
    f"{_DCP}.metadata.StorageMeta", f"{_DCP}.metadata._MEM_FORMAT_ENCODING", f"{_DCP}.filesystem._StorageInfo",
    f"{OLD_PROPERTIES}.TensorProperties", f"{OLD_PROPERTIES}.MEM_FORMAT_ENCODING", OLMO_STORAGE_INFO,
    "torch.Size", "torch.serialization._get_layout",  # a layout pickles as _get_layout("torch.strided")
    "collections.OrderedDict", "builtins.set", "builtins.frozenset",
})
# StorageMeta.checkpoint_id is the path the writer was given: read back as a pure path (no file access,
# and a folder written on Windows still reads on Linux).
_PATHS = {f"{module}.{name}": pure for module in ("pathlib", "pathlib._local")
          for name, pure in (("PosixPath", PurePosixPath), ("PurePosixPath", PurePosixPath),
                             ("WindowsPath", PureWindowsPath), ("PureWindowsPath", PureWindowsPath))}


class OlmoStorageInfo:
    """Stands in for OLMo-core's ``_StorageInfo`` while unpickling: holds the state it is given, runs nothing."""

    def __setstate__(self, state):
        self.__dict__["_state"] = state


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the globals DCP metadata is made of, by exact name; imports nothing else."""

    def find_class(self, module: str, name: str):
        full = f"{module}.{name}"
        if full in _PATHS:
            return _PATHS[full]
        if full == OLMO_STORAGE_INFO:
            return OlmoStorageInfo
        if full in METADATA_GLOBALS:
            return vars(importlib.import_module(module))[name]
        if module == "torch" and isinstance(vars(torch).get(name), (torch.dtype, torch.layout)):
            return vars(torch)[name]
        raise _Refused(full)


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def unpickle(raw: bytes, path: str) -> Metadata:
    """The ``Metadata`` pickled in ``raw`` (the bytes of ``path``), rebuilt as plain data; InputError
    (one line) for any other global, damage, or state that DCP's classes do not have."""
    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except _Refused as e:
        name = e.name[:120] if e.name.isprintable() else repr(e.name[:120])
        raise InputError(f"{path} needs {name}, which DCP metadata never holds; ckptq does not unpickle "
                         "it (the folder is crafted or damaged)") from None
    except RecursionError:
        raise InputError(f"{path} is not readable DCP metadata: nested too deep") from None
    except Exception as e:  # a damaged pickle raises many types (EOFError, KeyError, TypeError...)
        raise InputError(f"{path} is not readable DCP metadata: {first_line(e)}") from None
    if type(md) is not Metadata:
        raise InputError(f"{path} is not readable DCP metadata: it holds {type(md).__name__[:40]}, not a Metadata")
    paused = gc.isenabled()
    gc.disable()  # the rebuild makes only acyclic objects; collections would walk the whole graph again and again
    try:
        return _Rebuild(path).metadata(md)
    finally:
        if paused:
            gc.enable()


_PROPERTY_CLASSES = [TensorProperties]
try:  # folders written by torch < 2.2
    _PROPERTY_CLASSES.append(vars(importlib.import_module(OLD_PROPERTIES))["TensorProperties"])
except (ImportError, KeyError):
    pass
_LEAVES = (type(None), bool, int, float, complex, str, bytes)
_REQUIRED = object()
_DEFAULTS: dict[type, dict] = {}


def _defaults(cls) -> dict:
    """{field name: a function giving its default, or _REQUIRED} of a dataclass, computed once."""
    if cls not in _DEFAULTS:
        _DEFAULTS[cls] = {f.name: (lambda v=f.default: v) if f.default is not dataclasses.MISSING
                          else f.default_factory if f.default_factory is not dataclasses.MISSING else _REQUIRED
                          for f in dataclasses.fields(cls)}
    return _DEFAULTS[cls]


class _Rebuild:
    """Fresh objects of exact types from what the unpickler made; each object rebuilt once (shared parts
    stay shared, and a crafted graph of shared parts costs no more than its size)."""

    def __init__(self, path: str):
        self.path = path
        self.done: dict[int, object] = {}
        self.keep: list = []  # the originals, alive while their ids key ``done``

    def refuse(self, what: str) -> InputError:
        return InputError(f"{self.path}: {what[:200]}; DCP metadata never holds that (the folder is crafted or damaged)")

    def metadata(self, md: Metadata) -> Metadata:
        f = self.fields(md, Metadata)
        return Metadata(
            state_dict_metadata=self.mapping(f["state_dict_metadata"], "state_dict_metadata", str, self.entry),
            planner_data=self.plain(f["planner_data"], 0),
            storage_data=self.mapping(f["storage_data"], "storage_data", MetadataIndex, self.storage_info,
                                      key=self.index),
            storage_meta=None if f["storage_meta"] is None else self.storage_meta(f["storage_meta"]),
            **({"version": self.plain(f["version"], 0)} if "version" in f else {}))

    def fields(self, obj, *classes) -> dict:
        """The dataclass fields of ``obj``, an instance of exactly one of ``classes`` holding no other state
        (a field it lacks takes its default, as attribute lookup on the instance would give it)."""
        if type(obj) not in classes:
            raise self.refuse(f"{type(obj).__name__[:40]} where a {classes[0].__name__} belongs")
        state = vars(obj)
        defaults = _defaults(classes[0])
        if not state.keys() <= defaults.keys():
            extra = sorted(map(str, state.keys() - defaults.keys()))[:3]
            raise self.refuse(f"a {classes[0].__name__} with attributes {extra}")
        out = {}
        for name, default in defaults.items():
            if name in state:
                out[name] = state[name]
            elif default is _REQUIRED:
                raise self.refuse(f"a {classes[0].__name__} that lacks its field {name}")
            else:
                out[name] = default()
        return out

    def items(self, obj, what: str) -> list:
        """The entries of a dict (or an OrderedDict without instance state), read as dict reads them."""
        if type(obj) is collections.OrderedDict and vars(obj):
            raise self.refuse(f"{what}: an OrderedDict with attributes {sorted(map(str, vars(obj)))[:3]}")
        if type(obj) not in (dict, collections.OrderedDict):
            raise self.refuse(f"{what}: {type(obj).__name__[:40]} where a dict belongs")
        return list(dict.items(obj))

    def mapping(self, obj, what: str, key_type, value, key=None) -> dict:
        out = {}
        for k, v in self.items(obj, what):
            k = key(k) if key else k
            if type(k) is not key_type:
                raise self.refuse(f"{what}: a key of type {type(k).__name__[:40]}")
            if k in out:
                raise self.refuse(f"{what}: {str(k)[:80]} twice")
            out[k] = value(v)
        return out

    def size(self, obj, what: str) -> torch.Size:
        if type(obj) is not torch.Size or not all(type(d) is int for d in tuple.__iter__(obj)):
            raise self.refuse(f"{what}: {type(obj).__name__[:40]} where a torch.Size of integers belongs")
        return torch.Size(tuple.__iter__(obj))

    def index(self, obj) -> MetadataIndex:
        f = self.fields(obj, MetadataIndex)
        offset = f.get("offset")
        index = f.get("index")
        if type(f["fqn"]) is not str or (index is not None and type(index) is not int):
            raise self.refuse("a MetadataIndex whose fqn is not a string or whose index is not an integer")
        return MetadataIndex(f["fqn"], None if offset is None else self.size(offset, f"{f['fqn']}: offset"), index)

    def storage_info(self, obj) -> _StorageInfo:
        if type(obj) is OlmoStorageInfo:
            state = obj.__dict__.get("_state")
            state = state[0] if isinstance(state, tuple) and len(state) == 2 else state
            if type(state) is not dict or set(state) != {"relative_path", "offset", "length"}:
                raise self.refuse("an OLMo-core _StorageInfo without exactly relative_path, offset and length")
            return _StorageInfo(*(self.plain(state[k], 0) for k in ("relative_path", "offset", "length")))
        f = self.fields(obj, _StorageInfo)
        return _StorageInfo(**{k: self.plain(v, 0) for k, v in f.items()})

    def entry(self, obj):
        if type(obj) is BytesStorageMetadata:
            self.fields(obj, BytesStorageMetadata)
            return BytesStorageMetadata()
        f = self.fields(obj, TensorStorageMetadata)
        if type(f["chunks"]) is not list:
            raise self.refuse("tensor chunks that are not a list")
        chunks = []
        for c in list.__iter__(f["chunks"]):
            cf = self.fields(c, ChunkStorageMetadata)
            chunks.append(ChunkStorageMetadata(self.size(cf["offsets"], "chunk offsets"), self.size(cf["sizes"], "chunk sizes")))
        return TensorStorageMetadata(self.properties(f["properties"]), self.size(f["size"], "tensor size"), chunks)

    def properties(self, obj) -> TensorProperties:
        f = self.fields(obj, *_PROPERTY_CLASSES)
        dtype, layout, memory_format = f.get("dtype"), f.get("layout", torch.strided), f.get("memory_format")
        if not (isinstance(dtype, torch.dtype) and isinstance(layout, torch.layout)
                and isinstance(memory_format, (torch.memory_format, type(None)))):
            raise self.refuse("tensor properties without a torch dtype, layout and memory format")
        flags = {k: f.get(k, False) for k in ("requires_grad", "pin_memory")}
        if not all(type(v) is bool for v in flags.values()):
            raise self.refuse("tensor properties whose flags are not booleans")
        return TensorProperties(dtype, layout, memory_format=memory_format or torch.contiguous_format, **flags)

    def storage_meta(self, obj) -> StorageMeta:
        f = self.fields(obj, StorageMeta)
        cid = f["checkpoint_id"]
        if type(cid) in (PurePosixPath, PureWindowsPath):
            try:
                cid = str(cid)
            except Exception:
                raise self.refuse("a checkpoint_id path that does not read as text") from None
        cid = self.plain(cid, 0)
        return StorageMeta(checkpoint_id=cid, save_id=self.plain(f["save_id"], 0), load_id=self.plain(f["load_id"], 0),
                           modules=self.plain(f["modules"], 0))

    def plain(self, obj, depth: int):
        """Plain data (numbers, strings, bytes, None; lists, tuples, sets and dicts of them), rebuilt."""
        if type(obj) in _LEAVES:
            return obj
        if id(obj) in self.done:
            return self.done[id(obj)]
        if depth > files.MAX_NESTING:
            raise self.refuse(f"data nested more than {files.MAX_NESTING} levels deep")
        if type(obj) in (list, tuple):
            out = type(obj)(self.plain(v, depth + 1) for v in obj)
        elif type(obj) in (set, frozenset):
            out = type(obj)(self.plain(v, depth + 1) for v in obj)
        elif type(obj) in (dict, collections.OrderedDict):
            out = {self.plain(k, depth + 1): self.plain(v, depth + 1) for k, v in self.items(obj, "planner data")}
        else:
            raise self.refuse(f"{type(obj).__name__[:40]} in plain data")
        self.keep.append(obj)
        self.done[id(obj)] = out
        return out
