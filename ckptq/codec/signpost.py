"""Signposts: what a stock framework finds where ckptq moved an optimizer's state, so that resuming
without ckptq stops with a message naming the fix instead of starting a fresh optimizer.

A stock Hugging Face ``Trainer`` loads ``checkpoint-N/optimizer.pt`` and, finding none, silently starts
a new optimizer and scheduler; stock Lightning loads ``optimizer_states`` from the ``.ckpt``. Nothing in
either runs ckptq's code, and nothing may run code at load (``torch.load(weights_only=True)``), so the
signpost is data: a state dict that ``torch.optim.Optimizer.load_state_dict`` takes and the optimizer
then rejects::

    {"ckptq_signpost": MESSAGE,                            # for people and tools that open the file
     "state": {first_param_id: {"step": MESSAGE as bytes}},
     "param_groups": [the optimizer's own param groups]}

torch's Adam family (Adam, AdamW, NAdam, RAdam, Adamax...) converts a non-tensor ``step`` with
``float()`` as it loads, so the stock resume stops there with ``ValueError: could not convert string
to float: b'MESSAGE'``. Bytes, not a string: ``load_state_dict`` rebuilds every iterable in a state
(a string comes out as a generator's repr), bytes come out as they went in. An optimizer that does not
look at ``step`` while loading (torchao's) stops at its first step (``TypeError: can't concat int to
bytes``) before it changes a parameter. The param groups are the real ones so that the group checks
before that pass.

A signpost may *carry* the state it stands for (``ckptq_state``: the state dict, its moments 8-bit):
what a file that keeps weights and optimizer together holds once converted in place (a Lightning or
Fabric ``.ckpt``, litgpt's ``lit_model.pth``: ``ckptq convert FILE --replace``), so that it keeps the name
the framework's resume looks for. ckptq's readers and integrations put the carried state back
(``unwrapped``); a stock framework stops at the signpost. Lightning files of ``CkptqCheckpointIO`` keep
the real states under ``ckptq_optimizer_states`` instead, put back under ``optimizer_states`` by the
same ``unwrap``, which is what ``ckptq expand`` must do to give a checkpoint that stock Lightning
resumes. This module imports torch only, so that ``ckptq.sources`` can use it; the messages of every
signpost ckptq writes are here, so that each names the same fixes.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import InputError

SIGNPOST_KEY = "ckptq_signpost"
CARRIED = "ckptq_state"  # a signpost's own copy of the state it stands for (a file converted in place)
LIGHTNING_STATES = "ckptq_optimizer_states"  # [None or the optimizer's state dict as ckptq stores it]
LIGHTNING_TORCHAO = "ckptq_torchao_optimizers"  # indices of optimizers whose states are torchao's
_MAX_BYTES = 16 << 20  # a signpost holds param groups only; a larger file is the real state, left unread


def make(state_dict: dict, message: str, carried: dict | None = None) -> dict:
    """The signpost standing in for ``state_dict`` (an optimizer state dict): its param groups, and
    ``message`` as the ``step`` of its first parameter that has state (no state at all: nothing is lost
    by a fresh optimizer, and the signpost holds none); ``carried``: the state it stands for, kept inside."""
    first = next((pid for g in state_dict["param_groups"] for pid in g["params"] if pid in state_dict["state"]), None)
    state = {} if first is None else {first: {"step": message.encode()}}
    out = {SIGNPOST_KEY: message, "state": state, "param_groups": state_dict["param_groups"]}
    return out if carried is None else {**out, CARRIED: carried}


def is_signpost(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get(SIGNPOST_KEY), str)


def is_signpost_file(path: str) -> bool:
    """Whether ``path`` is a torch.save file holding a signpost that holds no state (``optimizer.pt`` beside a
    ckptq file); one carrying its state is optimizer state (``optimizer.bin`` under accelerate's
    ``low_bit_checkpoints``)."""
    try:
        if os.path.getsize(path) > _MAX_BYTES:
            return False
        obj = torch.load(path, map_location="cpu", weights_only=True)
        return is_signpost(obj) and not carries(obj)
    except Exception:  # not a torch.save file, damaged, or holding other objects: not a signpost
        return False


def carries(obj: Any) -> bool:
    """A signpost holding the state it stands for (a file converted in place)."""
    return is_signpost(obj) and isinstance(obj.get(CARRIED), dict)


def unwrapped(obj: Any) -> tuple[Any, int]:
    """``(obj, n)``: ``obj`` with every state ckptq moved aside put back in place (carried by a signpost
    anywhere inside, or under Lightning's ``ckptq_optimizer_states``), ``n`` how many; in place, except
    that a carrying signpost at the root is returned as the state it carries."""
    if carries(obj):
        return obj[CARRIED], 1
    n = unwrap(obj)
    for container in _containers(obj):
        keys = container.keys() if isinstance(container, dict) else range(len(container))
        for k in list(keys):
            if carries(container[k]):
                container[k] = container[k][CARRIED]
                n += 1
    return obj, n


def _containers(obj: Any):
    """Every dict and list inside ``obj`` (itself included), each once."""
    stack, seen = [obj], set()
    while stack:
        node = stack.pop()
        if isinstance(node, (dict, list)) and id(node) not in seen:
            seen.add(id(node))
            yield node
            stack.extend(node.values() if isinstance(node, dict) else node)


def unwrap(checkpoint: dict) -> int:
    """Lightning: put the states stored under ``ckptq_optimizer_states`` back in place of their signposts
    in ``optimizer_states``, in place, and drop ckptq's keys; returns how many. 0 for anything else."""
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get(LIGHTNING_STATES), list):
        return 0
    slots = checkpoint.get("optimizer_states")
    if not isinstance(slots, list) or len(slots) != len(checkpoint[LIGHTNING_STATES]):
        raise InputError(f"the checkpoint holds {LIGHTNING_STATES} ({len(checkpoint[LIGHTNING_STATES])} states) but no "
                         "optimizer_states list of the same length beside it, as ckptq writes them; it is damaged")
    stored = checkpoint.pop(LIGHTNING_STATES)
    checkpoint.pop(LIGHTNING_TORCHAO, None)
    n = 0
    for i, state_dict in enumerate(stored):
        if state_dict is not None:
            checkpoint["optimizer_states"][i] = state_dict
            n += 1
    return n


