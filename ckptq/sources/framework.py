"""Checkpoint folders of the programs people train with (Hugging Face Trainer ``checkpoint-N/``, accelerate
``save_state``, Lightning): each optimizer file converted beside its original and expanded back under the
name the framework's resume reads (``ckptq.sources.folders`` finds them), and a run's output folder
holding many checkpoint folders (``RunFolder``: ``convert --all``).

``--replace`` deletes an original only after every output of the folder was written, synced, read back
and checked; any failure before that deletes nothing.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

from ..errors import NothingToConvertError, UsageError
from ..format import atomic
from . import folders
from .original import Original, sync_folder
from .base import Source
from .options import ConvertOptions, ExpandOptions, InfoOptions
from .reports import ConvertReport, ExpandReport, InfoReport


def _no_output_path(output: str | None, verb: str) -> None:
    if output is not None:
        raise UsageError(f"-o does not apply to a checkpoint folder ({verb} writes each file beside its original, "
                         "under the name its framework reads); name a single file to choose its output")


class FrameworkFolder(Source):
    kind = "checkpoint folder"
    type = "folder"

    def __init__(self, path: str, detect):
        super().__init__(path)
        self._detect = detect  # sources.detect.detect: what each file of the folder is

    def convert(self, opts: ConvertOptions) -> ConvertReport:
        t0 = time.perf_counter()
        _no_output_path(opts.output, "convert")
        layout = folders.for_convert(self.path, opts.bits)
        report = ConvertReport(self.path, f"{layout.framework} {self.kind}", bits=opts.bits)
        one = opts.with_output(None)
        sources = [self._detect(job.src) for job in layout.jobs]
        originals = [Original(job.src) for job in layout.jobs] if opts.replace else []
        for job, source in zip(layout.jobs, sources):  # each file beside its original; no file is deleted yet
            report.add(source.convert(_replace_off(one.with_output(job.dst))))
        for source, part in zip(sources, report.parts) if opts.replace else ():
            source.check_converted(part.outputs, opts.trust)
        for original, part in zip(originals, report.parts):
            part.removed = original.remove(part.outputs)
            report.removed += part.removed
        report.seconds = time.perf_counter() - t0
        return report

    def expand(self, opts: ExpandOptions) -> ExpandReport:
        t0 = time.perf_counter()
        _no_output_path(opts.output, "expand")
        layout = folders.for_expand(self.path, opts.replace)
        report = ExpandReport(self.path, f"{layout.framework} {self.kind}")
        moved = [job for job in layout.jobs if not job.in_place]
        originals = {job.src: Original(job.src) for job in moved} if opts.replace else {}
        for job in layout.jobs:
            if job.in_place:
                report.add(self._expand_in_place(job.src, opts))
            else:
                part = _replace_off(opts.with_output(job.dst))
                report.add(self._detect(job.src).expand(dataclasses.replace(part, force=True) if job.over_signpost else part))
        for job in moved if opts.replace else ():
            self._detect(job.src).check_expanded([job.dst], opts.trust)
        for job in moved if opts.replace else ():
            report.removed += originals[job.src].remove([job.dst], also=folders.parts_of(job.src)[1:])
        report.seconds = time.perf_counter() - t0
        return report

    def _expand_in_place(self, src: str, opts: ExpandOptions) -> ExpandReport:
        """An 8-bit torch.save file -> fp32 under the same name: written to a temp of this run's own beside it,
        checked, renamed over it (on failure only that temp is removed)."""
        with atomic.atomic_outputs([src], True, "torch") as (tmp,):
            part = self._detect(src).expand(ExpandOptions(output=tmp, force=True, verify=opts.verify, trust=opts.trust,
                                                          progress=opts.progress))
            self._detect(src).check_expanded([tmp], opts.trust)
        sync_folder(src)
        part.outputs = [src]
        return part

    def info(self, opts: InfoOptions) -> InfoReport:
        layout = folders.for_info(self.path)
        size = sum(os.path.getsize(os.path.join(self.path, n)) for n in os.listdir(self.path)
                   if os.path.isfile(os.path.join(self.path, n)))
        r = InfoReport(self.path, f"{layout.framework} {self.kind}", size, type=self.type,
                       details={"framework": layout.framework})
        r.details["optimizer_files"] = len(layout.jobs)
        for job in layout.jobs:
            r.parts.append(self._detect(job.src).info(opts))
        return r


def _replace_off(opts):
    """A part's options: the folder checks and replaces its files together, after all are written."""
    import dataclasses

    return dataclasses.replace(opts, replace=False)


