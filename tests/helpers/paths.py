"""Where the checkout and the tests' data are, and the environment a child Python needs to import ``tests``."""

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the checkout: tests/helpers/paths.py -> .
TESTS = ROOT / "tests"
FIXTURES = TESTS / "fixtures"  # real frameworks' files: litgpt/, olmo_core/, zero/ (tools/scripts/make_*_fixtures.py)
GOLDEN = TESTS / "golden"  # the format's golden files


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH (and ``extra`` set): a child Python
    (``python -c``, ``python -m``, torchrun) started from any folder then imports ``tests.helpers`` and
    ``tests.workers`` as pytest does, from the checkout root, with no ``sys.path`` edits."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
