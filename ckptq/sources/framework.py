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

import torch

from ..codec import checkpoint, signpost
from ..errors import InputError, NothingToConvertError, UsageError
from ..format import atomic
from . import folders, inplace
from .original import Original, refuse_link
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
        layout = folders.for_convert(self.path, opts.bits, opts.replace, opts.force)
        report = ConvertReport(self.path, f"{layout.framework} {self.kind}", bits=opts.bits)
        for job in layout.jobs if opts.replace else ():
            refuse_link(job.src)  # before anything is written
        one = _replace_off(opts.with_output(None))
        sources = [self._detect(job.src) for job in layout.jobs]
        originals = [Original(job.src) if opts.replace and not job.in_place else None for job in layout.jobs]
        pending: dict = {}
        try:
            for job, source in zip(layout.jobs, sources):  # each file beside its original; no file is replaced yet
                if job.in_place:  # a Lightning / Fabric / litgpt file: converted under its own name
                    pending[job.src] = inplace.write(source, one)
                    report.add(pending[job.src].report)
                else:
                    report.add(source.convert(one.with_output(job.dst)))
            for job, source, part in zip(layout.jobs, sources, report.parts) if opts.replace else ():
                inplace.check(pending[job.src], opts.trust) if job.in_place else \
                    source.check_converted(part.outputs, opts.trust)
            for job, original, part in zip(layout.jobs, originals, report.parts) if opts.replace else ():
                if job.in_place:
                    part.removed = inplace.commit(pending.pop(job.src))
                else:
                    stand_in = _signpost(self.path, job, part.outputs[0])
                    part.removed = original.remove(part.outputs, stand_in=stand_in)
                    part.signposts = [job.src] if stand_in else []
                report.removed += part.removed
                report.signposts += part.signposts
        finally:
            for p in pending.values():  # written, never committed: a failure on the way
                atomic.discard(p.tmp)
        report.seconds = time.perf_counter() - t0
        return report

    def expand(self, opts: ExpandOptions) -> ExpandReport:
        t0 = time.perf_counter()
        _no_output_path(opts.output, "expand")
        layout = folders.for_expand(self.path, opts.replace)
        report = ExpandReport(self.path, f"{layout.framework} {self.kind}")
        moved = [job for job in layout.jobs if not job.in_place]
        for job in layout.jobs if opts.replace else ():
            refuse_link(job.src)  # before anything is written
        originals = {job.src: Original(job.src) for job in moved} if opts.replace else {}
        # a signpost stays until the file that replaces it is checked: its name is never missing
        written = {job.src: atomic.new_temp(job.dst) if opts.replace and job.over_signpost and not os.path.isdir(job.dst)
                   else job.dst for job in moved}  # a DCP folder is written beside its signpost, then renamed over it
        try:
            for job in layout.jobs:
                if job.in_place:
                    report.add(inplace.expand(self._detect(job.src), opts))
                    continue
                part = _replace_off(opts.with_output(written[job.src]))
                report.add(self._detect(job.src).expand(dataclasses.replace(part, force=True) if job.over_signpost else part))
                report.parts[-1].outputs = [job.dst]
            for job in moved if opts.replace else ():
                self._detect(job.src).check_expanded([written[job.src]], opts.trust)
            for job in moved if opts.replace else ():
                if written[job.src] != job.dst:  # over the signpost, if it is still the signpost
                    atomic.swap_in(written[job.src], job.dst, _still_a_signpost(job.dst))
                report.removed += originals[job.src].remove([job.dst], also=folders.parts_of(job.src)[1:])
        finally:
            for job in moved:
                if written[job.src] != job.dst:
                    atomic.discard(written[job.src])
        report.outputs = [p for part in report.parts for p in part.outputs]
        report.seconds = time.perf_counter() - t0
        return report

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


def _signpost(folder: str, job: folders.Job, stored: str) -> str | None:
    """A signpost for ``job.src`` (written to a temp file, to take its name once it goes), where the
    framework loads that file by name to resume the optimizer: Trainer's ``optimizer.pt``, accelerate's
    ``optimizer.bin``. Without it, a stock Trainer starts a fresh optimizer and scheduler without a word."""
    name, where = os.path.basename(job.src), os.path.basename(os.path.normpath(folder))
    if os.path.isdir(job.src):  # accelerate's FSDP optimizer_0/, OLMo-core's model_and_optim/: DCP folders
        return signpost.folder_beside(job.src, stored)
    if name == "optimizer.pt":
        message = signpost.trainer_message(where, os.path.basename(stored))
    elif folders.is_accelerate_file(name):
        message = signpost.accelerate_message(where, name, os.path.basename(stored))
    else:
        return None
    found = checkpoint.find_optimizers(checkpoint.load_torch(job.src))
    if not found:
        return None
    tmp = atomic.new_temp(job.src)
    try:
        torch.save(signpost.make(found[0].state_dict, message), tmp)
    except BaseException:
        atomic.discard(tmp)
        raise
    return tmp


def _still_a_signpost(name: str):
    def check(old: str) -> None:
        if not signpost.is_signpost_file(old):
            raise InputError(f"{name} is no longer ckptq's signpost (another program wrote it while ckptq expanded); "
                             "it was kept, and the expanded state was not put in its place")
    return check


def _replace_off(opts):
    """A part's options: the folder checks and replaces its files together, after all are written."""
    import dataclasses

    return dataclasses.replace(opts, replace=False)


_STEP = re.compile(r"(?:checkpoint-|global_step|step-?|epoch=\d+-step=)(\d+)")


def linked_folders(path: str) -> list[str]:
    """Names in a run's folder that look like checkpoint folders but are symlinks (not followed)."""
    return sorted(n for n in os.listdir(path) if _STEP.fullmatch(n) and os.path.islink(os.path.join(path, n)))


def checkpoint_folders(path: str) -> list[str]:
    """The checkpoints a run's output folder holds, oldest first: its checkpoint folders (``checkpoint-N/``,
    ``global_stepN/``, ``step-N/``, ``stepN/``) by the step in their names; else, in a Lightning
    ``checkpoints/`` folder holding several ``.ckpt`` files, those (by step, ``last.ckpt`` and other
    unnumbered ones after them, by time)."""
    found, ckpts = [], []
    for name in os.listdir(path):
        full = os.path.join(path, name)
        m = _STEP.fullmatch(name)
        if m and os.path.isdir(full) and not os.path.islink(full):  # never a link out of the run
            found.append((int(m.group(1)), name))
        elif name.endswith(".ckpt") and os.path.isfile(full) and not os.path.islink(full):
            step = _STEP.search(name)
            ckpts.append((0 if step else 1, int(step.group(1)) if step else os.path.getmtime(full), name))
    if not found and len(ckpts) > 1:
        return [os.path.join(path, name) for *_, name in sorted(ckpts)]
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
            except NothingToConvertError as e:  # converted already, or no Adam state: a rerun does nothing
                report.skipped.append(f"{os.path.basename(sub)} ({e.reason})")
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
