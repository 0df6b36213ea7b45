"""Which backend implements which grouped operation, declared in one table (after bitsandbytes' ``_ops.py``,
which declares each op once, and its ``backends/<device>/ops.py``, which register kernels for it).

Each entry names the function and the check that says whether it can take a call (a rule it implements,
dtypes it reads, codebooks with a code table...); where the chosen backend cannot, the PyTorch reference
takes the call, with the same bits. Modules are imported when first used: Triton only on its path.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

OPERATIONS = ("step", "dense")  # contract.Group, contract.Dense
BACKENDS = ("torch", "native", "triton")

# backend -> the module of its per-tensor operations (quantize, dequantize; adam_step and momentum_step, the
# older per-parameter steps, where it has them: "momentum_torch" is the reference's momentum_step)
_MODULES = {"torch": "backend_torch", "native": "backend_native", "triton": "backend_triton",
            "momentum_torch": "momentum_torch"}


def backend(name: str):
    """The module of ``name``'s per-tensor operations (``_MODULES``), imported on first use."""
    return _module(_MODULES[name])


@functools.cache
def _module(name: str):
    """This package's module ``name``, imported once: per-tensor calls ask for it several times each, and a
    cached module object costs a dict lookup where ``import_module`` takes the import lock."""
    return importlib.import_module(f"{__package__}.{name}")


# (operation, backend) -> (module, function, accepts): accepts(group) -> bool, or None for "every call"
_TABLE = {
    ("step", "torch"): ("step_torch", "step_group", None),
    ("dense", "torch"): ("step_torch", "dense_group", None),
    ("step", "native"): ("backend_native", "step", "accepts_step"),
    ("dense", "native"): ("backend_native", "dense", "accepts_dense"),
    ("step", "triton"): ("triton_group", "step", "accepts_step"),
    ("dense", "triton"): ("triton_group", "dense", "accepts_dense"),
}


def _resolve(module: str, name: str | None) -> Callable | None:
    return None if name is None else getattr(_module(module), name)  # read each call: tests patch functions


def implementation(operation: str, backend: str, group) -> Callable:
    """The function of ``backend`` that runs ``operation`` on ``group``, or the reference's where that backend
    has none or cannot take this group."""
    if (operation, backend) in _TABLE:
        module, name, accepts = _TABLE[(operation, backend)]
        check = _resolve(module, accepts)
        if check is None or check(group):
            return _resolve(module, name)
    module, name, _ = _TABLE[(operation, "torch")]
    return _resolve(module, name)
