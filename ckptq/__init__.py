"""ckptq: blockwise 8-bit optimizer state for PyTorch checkpoints.

    import ckptq
    report = ckptq.convert("ckpt.pt")                 # -> ckpt.q8.safetensors
    ckpt = ckptq.load("ckpt.q8.safetensors")          # quantized states stay quantized
    ckptq.save(ckpt, "copy.q8.safetensors")
    ckptq.expand("ckpt.q8.safetensors", "ckpt_fp32.pt")
    opt = ckptq.optim.AdamW8bit(model.parameters())
    print(ckptq.estimate("7B", world_size=8, zero_stage=3).text())   # memory per device, checkpoint size

Everything is imported on first use (PEP 562), so ``import ckptq`` and ``ckptq --help`` do not import
torch; ``ckptq.optim``, ``ckptq.dcp`` and ``ckptq.integrations`` are there without importing them first.
"""

import importlib
import sys

__version__ = "0.1.0"

_FUNCTIONS = {"convert": "ckptq.sources.api", "expand": "ckptq.sources.api", "info": "ckptq.sources.api",
              "load": "ckptq.sources.api", "save": "ckptq.sources.api", "estimate": "ckptq.footprint.memory",
              "CkptqError": "ckptq.errors"}
_SUBPACKAGES = ("optim", "dcp", "integrations", "codec", "format", "sources", "deepspeed", "footprint", "kernels")
__all__ = ["convert", "expand", "info", "load", "save", "estimate", "CkptqError", "__version__", "optim", "dcp",
           "integrations"]


def __getattr__(name: str):
    if name in _FUNCTIONS:
        value = getattr(importlib.import_module(_FUNCTIONS[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"ckptq.{name}")
    else:
        raise AttributeError(f"module 'ckptq' has no attribute {name!r}")
    globals()[name] = value
    return value


def lazy_attributes(package: str, names: dict, renamed: dict | None = None):
    """A PEP 562 ``__getattr__`` for ``package``: ``names`` maps each public name to the submodule that
    defines it, imported on first use and the value kept on the package; ``renamed`` maps old names, kept for
    a release, to their new names: each serves the new name's value and warns once (``ckptq._deprecated``)."""

    def __getattr__(name: str):
        if renamed and name in renamed:
            from ._deprecated import warn

            warn(f"{package}.{name}", f"{package}.{renamed[name]}")
            return __getattr__(renamed[name])
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{names[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


def __dir__():
    return sorted(set(globals()) | set(__all__))
