"""The error an integration raises when its framework does not import, saying what actually happened."""

from __future__ import annotations

import os
import sys

# The folder holding the ckptq package: in a checkout, its other folders (kernels/, tests/, tools/) are not
# meant to be importable under their own names.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PACKAGE = os.path.join(_CHECKOUT, "ckptq")
_IN_CHECKOUT = os.path.isfile(os.path.join(_CHECKOUT, "pyproject.toml"))  # not in site-packages


def framework_missing(module: str, framework: str, pip_name: str, error: ImportError) -> ImportError:
    """An ImportError for ``module`` that could not import ``framework``: where a folder of ckptq's checkout
    stood in for an installed package of the same name (Python started inside the checkout), it says so and
    how to avoid it; otherwise which package to install."""
    shadow = _shadowing(error)
    if shadow is None:
        return ImportError(f"{module} needs {framework} ({error}); pip install {pip_name}")
    name, path = shadow
    return ImportError(
        f"{module} could not import {framework}: Python imported {name!r} from {path}, a folder of ckptq's "
        f"checkout, instead of the installed package {name!r} ({error}); run from outside the checkout, or start "
        "Python with -P (3.11+) or PYTHONSAFEPATH=1 so that the working directory is not on sys.path")


def _shadowing(error: ImportError) -> tuple[str, str] | None:
    """(name, file) of the module that failed to import, where it came from the checkout beside the ckptq
    package (not from an environment inside it, such as .venv/)."""
    if not _IN_CHECKOUT:
        return None
    candidates, seen = [], error
    while isinstance(seen, ImportError) and len(candidates) < 8:  # the error and the ImportErrors behind it
        candidates.append((seen.name, seen.path))
        seen = seen.__cause__ or seen.__context__
    for name, path in candidates:
        if not name or name.startswith("ckptq") or not path:
            continue
        path = os.path.abspath(path)
        installed = path.startswith(os.path.abspath(sys.prefix) + os.sep) or "site-packages" in path.split(os.sep)
        if path.startswith(_CHECKOUT + os.sep) and not path.startswith(_PACKAGE + os.sep) and not installed:
            return name, path
    return None
