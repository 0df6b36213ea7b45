"""The test tree's own rules that pytest does not check by itself."""

import re
from pathlib import Path

from tests.conftest import LAUNCHING
from tests.helpers.paths import ROOT

# what starts a process group: torchrun, the torchrun/Lightning workers of tests/workers, DeepSpeed's
LAUNCHES = re.compile(r"torch\.distributed\.run|tests\.workers\.|zero_work[e]r")


def test_every_module_that_launches_process_groups_is_in_the_one_serial_scope():
    """Two launches at once can take the same free port; tests/conftest.py runs the modules in LAUNCHING one
    after another under pytest-xdist. A module that launches and is not listed would race the others."""
    root = Path(ROOT)
    launching = {str(p.relative_to(root)) for p in sorted((root / "tests").rglob("test_*.py"))
                 if LAUNCHES.search(p.read_text())}
    assert launching == set(LAUNCHING)
