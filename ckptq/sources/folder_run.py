"""convert / expand / info of a whole checkpoint folder (``ckptq.folders`` finds the files), and
``--replace``: an original is deleted only after every output of the folder was written, synced, read
back and checked (``ckptq.readback``); any failure before that deletes nothing.

The per-file work is passed in (``pipeline.convert`` / ``expand`` / ``info.info`` with the caller's
options), so that this module sits below them.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ..codec import checkpoint, tree
from . import folders, readback
from ..errors import UsageError


def _no_output_path(dst: str | None, verb: str) -> None:
    if dst is not None:
        raise UsageError(f"-o does not apply to a checkpoint folder ({verb} writes each file beside its original, "
                         "under the name its framework reads); name a single file to choose its output")


def no_dcp_replace(paths: list[str], replace: bool) -> None:
    """--replace checks what it wrote by reading it back; DCP folders have no such check yet."""
    dcp = [p for p in paths if checkpoint.is_dcp_folder(p)]
    if replace and dcp:
        raise UsageError(f"--replace does not handle DCP folders ({', '.join(dcp)}) yet; run without --replace, "
                         "check the output, then delete the original yourself")


def convert(folder: str, dst: str | None, convert_one: Callable, *, replace: bool = False,
            trust: bool = False) -> tuple[folders.Layout, list, list[str]]:
    """Convert every optimizer file of a checkpoint folder beside its original; with ``replace``, then
    check every output and delete the originals. Returns (layout, per-file reports, removed paths)."""
    _no_output_path(dst, "convert")
    layout = folders.for_convert(folder)
    no_dcp_replace([job.src for job in layout.jobs], replace)
    reports = [convert_one(job.src, job.dst) for job in layout.jobs]
    if not replace:
        return layout, reports, []
    for job, r in zip(layout.jobs, reports):
        readback.check_converted(job.src, r.outputs, trust)
    for job, r in zip(layout.jobs, reports):
        readback.remove_original(job.src, r.outputs)
    return layout, reports, [job.src for job in layout.jobs]


def expand(folder: str, dst: str | None, expand_one: Callable, *, replace: bool = False,
           trust: bool = False) -> tuple[folders.Layout, list, list[str]]:
    """Expand a checkpoint folder's converted optimizer files into the files its framework reads (an 8-bit
    framework file is rewritten in place, which needs ``replace``); with ``replace``, check every output
    and delete the converted files. Returns (layout, per-file reports, removed paths)."""
    _no_output_path(dst, "expand")
    layout = folders.for_expand(folder, replace)
    no_dcp_replace([job.src for job in layout.jobs], replace)
    parts = {job.src: files_of(job.src) for job in layout.jobs if replace and not job.in_place}
    reports = [_expand_in_place(job.src, expand_one, trust) if job.in_place else expand_one(job.src, job.dst)
               for job in layout.jobs]
    if not replace:
        return layout, reports, []
    moved = [job for job in layout.jobs if not job.in_place]
    for job in moved:
        readback.check_expanded(job.src, job.dst, trust)
    removed = []
    for job in moved:
        for part in parts[job.src]:
            readback.remove_original(part, [job.dst])
            removed.append(part)
    return layout, reports, removed


def files_of(src: str) -> list[str]:
    """A converted file, or an index and its shards: every file that goes when it is replaced."""
    if os.path.isdir(src):
        return [src]
    conv = tree.Converted(src, verify=False)
    conv.close()
    return conv.files


def _expand_in_place(src: str, expand_one: Callable, trust: bool) -> Any:
    """An 8-bit torch.save file -> fp32 under the same name: written beside it, checked, renamed over it."""
    tmp = os.path.join(os.path.dirname(src), f".{os.path.basename(src)}.ckptq-expand.tmp")
    try:
        report = expand_one(src, tmp, force=True)
        readback.check_expanded(src, tmp, trust)
        os.replace(tmp, src)
        readback.sync_folder(src)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    report.output = src
    return report


def info(folder: str, describe: Callable[[str], dict]) -> dict:
    """What a checkpoint folder holds: each optimizer file's ``ckptq info`` (originals and converted)."""
    layout = folders.for_info(folder)
    return {"kind": "folder", "path": folder, "framework": layout.framework,
            "files": [describe(job.src) for job in layout.jobs]}


is_checkpoint_folder = folders.is_checkpoint_folder
