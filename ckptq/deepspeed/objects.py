"""DeepSpeed's objects inside its checkpoint files, read and written back without DeepSpeed.

A ZeRO optimizer file (``zero_pp_rank_R_mp_rank_00_optim_states.pt``) pickles a few DeepSpeed objects
beside its tensors: the ``LossScaler``, the ``ZeroStageEnum``, one ``fragment_address`` per parameter
slice. ``torch.load(weights_only=True)`` refuses them, and ckptq never runs arbitrary unpickling. Here
each ``deepspeed.*`` global is read through a stand-in class (``torch.serialization.safe_globals``) that
only records what the pickle handed it (constructor arguments, then the state of ``BUILD``); no DeepSpeed
code runs and DeepSpeed need not be installed. ``to_plain`` turns the stand-ins into plain dicts that the
safetensors format stores; ``from_plain`` turns them back, and :class:`Pickler` writes them out as the
same global, arguments and state, so DeepSpeed's own ``torch.load`` rebuilds its original objects.
Globals outside ``deepspeed.`` keep torch's ``weights_only`` refusal.
"""

from __future__ import annotations

import collections
import copyreg
import functools
import pickle
from typing import Any

import torch

from ..codec import checkpoint
from ..errors import InputError

MARK = "__deepspeed_object__"  # the key of a plain dict that stands for a DeepSpeed object
_NOT_BUILT = object()


class _Standin:
    """An instance of a DeepSpeed class as its pickle describes it. ``_ckptq_global`` (on the class) is
    the dotted name the pickle used."""

    _ckptq_global = ""

    def __new__(cls, *args):
        obj = super().__new__(cls)
        obj._args, obj._state, obj._called = args, _NOT_BUILT, False  # NEWOBJ: cls.__new__(cls, *args)
        return obj

    def __init__(self, *args):
        self._called = True  # REDUCE: cls(*args)

    def __setstate__(self, state):
        self._state = state

    def __reduce_ex__(self, protocol):
        state = None if self._state is _NOT_BUILT else self._state
        if self._called:
            return (type(self), self._args, state)
        return (copyreg.__newobj__, (type(self), *self._args), state)

    def __repr__(self) -> str:
        return f"<{self._ckptq_global} {self._args or ''}{'' if self._state is _NOT_BUILT else self._state}>"


@functools.cache
def _standin(name: str) -> type:
    """One stand-in class per DeepSpeed global name."""
    return type(name.rpartition(".")[2], (_Standin,), {"_ckptq_global": name})


def load(path: str) -> Any:
    """``torch.load(weights_only=True)`` of ``path``, with every ``deepspeed.*`` global read into a stand-in."""
    names = []
    if checkpoint.is_torch_file(path):
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # unreadable: load_torch below says so in one line
            names = []
    foreign = [n for n in names if not n.startswith("deepspeed.")]
    if foreign:
        raise InputError(f"{path} needs arbitrary unpickling of {', '.join(foreign[:5])}, which ckptq refuses "
                         "(only DeepSpeed's own objects are read, as data); re-save it without them")
    try:
        with torch.serialization.safe_globals([(_standin(n), n) for n in names]):
            return checkpoint.load_torch(path)
    except InputError as e:
        raise InputError(f"DeepSpeed ZeRO checkpoint: {e}") from None


def stage_of(obj: Any) -> int | None:
    """The value of a ``ZeroStageEnum`` stand-in (or a plain int)."""
    if isinstance(obj, _Standin) and len(obj._args) == 1 and isinstance(obj._args[0], int):
        return obj._args[0]
    if isinstance(obj, dict) and obj.get(MARK) and len(obj.get("args", ())) == 1:
        return obj["args"][0]
    return obj if isinstance(obj, int) else None


def fields_of(obj: Any) -> dict:
    """The recorded ``BUILD`` state of a stand-in (e.g. a ``fragment_address``'s numel and start)."""
    if isinstance(obj, _Standin) and isinstance(obj._state, dict):
        return obj._state
    return {}


def to_plain(obj: Any) -> Any:
    """The same tree with each stand-in a plain dict {MARK: name, "called", "args", "state"}."""
    if isinstance(obj, _Standin):
        state = None if obj._state is _NOT_BUILT else to_plain(obj._state)
        return {MARK: obj._ckptq_global, "called": obj._called, "args": [to_plain(a) for a in obj._args],
                "built": obj._state is not _NOT_BUILT, "state": state}
    return _map(obj, to_plain)


def from_plain(obj: Any) -> Any:
    """The inverse of ``to_plain``: plain dicts marked as DeepSpeed objects become stand-ins again."""
    if isinstance(obj, dict) and isinstance(obj.get(MARK), str) and obj[MARK].startswith("deepspeed."):
        cls = _standin(obj[MARK])
        s = cls.__new__(cls, *[from_plain(a) for a in obj.get("args", [])])
        s._called = bool(obj.get("called"))
        if obj.get("built"):
            s._state = from_plain(obj.get("state"))
        return s
    return _map(obj, from_plain)


def _map(obj: Any, fn) -> Any:
    """``fn`` applied to the items of a plain container (subclasses such as ``torch.Size`` stay as they are)."""
    if type(obj) in (dict, collections.OrderedDict):
        out = type(obj)()
        out.update((k, fn(v)) for k, v in obj.items())
        return out
    if type(obj) in (list, tuple):
        return type(obj)(fn(v) for v in obj)
    return obj


class Pickler(pickle._Pickler):
    """Python's pickler, writing each stand-in class as the DeepSpeed global it stands for (the C pickler
    would import DeepSpeed to check the name)."""

    def save_global(self, obj, name=None):
        ref = getattr(obj, "_ckptq_global", "") if isinstance(obj, type) and issubclass(obj, _Standin) else ""
        if not ref:
            return super().save_global(obj, name)
        module, _, qualname = ref.rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode("utf-8"))
        self.memoize(obj)
