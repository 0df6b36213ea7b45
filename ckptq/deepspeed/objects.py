"""DeepSpeed's objects inside its checkpoint files, read and written back without DeepSpeed.

A ZeRO optimizer file (``zero_pp_rank_R_mp_rank_00_optim_states.pt``) pickles a few DeepSpeed objects
beside its tensors: the ``LossScaler``, the ``ZeroStageEnum``, one ``fragment_address`` per parameter
slice. ``torch.load(weights_only=True)`` refuses them, and ckptq never runs arbitrary unpickling. Here
each ``deepspeed.*`` global is read through a stand-in class (``torch.serialization.safe_globals``) that
only records what the pickle handed it (constructor arguments, then the state of ``BUILD``); no DeepSpeed
code runs and DeepSpeed need not be installed. ``to_plain`` turns the stand-ins into plain dicts that the
safetensors format stores; ``from_plain`` turns them back, and :class:`Pickler` writes them out as the
same global, arguments and state, so DeepSpeed's own ``torch.load`` rebuilds its original objects.

DeepSpeed loads its files with full unpickling, so whatever :class:`Pickler` writes runs there: only the
globals DeepSpeed itself writes (``DEEPSPEED_GLOBALS``, names matched exactly) are read as stand-ins, with
arguments and state of plain types only (``_plain``); every other global keeps torch's ``weights_only``
refusal. The same checks run again on a converted file's objects (``from_plain``), and the pickler writes
no global that is neither on that list nor one ``torch.load(weights_only=True)`` admits.
"""

from __future__ import annotations

import collections
import copyreg
import functools
import pickle
import re
from typing import Any

import torch

from ..codec import checkpoint
from ..errors import FormatError, InputError
from ..format import files, torch_stream

MARK = "__deepspeed_object__"  # the key of a plain dict that stands for a DeepSpeed object
_NOT_BUILT = object()

# The globals DeepSpeed pickles into its checkpoints: ``state_dict()`` of runtime/zero/stage_1_and_2.py,
# stage3.py and bf16_optimizer.py (DeepSpeed master, 2026-08) holds the loss scaler (static or dynamic,
# runtime/fp16/loss_scaler.py), ``zero_stage`` and one fragment_address per parameter slice
# (``param_slice_mappings``); the fixtures (DeepSpeed 0.19.8) hold three of them.
DEEPSPEED_GLOBALS = frozenset({
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
})
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")


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
    """``torch.load(weights_only=True)`` of ``path``, with each DeepSpeed global on the list read into a
    stand-in; InputError for any other global, for stand-ins holding anything but plain values, and for
    containers nested too deep for the walks that follow."""
    names = []
    if checkpoint.is_torch_file(path):
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # unreadable: load_torch below says so in one line
            names = []
    foreign = [n for n in names if n not in DEEPSPEED_GLOBALS]
    if foreign:
        shown = (n[:120] if n.isprintable() else repr(n[:120]) for n in foreign[:5])
        raise InputError(f"{path} needs arbitrary unpickling of {', '.join(shown)}, which "
                         "ckptq refuses (only DeepSpeed's own objects are read, as data); re-save it without them")
    try:
        with torch.serialization.safe_globals([(_standin(n), n) for n in names]):
            obj = checkpoint.load_torch(path)
    except InputError as e:
        raise InputError(f"DeepSpeed ZeRO checkpoint: {e}") from None
    files.check_nesting(obj, path, inner=lambda n: (*n._args, n._state) if isinstance(n, _Standin) else None)
    bad = _impure(obj)
    if bad:
        raise InputError(f"{path}: {bad}; DeepSpeed writes only plain values there, ckptq refuses it")
    return obj


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.Tensor, torch_stream.LazyTensor)  # lazy: expand


def _plain(value: Any) -> bool:
    """Numbers, strings, bools, None, dtypes, tensors, and lists, tuples and dicts (keys str or int) of them."""
    if type(value) in (list, tuple):
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) in (str, int) and _plain(v) for k, v in value.items())
    return isinstance(value, _PLAIN) and not isinstance(value, _Standin)


