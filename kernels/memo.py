"""Per-tensor memos: what the step derives from a codebook (its midpoints, code tables, padded decode
maps) computed once per codebook tensor instead of at every step of every parameter.

An entry belongs to one tensor object, as long as it lives and is not modified in place (its
``_version``); nothing is read back from the device to key it, so no GPU synchronization either.
"""

from __future__ import annotations

import weakref
from typing import Callable, TypeVar

import torch

T = TypeVar("T")
_MAX_ENTRIES = 4096  # stale entries (tensors gone) are dropped all at once beyond this
_memos: dict[tuple[int, int], tuple[weakref.ref, int, object]] = {}


def by_tensor(fn: Callable[[torch.Tensor], T], t: torch.Tensor) -> T:
    """``fn(t)``, computed once for this tensor object and version. A result that is ``t`` itself is not
    kept: there is nothing to save, and the entry would keep its own key alive."""
    key = (id(fn), id(t))
    hit = _memos.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    value = fn(t)
    if value is t:
        return value
    if len(_memos) >= _MAX_ENTRIES:
        _memos.clear()
    _memos[key] = (weakref.ref(t), t._version, value)
    return value
