"""Every pointer a reader follows resolves: each ``ckptq.x.y`` named in the package's docstrings and
comments, in kernels/, tools/, docs/ and README.md names a module or attribute that exists, and each path
such as ``ckptq/optim/plan.py`` names a file of the checkout. The metadata keys of the file format
(``ckptq.version``, ``ckptq.tensors``... of docs/FORMAT.md) are names in a file's header, not pointers."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from tests.helpers.paths import ROOT
FORMAT_KEYS = {"ckptq.format", "ckptq.version", "ckptq.skeleton", "ckptq.info", "ckptq.tensors",
               "ckptq.header_crc32", "ckptq.shards", "ckptq.shard"}
DOTTED = re.compile(r"`{1,2}(ckptq(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
PATH = re.compile(r"\b((?:ckptq|kernels|tools|tests|docs)/(?:[a-z0-9_-]+/)*[a-z0-9_-]+\.(?:py|md|c|h|sh))\b")


def _sources() -> list[Path]:
    """The pages and code a reader follows; docs/notes/ is history, its paths as they were then."""
    found = [ROOT / "README.md", *(p for p in (ROOT / "docs").rglob("*.md") if "notes" not in p.parts)]
    for folder in ("ckptq", "kernels", "tools"):
        found += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".c", ".h", ".sh", ".md")]
    return found


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            if hasattr(obj, part):
                obj = getattr(obj, part)
            elif hasattr(obj, "__path__"):  # a package's submodule not imported yet
                try:
                    obj = importlib.import_module(f"{obj.__name__}.{part}")
                except ImportError:
                    return False
            else:
                return False
        return True
    return False


def _pointers(pattern: re.Pattern) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in _sources():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in pattern.finditer(line):
                out.setdefault(m.group(1), []).append(f"{path.relative_to(ROOT)}:{n}")
    return out


def test_every_dotted_pointer_names_a_module_or_attribute():
    pointers = _pointers(DOTTED)
    assert len(pointers) > 40  # the scan sees the pointers (a broken pattern would pass vacuously)
    dead = {k: v for k, v in pointers.items() if k not in FORMAT_KEYS and not _resolves(k)}
    assert not dead, dead


def test_every_path_pointer_names_a_file():
    pointers = _pointers(PATH)
    assert len(pointers) > 20
    dead = {k: v for k, v in pointers.items() if not (ROOT / k).exists()}
    assert not dead, dead
