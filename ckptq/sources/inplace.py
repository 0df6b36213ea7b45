"""``--replace`` of a file that keeps a model's weights and its optimizer state together and that a framework
resumes by its name (a Lightning or Fabric ``.ckpt``, litgpt's ``lit_model.pth``): the file is converted in
place. Its optimizer state dicts become signposts carrying their state, the Adam moments 8-bit
(``ckptq.codec.signpost``): stock Lightning, Fabric and litgpt stop at a signpost with a message naming the
fixes, where a missing file made Lightning's ``ckpt_path="last"`` train from step 0 without a word and
Fabric fail to unpickle a safetensors file; ``CkptqCheckpointIO`` resumes from it; ``ckptq expand FILE
--replace`` writes the fp32 file back under the same name. Weights and every other entry stay as they were,
so the file shrinks by what the moments save (a ``.q8.safetensors`` beside it would have held the weights a
second time).

Both directions write a temp file beside the original, check every zip record of the original against its
CRC-32 (a damaged original is refused, never replaced), read the temp file back against the original, and
only then rename it over the original (``Original.remove``'s stand-in, through a hard link to the original
first: the name names the old file or the new one at every instant). A symlinked original is refused by
name before anything is written; what a killed run leaves beside it (the temp, the old file's link) is
journaled and removed by the next run (``ckptq.format.journal``).
"""

from __future__ import annotations

import os
import time
import zipfile
from dataclasses import dataclass

from ..codec import checkpoint, foreign, quant, signpost
from ..format import atomic, torch_stream, torch_zip
from . import folders, readback
from .options import ConvertOptions, ExpandOptions
from .original import Original
from .reports import ConvertReport, ExpandReport


def applies(path: str, replace: bool, output: str | None) -> bool:
    """Whether ``convert --replace`` converts ``path`` in place: a framework file resumed by its name."""
    return replace and output is None and path.endswith(folders.IN_PLACE)


def converted_in_place(path: str) -> bool:
    """A torch.save file holding signposts that carry their state (what ``convert`` in place wrote)."""
    try:
        obj = checkpoint.load_torch(path)
    except Exception:  # unreadable: the ordinary expand says in one line what is wrong with it
        return False
    return any(signpost.carries(c) for c in signpost._containers(obj))


@dataclass
class Pending:
    """A file converted in place, written beside it and not yet renamed over it."""

    src: str
    tmp: str
    original: Original
    report: ConvertReport


def write(source, opts: ConvertOptions) -> Pending:
    """Convert ``source`` (a ``TorchFile``) into a temp file beside it, its stored states carried by
    signposts; nothing is renamed yet. ``commit`` (after ``check``) puts it in place."""
    t0 = time.perf_counter()
    original = Original(source.path)
    obj = source._load(opts.trust)[0]
    report, marked = source.planned(obj, opts)
    for d in marked.quantized:  # the PendingQuants as qstate dicts (each holds its exact divisor)
        node = obj
        for k in d.path:
            node = node[k]
        node[d.key] = node[d.key].result()
    message = signpost.in_place_message(os.path.basename(source.path))
    if checkpoint.is_optimizer_state(obj):
        obj = signpost.make(obj, message, obj)
    else:
        signpost.carrying(obj, message, lambda sd: quant.count_qstates(sd["state"]) > 0)
    tmp = atomic.new_temp(source.path)
    try:
        torch_stream.save(obj, tmp, opts.progress)
    except BaseException:
        atomic.discard(tmp)
        raise
    report.outputs, report.output_bytes = [source.path], os.path.getsize(tmp)
    report.seconds = time.perf_counter() - t0
    return Pending(source.path, tmp, original, report)


def check(p: Pending, trust: bool) -> None:
    """ReadbackError (and the temp file removed) unless it holds what convert meant to write; InputError
    (the same) if a record of the original does not match its CRC-32: a damaged original is never replaced."""
    with readback.discarding([p.tmp]):
        if zipfile.is_zipfile(p.src):
            torch_zip.verify_crcs(p.src)  # no torch.load checks them: the comparison below cannot see such damage
        want = checkpoint.load_torch(p.src, trust=trust)
        want = signpost.unwrapped(want)[0]
        foreign.to_torch(want)
        got = signpost.unwrapped(checkpoint.load_torch(p.tmp))[0]
        readback.check_converted(want, got, p.tmp)


def commit(p: Pending) -> list[str]:
    """The checked temp file renamed over the original (if it is still the file that was converted)."""
    try:
        p.original.remove([p.tmp], stand_in=p.tmp)
    except BaseException:
        atomic.discard(p.tmp)
        raise
    return [p.src]


def convert(source, opts: ConvertOptions) -> ConvertReport:
    """``convert FILE --replace`` of a framework file: in place, checked before it takes the name."""
    p = write(source, opts)
    try:
        check(p, opts.trust)
    except BaseException:
        atomic.discard(p.tmp)
        raise
    p.report.removed = commit(p)
    return p.report


def expand(source, opts: ExpandOptions) -> ExpandReport:
    """An 8-bit torch.save file -> fp32 under the same name: written beside it, checked, renamed over it."""
    import dataclasses

    original = Original(source.path)
    tmp = atomic.new_temp(source.path)
    try:
        part = source.expand(dataclasses.replace(opts, output=tmp, force=True, replace=False))
        source.check_expanded([tmp], opts.trust)
        original.remove([tmp], stand_in=tmp)
    finally:
        atomic.discard(tmp)
    part.outputs = [source.path]
    return part