def carrying(obj: Any, message: str, is_stored) -> int:
    """Replace, in place, each optimizer state dict inside ``obj`` for which ``is_stored(state_dict)`` holds
    (its moments are low-bit) by a signpost carrying it, the signpost saying ``message``; returns how many.
    A root that is such a state dict is left to the caller (``make(obj, message, obj)``)."""
    n = 0
    for container in list(_containers(obj)):
        keys = container.keys() if isinstance(container, dict) else range(len(container))
        for k in list(keys):
            value = container[k]
            if _is_state_dict(value) and not is_signpost(value) and is_stored(value):
                container[k] = make(value, message, value)
                n += 1
    return n


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("state"), dict) and isinstance(obj.get("param_groups"), list)


# The messages: each names what happened and both ways on.

def trainer_message(folder: str, stored: str) -> str:
    """``optimizer.pt`` of a Trainer ``checkpoint-N`` whose state is in ``stored`` (``optimizer.q8.safetensors``)."""
    return (f"ckptq: the optimizer state of {folder} is in {stored} (ckptq format); this optimizer.pt is a "
            "signpost that keeps a stock Trainer from starting a fresh optimizer. Resume with "
            f"ckptq.integrations.transformers.CkptqTrainer, or run `ckptq expand {folder}` to write the fp32 "
            "optimizer.pt that a stock Trainer reads")


def accelerate_message(folder: str, name: str, stored: str) -> str:
    """``optimizer.bin`` (``name``) of an accelerate ``save_state`` folder whose state is in ``stored``."""
    return (f"ckptq: the optimizer state of {folder} is in {stored} (ckptq format); this {name} is a signpost "
            "that stops Accelerator.load_state from resuming without it. Run `ckptq expand "
            f"{folder} --replace` to write the fp32 {name} that load_state reads")


def fabric_message(key: str, name: str, bits: int = 8) -> str:
    """The optimizer state under ``key`` of a file that Fabric saved through ``CkptqCheckpointIO(bits=bits)``."""
    return (f"ckptq: the optimizer state under {key} in {name} is stored {bits}-bit by ckptq; load it with "
            "Fabric(plugins=[ckptq.integrations.lightning.CkptqCheckpointIO()]), or run "
            f"`ckptq expand {name} --replace` for a file that stock Fabric resumes")


def in_place_message(name: str) -> str:
    """An optimizer state of a Lightning / Fabric / litgpt file converted in place (``name``)."""
    return (f"ckptq: the optimizer state in {name} is stored 8-bit by ckptq (converted in place); resume with "
            "plugins=[ckptq.integrations.lightning.CkptqCheckpointIO()] (Lightning Trainer or Fabric), or run "
            f"`ckptq expand {name} --replace` for a file that stock Lightning, Fabric or litgpt resumes")


# A DCP folder's signpost: torch's FileSystemReader (and OLMo-core's, accelerate's FSDP loading through it)
# unpickles ``.metadata`` fully, so a signpost folder's ``.metadata`` is a pickle of one call that stops with
# the message, ``int(MESSAGE)``: ``ValueError: invalid literal for int() with base 10: 'ckptq: ...'``. No code
# of ckptq's runs there and no data is read; ckptq itself never unpickles it (``is_signpost_folder`` first).
#
# A folder is a signpost only while it holds exactly what ckptq wrote into it: its marker lists the files
# (``.metadata``, its size and SHA-256), and nothing was added, removed or changed since. Only then may ckptq
# replace it without --force (``expand`` writing the folder back). A folder that ``dcp.save`` wrote into
# afterwards (accelerate saving into ``optimizer_0/`` again keeps the old ``.ckptq``), or any folder whose
# marker merely says "signpost", is not one, and is never removed. Markers written before the list (by earlier
# versions): recognised only if the folder holds nothing but ``.metadata`` and the marker, and ``.metadata`` holds
# byte for byte the pickle ckptq writes for the marker's message (which decides every byte of it).
FOLDER_MARKER = ".ckptq"  # as in every folder ckptq writes (ckptq.dcp.writer.MARKER), here with kind "signpost"
_METADATA = ".metadata"


