"""Reading torch.save checkpoints safely, and finding the optimizer states inside them."""

from __future__ import annotations

import os
import pickle
import zipfile
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..errors import InputError, UsageError
from ..format import files, torch_zip
from .views import QUANTIZABLE_DTYPES, is_quantizable, repeats_bytes, storage_key  # noqa: F401  (checkpoint.X)


def load_torch(path: str, trust: bool = False) -> Any:
    """``torch.load`` onto the CPU with ``weights_only=True`` (``trust=True`` allows full unpickling),
    memory-mapped where the file allows. Errors become one-line :class:`InputError`.

    A memory-mapped load does not check that each storage's zip record holds its bytes (a strict load
    does), so the records are checked first (``format.torch_zip``); a trusted file, whose pickle only torch
    can read, is loaded strictly instead. What is loaded is then checked to be what torch's consumers see
    (``check_loaded``)."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    mapped = zipfile.is_zipfile(path) and not trust
    if mapped:
        torch_zip.check_records(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=not trust, mmap=mapped)
    except pickle.UnpicklingError as e:
        raise InputError(_unsafe_message(path, e)) from None
    except Exception as e:  # torch raises many types for damaged files (RuntimeError, KeyError, EOFError...)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        raise InputError(f"{path} is not a readable torch checkpoint (truncated or not made by torch.save): {first}") from None
    check_loaded(obj, path)
    files.check_nesting(obj, path)  # what walks it next recurses: refuse absurd nesting in one line
    return obj


def check_loaded(obj: Any, path: str) -> None:
    """InputError unless no object in ``obj`` carries instance state that shadows its class's attributes.
    A pickle BUILD writes state onto the OrderedDicts (and tensors) that weights-only unpickling makes:
    an ``items`` attribute would hide a state dict's entries from ckptq's walks, which call
    ``.items()``, while torch's consumers still read them; a tensor's ``untyped_storage`` or ``numel``
    would make ckptq misread it. No honest checkpoint holds such state (``_metadata`` on a state dict,
    or a library's own tags on a Parameter, shadow nothing)."""
    seen, stack = set(), [obj]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        state = getattr(node, "__dict__", None) if isinstance(node, (dict, torch.Tensor)) else None
        if state:
            shadowed = sorted(str(name) for name in state if hasattr(type(node), name))
            if shadowed:
                raise InputError(f"{path} holds a {type(node).__name__} object with attributes {shadowed[:3]} that "
                                 "shadow its own methods, which torch.save never writes; the file is crafted, so "
                                 "ckptq refuses it")
            stack.extend(state.values())
        if isinstance(node, dict):
            stack.extend(dict.keys(node))
            stack.extend(dict.values(node))
        elif isinstance(node, (list, tuple, set, frozenset)):
            stack.extend(node)




def _unsafe_message(path: str, e: Exception) -> str:
    try:
        needs = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:
        needs = []
    if needs:
        return (f"{path} needs arbitrary unpickling of {', '.join(needs[:5])}, which torch.load(weights_only=True) "
                "refuses; ckptq keeps tensors, containers, numbers and strings only, so re-save the checkpoint "
                "with such objects as dicts or strings (e.g. vars(args)); `ckptq info --trust` shows a file you trust")
    if not zipfile.is_zipfile(path):  # torch's message would be a paragraph about weights_only
        return f"{path} is not a readable torch checkpoint (truncated or not made by torch.save)"
    return f"{path} is not a readable torch checkpoint: {str(e).splitlines()[0].split('. ')[0]}"


def is_dcp_folder(path: str) -> bool:
    """A torch.distributed.checkpoint folder: ``.metadata`` beside the ``.distcp`` files."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


def is_torch_file(path: str) -> bool:
    """A torch.save file: a zip archive (torch >= 1.6) or a legacy pickle (protocol 2 magic)."""
    if not os.path.isfile(path):  # never open a FIFO or a device to sniff it
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head == b"PK\x03\x04" or head[:2] == b"\x80\x02"


def is_optimizer_state(obj: Any) -> bool:
    return (isinstance(obj, dict) and isinstance(obj.get("state"), dict)
            and isinstance(obj.get("param_groups"), list))


@dataclass
class Found:
    path: tuple  # keys from the root to the optimizer state dict
    state_dict: dict


def groups_by_param(state_dict: dict, where: str) -> dict:
    """{parameter id: its param group} of an optimizer state dict (groups that are not dicts with a ``params``
    list are the planner's to refuse); InputError for an id that cannot key a state dict (a list, a dict)."""
    out = {}
    for i, g in enumerate(state_dict["param_groups"]):
        if not isinstance(g, dict) or not isinstance(g.get("params"), (list, tuple)):
            continue
        for pid in g["params"]:
            try:
                out[pid] = g
            except TypeError:
                raise InputError(f"optimizer at {where}: param group {i} lists a parameter id that is a "
                                 f"{type(pid).__name__} ({str(pid)[:40]}), not a number or a name; the state dict is "
                                 "damaged") from None
    return out


def find_optimizers(obj: Any, key: str | None = None) -> list[Found]:
    """Optimizer state dicts in ``obj``: found by shape (``state`` + ``param_groups``), or at the
    '/'-separated key path ``key``."""
    if key is not None:
        node, path = obj, ()
        for part in [p for p in key.split("/") if p]:
            node, k = _step(node, part, key)
            path += (k,)
        if not is_optimizer_state(node):
            raise UsageError(f"key path {key!r} does not hold an optimizer state dict (state + param_groups)")
        return [Found(path, node)]
    return list(_walk(obj, ()))


def _step(node: Any, part: str, key: str):
    if isinstance(node, dict):
        for k in node:
            if str(k) == part:
                return node[k], k
    elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
        return node[int(part)], int(part)
    raise UsageError(f"key path {key!r}: no entry {part!r}; run `ckptq info` to see the structure")


def _walk(obj: Any, path: tuple) -> Iterator[Found]:
    if is_optimizer_state(obj):
        yield Found(path, obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, path + (i,))


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(k)
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)


def shared_storages(obj: Any) -> set:
    """Keys of storages used by more than one tensor in ``obj``."""
    seen, shared = set(), set()
    for t in iter_tensors(obj):
        k = storage_key(t)
        (shared if k in seen else seen).add(k)
    return shared
