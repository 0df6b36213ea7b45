"""The checkout's tools (tools/scripts/, tools/bench/) loaded by their path: they are scripts, not a package,
and putting their folders on ``sys.path`` would let their names hide installed modules."""

import importlib.util
import sys
from types import ModuleType

from tests.helpers.paths import ROOT


def load_tool(folder: str, name: str) -> ModuleType:
    """tools/``folder``/``name``.py as a fresh module (e.g. ``load_tool("scripts", "make_checkpoint")``)."""
    spec = importlib.util.spec_from_file_location(f"_ckptq_tool_{name}", ROOT / "tools" / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module
