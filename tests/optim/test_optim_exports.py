"""Every optimizer class a module of ckptq.optim defines is exported by the package (the one line a new
optimizer adds beside its own file, its rules and its tests: docs/optimizers.md, "Adding an optimizer")."""

import importlib
import inspect
import pkgutil

import ckptq.optim
from ckptq.optim import LowBitOptimizer


def test_every_optimizer_class_is_exported():
    defined = set()
    for info in pkgutil.iter_modules(ckptq.optim.__path__):
        module = importlib.import_module(f"ckptq.optim.{info.name}")
        defined |= {name for name, obj in vars(module).items() if inspect.isclass(obj) and issubclass(obj, LowBitOptimizer)
                    and obj is not LowBitOptimizer and obj.__module__ == module.__name__ and not name.startswith("_")}
    assert defined <= set(ckptq.optim.__all__), sorted(defined - set(ckptq.optim.__all__))
