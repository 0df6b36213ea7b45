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

Lightning keeps the real states in the same ``.ckpt`` under ``ckptq_optimizer_states``; ``unwrap``
puts them back under ``optimizer_states``, which is what ``ckptq expand`` must do to give a
checkpoint that stock Lightning resumes. This module imports torch only, so that ``ckptq.sources``
can use it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import InputError

SIGNPOST_KEY = "ckptq_signpost"
LIGHTNING_STATES = "ckptq_optimizer_states"  # [None or the optimizer's state dict as ckptq stores it]
LIGHTNING_TORCHAO = "ckptq_torchao_optimizers"  # indices of optimizers whose states are torchao's
_MAX_BYTES = 16 << 20  # a signpost holds param groups only; a larger file is the real state, left unread


def make(state_dict: dict, message: str) -> dict:
    """The signpost standing in for ``state_dict`` (an optimizer state dict): its param groups, and
    ``message`` as the ``step`` of its first parameter that has state (no state at all: nothing is lost
    by a fresh optimizer, and the signpost holds none)."""
    first = next((pid for g in state_dict["param_groups"] for pid in g["params"] if pid in state_dict["state"]), None)
    state = {} if first is None else {first: {"step": message.encode()}}
    return {SIGNPOST_KEY: message, "state": state, "param_groups": state_dict["param_groups"]}


def is_signpost(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get(SIGNPOST_KEY), str)


def is_signpost_file(path: str) -> bool:
    """Whether ``path`` is a torch.save file holding a signpost (``optimizer.pt`` beside a ckptq file)."""
    try:
        if os.path.getsize(path) > _MAX_BYTES:
            return False
        return is_signpost(torch.load(path, map_location="cpu", weights_only=True))
    except Exception:  # not a torch.save file, damaged, or holding other objects: not a signpost
        return False


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