_STEP = re.compile(r"(?:checkpoint-|global_step|step-|epoch=\d+-step=)(\d+)")


def linked_folders(path: str) -> list[str]:
    """Names in a run's folder that look like checkpoint folders but are symlinks (not followed)."""
    return sorted(n for n in os.listdir(path) if _STEP.fullmatch(n) and os.path.islink(os.path.join(path, n)))


def checkpoint_folders(path: str) -> list[str]:
    """The checkpoint folders a run's output folder holds, oldest first (by the step in their names). A
    symlink is never one: it may lead out of the folder the user named (``linked_folders`` lists them)."""
    found = []
    for name in os.listdir(path):
        m = _STEP.fullmatch(name)
        full = os.path.join(path, name)
        if m and os.path.isdir(full) and not os.path.islink(full):
            found.append((int(m.group(1)), name))
    return [os.path.join(path, name) for _, name in sorted(found)]


class RunFolder(Source):
    """A run's output folder holding many checkpoint folders (``checkpoint-500/``, ``checkpoint-1000/``...):
    ``convert`` converts them all (``--all``), leaving the newest ``--keep-last`` as they are for resuming."""

    kind = "training run folder"
    type = "run"

    def __init__(self, path: str, detect, explicit: bool):
        super().__init__(path)
        self._detect, self._explicit = detect, explicit  # explicit: convert --all

    def _names(self) -> str:
        subs = [os.path.basename(s) for s in checkpoint_folders(self.path)]
        return f"{len(subs)} checkpoint folders ({', '.join(subs[:6])}{', ...' if len(subs) > 6 else ''})"

    def convert(self, opts: ConvertOptions) -> ConvertReport:
        t0 = time.perf_counter()
        _no_output_path(opts.output, "convert")
        if not self._explicit:
            raise UsageError(f"{self.path} holds {self._names()}; convert them all with `ckptq convert {self.path} "
                             "--all` (add --keep-last N to leave the newest as they are), or pass one: ckptq convert "
                             f"{checkpoint_folders(self.path)[-1]}")
        subs = checkpoint_folders(self.path)
        keep = subs[len(subs) - opts.keep_last:] if opts.keep_last else []
        report = ConvertReport(self.path, self.kind, bits=opts.bits, skipped=[os.path.basename(k) for k in keep])
        report.skipped += [f"{name} (a symlink, not followed)" for name in linked_folders(self.path)]
        for sub in subs[: len(subs) - len(keep)]:
            try:
                report.add(self._detect(sub).convert(opts))
            except NothingToConvertError:  # converted already, or no optimizer state: a rerun does nothing
                report.skipped.append(f"{os.path.basename(sub)} (nothing to convert)")
        report.seconds = time.perf_counter() - t0
        return report

    def expand(self, opts: ExpandOptions) -> ExpandReport:
        raise UsageError(f"{self.path} holds {self._names()}; expand the one to resume from, say the newest: pass "
                         f"one: ckptq expand {checkpoint_folders(self.path)[-1]}")

    def info(self, opts: InfoOptions) -> InfoReport:
        subs = checkpoint_folders(self.path)
        r = InfoReport(self.path, f"{self.kind}, {len(subs)} checkpoints", type=self.type)
        for sub in subs:
            part = self._detect(sub).info(opts)
            r.parts.append(part)
            r.bytes += part.bytes
        r.notes.append(f"`ckptq convert {self.path} --all [--keep-last N] [--replace]` converts them all")
        return r
