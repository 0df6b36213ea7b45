"""ckptq's low-bit optimizers: one engine (``engine``: state, step plans, state dicts, validation) and one file
per optimizer, each keeping its torch counterpart's arguments and state keys and resuming from ``ckptq``
checkpoints: Adam/AdamW (``adam``), SGD (``sgd``), Lion (``lion``), Muon (``muon``), RMSprop (``rmsprop``),
Adagrad (``adagrad``), NAdam (``nadam``), RAdam (``radam``), AdEMAMix (``ademamix``). Every public
``LowBitOptimizer`` class of the package's modules is exported here, so a new optimizer's file needs no entry
(docs/optimizers.md, "Adding an optimizer")."""

import importlib
import inspect
import pkgutil

from ..errors import StateMismatchError
from .engine import LowBitOptimizer
from .state_io import expand_on_load, to_torch_state_dict


def _optimizers() -> dict:
    found = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, LowBitOptimizer) and obj is not LowBitOptimizer \
                    and obj.__module__ == module.__name__ and not name.startswith("_"):
                found[name] = obj
    return dict(sorted(found.items()))


globals().update(_optimizers())
__all__ = [*_optimizers(), "LowBitOptimizer", "StateMismatchError", "expand_on_load", "to_torch_state_dict"]
