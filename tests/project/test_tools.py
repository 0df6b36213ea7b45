"""tools/ is for users: every Python tool under tools/bench/ and tools/scripts/ answers ``--help`` at once (it
parses its arguments before torch or ckptq load), and no tool changes ckptq by assigning to its modules'
attributes (tools choose through public options, e.g. the optimizers' ``backend=``)."""

import ast
import pathlib
import subprocess
import sys
import time

import pytest

from tests.helpers.paths import ROOT
TOOLS = sorted(p for p in (ROOT / "tools").rglob("*.py") if 'if __name__ == "__main__"' in p.read_text())
HELP_SECONDS = 5  # generous: a tool that imports torch first takes 3 s and more on a loaded 2-core machine


def test_the_tools_are_found():
    assert {p.parent.name for p in TOOLS} == {"bench", "scripts"}
    assert not list((ROOT / "tools").glob("*.py")), "tools/ holds folders only: bench/ and scripts/"


@pytest.mark.parametrize("tool", TOOLS, ids=lambda p: str(p.relative_to(ROOT / "tools")))
def test_help_answers_quickly(tool):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-P", str(tool), "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
    assert seconds < HELP_SECONDS, f"{tool.name} --help took {seconds:.1f} s: parse arguments before importing torch"


def _ckptq_aliases(tree: ast.Module) -> set[str]:
    """Names bound to ckptq or anything inside it by the module's imports (``from ckptq.codec import ops``
    binds ``ops``; ``import ckptq.codec as c`` binds ``c``; ``import ckptq`` binds ``ckptq``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "ckptq"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ckptq":
            names |= {a.asname or a.name for a in node.names}
    return names


def _assigned(node: ast.AST) -> list[ast.expr]:
    """The targets an assignment statement writes, tuples unpacked."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    return [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]


def _base_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


@pytest.mark.parametrize("tool", sorted((ROOT / "tools").rglob("*.py")), ids=lambda p: p.name)
def test_no_tool_patches_ckptq(tool):
    """No ``ckptq.x.y = ...`` (or ``ops.y = ...`` after ``from ckptq.codec import ops``), no setattr on them."""
    tree = ast.parse(tool.read_text())
    aliases = _ckptq_aliases(tree)
    patched = []
    for node in ast.walk(tree):
        patched += [f"line {t.lineno}" for t in _assigned(node) if isinstance(t, ast.Attribute)
                    and _base_name(t) in aliases]
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args \
                and _base_name(node.args[0]) in aliases:
            patched.append(f"line {node.lineno}: setattr")
    assert not patched, f"{tool.name} assigns to ckptq's modules or classes: {patched}"