def _fields_ok(state: Any) -> bool:
    """A ``BUILD`` state: None, or attribute names (identifiers) to plain values."""
    return state is _NOT_BUILT or state is None or (
        type(state) is dict and all(isinstance(k, str) and k.isidentifier() for k in state) and _plain(state))


def _impure(obj: Any) -> str | None:
    """What is wrong with the first stand-in in ``obj`` whose arguments or state are not plain, if any."""
    if isinstance(obj, _Standin):
        if not _plain(list(obj._args)):
            return f"{obj._ckptq_global} is given arguments of other types"
        if not _fields_ok(obj._state):
            return f"{obj._ckptq_global} is given state of other types"
        return None
    if isinstance(obj, dict):
        return next((b for v in obj.values() if (b := _impure(v))), None)
    if isinstance(obj, (list, tuple)):
        return next((b for v in obj if (b := _impure(v))), None)
    return None


def stage_of(obj: Any) -> int | None:
    """The value of a ``ZeroStageEnum`` stand-in, its plain form, or a plain int; None for anything else
    (a crafted enum called with a list must not reach the report as a stage)."""
    if isinstance(obj, _Standin) and len(obj._args) == 1:
        obj = obj._args[0]
    elif isinstance(obj, dict) and obj.get(MARK) and isinstance(obj.get("args"), list) and len(obj["args"]) == 1:
        obj = obj["args"][0]
    return obj if type(obj) is int else None


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
    """The inverse of ``to_plain``: plain dicts marked as DeepSpeed objects become stand-ins again, each
    checked as ``load`` checks them (FormatError: a converted file naming anything else is crafted)."""
    if isinstance(obj, dict) and MARK in obj:
        name, args, state = obj[MARK], obj.get("args", []), obj.get("state")
        if not (isinstance(name, str) and name in DEEPSPEED_GLOBALS):
            raise FormatError(f"the file names DeepSpeed object {str(name)[:80]!r}, which is not one DeepSpeed "
                              "writes; ckptq will not write it (the file is crafted or damaged)")
        if not (isinstance(obj.get("called"), bool) and isinstance(obj.get("built"), bool) and type(args) is list
                and _plain(args) and _fields_ok(state if obj["built"] else None)):
            raise FormatError(f"the file's {name} holds arguments or state of other types than DeepSpeed writes "
                              "(the file is crafted or damaged)")
        cls = _standin(name)
        s = cls.__new__(cls, *args)
        s._called = obj["called"]
        if obj["built"]:
            s._state = state
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
    would import DeepSpeed to check the name). It writes no other global than those on
    ``DEEPSPEED_GLOBALS`` and those ``torch.load(weights_only=True)`` admits (tensors, dtypes, containers):
    the file is read back by DeepSpeed's full unpickling."""

    def save_global(self, obj, name=None):
        standin = isinstance(obj, type) and issubclass(obj, _Standin)
        ref = obj._ckptq_global if standin else _written_name(obj, name)
        allowed = DEEPSPEED_GLOBALS if standin else _torch_globals()
        if not (isinstance(ref, str) and _NAME.fullmatch(ref) and ref in allowed):
            raise FormatError(f"refusing to write the global {ref!r:.100}: not one DeepSpeed or torch writes "
                              "into a checkpoint (the input is crafted or damaged)")
        if not standin:
            return super().save_global(obj, name)
        module, _, qualname = ref.rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode("utf-8"))
        self.memoize(obj)


def _written_name(obj, name) -> str:
    """The dotted name ``pickle`` writes for ``obj`` (what ``save_global`` looks up)."""
    name = name or getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "")
    return f"{pickle.whichmodule(obj, name)}.{name}"


@functools.cache
def _torch_globals() -> frozenset:
    from torch import _weights_only_unpickler

    return frozenset(_weights_only_unpickler._get_allowed_globals())
