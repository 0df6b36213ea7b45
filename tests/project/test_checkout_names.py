"""Python started in a checkout puts the checkout (``python -m pytest``, ``python -c``, and pytest itself:
tests/ is a package, so pytest puts the folder above it first) or a tool's folder (``python tools/bench/x.py``:
tools/bench/, tools/scripts/) first on ``sys.path``: a folder or module there with the name of an installed
package hides that package (``tests`` included). transformers 5 imports Hugging Face's ``kernels``, which
the top-level ``kernels/`` folder (installed as ``ckptq.kernels``) used to hide."""

import importlib.machinery
import importlib.metadata
import pathlib
import subprocess
import sys

import pytest

from ckptq.integrations._requires import framework_missing
from tests.helpers.paths import ROOT

# Names the checkout hides on purpose, each handled where it is imported (kernels/__init__.py hands the import
# to the installed package of that name).
HANDED_ON = {"kernels"}


def _names_on_path(folder: pathlib.Path) -> set[str]:
    """Top-level names that ``folder`` on ``sys.path`` makes importable (modules and regular packages)."""
    names = {p.stem for p in folder.glob("*.py")}
    names |= {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return names


def test_no_folder_of_the_checkout_hides_an_installed_or_standard_module():
    installed = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    hidden = {}
    for folder in (ROOT, ROOT / "tools" / "bench", ROOT / "tools" / "scripts"):
        for name in (_names_on_path(folder) - {"ckptq", "conftest", "__init__"}) & installed:
            if name not in HANDED_ON:
                hidden[name] = str(folder)
    assert not hidden, f"these names hide an installed or standard module when their folder is on sys.path: {hidden}"


@pytest.mark.parametrize("name", sorted(HANDED_ON))
def test_a_handed_on_name_imports_the_installed_package_from_the_checkout(name):
    code = (f"import {name}, sys; print({name}.__file__); "
            f"print(sys.modules[{name!r}] is {name})")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    elsewhere = [p for p in sys.path if pathlib.Path(p or ".").resolve() != ROOT]
    if importlib.machinery.PathFinder.find_spec(name, elsewhere) is None:
        assert r.returncode != 0 and f"No module named {name!r}" in r.stderr, r.stderr[-2000:]
        assert f"importable only as ckptq.{name}" in r.stderr
        return
    assert r.returncode == 0, r.stderr[-2000:]
    path, same = r.stdout.split()
    assert not path.startswith(str(ROOT / name)) and same == "True", r.stdout


def test_the_transformers_integration_imports_from_the_checkout():
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, "-c", "import ckptq.integrations.transformers as t; print(t.CkptqTrainer)"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "CkptqTrainer" in r.stdout, r.stderr[-2000:]


def test_an_integration_says_when_a_checkout_folder_stood_in_for_a_package():
    shadowed = ImportError("cannot import name 'CUDAProperties' from 'kernels'", name="kernels",
                           path=str(ROOT / "kernels" / "__init__.py"))
    message = str(framework_missing("ckptq.integrations.transformers", "transformers", "transformers", shadowed))
    assert "imported 'kernels' from" in message and "a folder of ckptq's checkout" in message
    assert "-P" in message and "pip install" not in message
    missing = ModuleNotFoundError("No module named 'transformers'", name="transformers")
    message = str(framework_missing("ckptq.integrations.transformers", "transformers", "transformers", missing))
    assert message.endswith("pip install transformers")
