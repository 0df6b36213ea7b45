"""What `pip install .` ships (README, Install): the wheel built from this checkout holds every module of the
package, the kernels' C source, and the console script, so an install outside the checkout imports."""

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.helpers.paths import ROOT


def test_the_wheel_ships_every_module_the_kernels_source_and_the_script(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip("building needs setuptools >= 77 (pyproject's build-system; pip gets it when it builds)")
    src = tmp_path / "src"  # a copy: building writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                             ".hypothesis", "demo", "*.pt", "*.safetensors"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("ckptq-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {p.relative_to(ROOT).as_posix() for p in (ROOT / "ckptq").rglob("*.py")}
    want |= {"ckptq/kernels/" + p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".py", ".c", ".h")}
    assert want <= names, f"the wheel leaves out {sorted(want - names)[:10]}"
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "ckptq = ckptq.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