class _Stop:
    def __init__(self, message: str):
        self.message = message

    def __reduce__(self):
        return int, (self.message,)


def _pickled(message: str) -> bytes:
    import pickle

    return pickle.dumps(_Stop(message), protocol=2)


def write_folder(path: str, message: str) -> None:
    """A new folder ``path`` (it must not exist) holding a DCP signpost saying ``message``."""
    os.mkdir(path)
    _fill(path, message)


def _fill(path: str, message: str) -> None:
    """An empty folder made a signpost: ``.metadata``, then the marker listing it."""
    import hashlib
    import json

    data = _pickled(message)
    with open(os.path.join(path, _METADATA), "wb") as f:
        f.write(data)
    marker = {"created_by": "ckptq", "kind": "signpost", "message": message, "files": {_METADATA: len(data)},
              "sha256": {_METADATA: hashlib.sha256(data).hexdigest()}}
    with open(os.path.join(path, FOLDER_MARKER), "w") as f:
        json.dump(marker, f)


def folder_beside(path: str, stored: str) -> str:
    """A DCP signpost folder for ``path`` (whose state went to the folder ``stored``), written under a temp name
    beside it (journaled: a killed run's is removed by the next), to take its name once it goes
    (``Original.remove``'s stand-in)."""
    import tempfile

    from ..format import journal

    parent, name = os.path.split(os.path.abspath(path.rstrip("/")))
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{name}{journal.TMP_MARK}signpost-")
    journal.JOURNAL.add(tmp)
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        _fill(tmp, dcp_message(name, os.path.basename(stored.rstrip("/"))))
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def is_signpost_folder(path: str) -> bool:
    return folder_message(path) is not None


def folder_message(path: str) -> str | None:
    """The message of the DCP signpost folder ``path``; None for any other path, a folder whose marker says
    "signpost" but that holds anything else than what ckptq wrote there included."""
    found = _marker(path)
    return found["message"] if found is not None and _holds_only_what_ckptq_wrote(path, found) is None else None


def not_a_signpost(path: str) -> str | None:
    """Why the folder ``path``, whose ``.ckptq`` marker says it is a signpost, is not one (what is in it that
    ckptq did not write there); None if it is one, or has no signpost marker."""
    found = _marker(path)
    return None if found is None else _holds_only_what_ckptq_wrote(path, found)


def _marker(path: str) -> dict | None:
    """A folder's signpost marker (JSON with kind "signpost" and a message), read without following links."""
    import json

    marker = os.path.join(path, FOLDER_MARKER)
    if os.path.islink(path) or not os.path.isdir(path) or os.path.islink(marker) or not os.path.isfile(marker):
        return None
    try:
        if os.path.getsize(marker) >= 65536:
            return None
        with open(marker) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    ok = isinstance(found, dict) and found.get("kind") == "signpost" and isinstance(found.get("message"), str)
    return found if ok else None


def _holds_only_what_ckptq_wrote(path: str, marker: dict) -> str | None:
    """None if the folder holds exactly the marker and the ``.metadata`` ckptq wrote; else what differs."""
    import hashlib

    try:
        entries = {e.name: e for e in os.scandir(path)}
    except OSError as e:
        return f"it cannot be listed ({e.strerror})"
    others = sorted(set(entries) - {FOLDER_MARKER, _METADATA})
    if others:
        return f"it also holds {', '.join(others[:3])}{' ...' if len(others) > 3 else ''}"
    meta = entries.get(_METADATA)
    if meta is None or not meta.is_file(follow_symlinks=False):
        return f"its {_METADATA} is missing or not a regular file"
    if meta.stat(follow_symlinks=False).st_size > 65536:
        return f"its {_METADATA} is not the one ckptq wrote"
    with open(meta.path, "rb") as f:
        data = f.read()
    if "files" not in marker:  # an older signpost: .metadata is what ckptq writes for the message, byte for byte
        same = data == _pickled(marker["message"])
    else:
        same = marker.get("files") == {_METADATA: len(data)} and \
            marker.get("sha256") == {_METADATA: hashlib.sha256(data).hexdigest()}
    return None if same else f"its {_METADATA} is not the one ckptq wrote"


def dcp_message(name: str, stored: str) -> str:
    """The DCP folder ``name`` (accelerate's ``optimizer_0``, OLMo-core's ``model_and_optim``, a ``step-N``)
    whose state went to the folder ``stored``; short, as ``int()`` cuts its message at 200 characters."""
    return f"ckptq: {name} went to {stored} (8-bit Adam state); for fp32: ckptq expand {stored} -o {name}"
