"""Where outputs may go: never onto an input, never around one (a folder holding the input would be
replaced with it), never inside a folder input (that would modify it). Files replace only files of their
own kind (``format.atomic.check_replaceable``); folders only folders ckptq wrote (``ckptq.dcp.folder``)."""

from __future__ import annotations

import os

from ..errors import UsageError


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def check_separate(inputs: list[str], output: str) -> None:
    """UsageError if ``output`` is one of ``inputs``, holds one, or lies inside a folder input."""
    out = os.path.realpath(output)
    for src in inputs:
        real = os.path.realpath(src)
        if out == real:
            raise UsageError(f"output {output} is the input; choose another -o path")
        if _inside(real, out):
            raise UsageError(f"output {output} holds the input {src}; choose an -o path outside it (nothing was written)")
        if os.path.isdir(real) and _inside(out, real):
            raise UsageError(f"output {output} lies inside the input folder {src}, which ckptq never modifies; "
                             "choose an -o path outside it")
