"""A ``torch.distributed.checkpoint`` folder as a ckptq source: ``convert``, ``expand`` and ``info``
(``ckptq.dcp.folder`` does the work, under torchrun the ranks share it), and the read-back checks that let
``--replace`` delete the original folder: every copied entry equal to the source's, every low-bit state
equal to what the one quantizer makes of the source's fp32 moment with the parameters the output records,
every expanded moment equal to the decoding of the source's state."""

from __future__ import annotations

import time

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..codec import policy, quant, signpost
from ..format import files
from ..errors import ReadbackError
from ..sources import outputs
from ..sources.original import Original
from ..sources.base import Source
from ..sources.options import ConvertOptions, ExpandOptions, InfoOptions
from ..sources.reports import ConvertReport, ExpandReport, InfoReport
from . import folder, predict, writer


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    return a == b


def _entry(path: str, key: str, meta):
    template = torch.empty(tuple(meta.size), dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else None
    return folder._read(path, {key: template})[key]


def _fail(where: str, key: str, what: str) -> ReadbackError:
    return ReadbackError(f"{where} does not read back as written ({key}: {what}); it was removed and the "
                                  "original kept")


def _requantized(src: str, key: str, q: dict) -> dict:
    """What convert meant to store for the source's fp32 moment ``key``, with the parameters ``q`` records."""
    role = key.rsplit(".", 1)[-1]
    t = _entry(src, key, folder.read_metadata(src).state_dict_metadata[key]).float()
    divisor = None
    if q["transform"] == policy.RATIO_TRANSFORM:
        vkey = f"{key.rpartition('.')[0]}.{q['divisor']}"
        v = _entry(src, vkey, folder.read_metadata(src).state_dict_metadata[vkey]).float()
        divisor = (q["divisor"], v, q["eps"])
    return quant.quantize_as(t, role, q["block_size"], q["bits"], divisor, layout=q.get("layout", "flat"))


def _check(src: str, dst: str, expanded: bool) -> None:
    """ReadbackError unless every entry of ``dst`` is what convert (or expand) meant to write from ``src``;
    the ranks of a torchrun share the keys."""
    meta_src, meta_dst = (folder.read_metadata(p).state_dict_metadata for p in (src, dst))
    low = folder.quantized_keys(meta_src if expanded else meta_dst)
    scalars = folder._scalars(src if expanded else dst, folder.read_metadata(src if expanded else dst))
    bad = None
    for key in writer.mine(sorted(meta_dst)):
        owner = next((q for q in low if key.startswith(f"{q}.")), None)
        if owner is not None and not key.endswith(".codes"):
            continue  # a part of a low-bit state: checked with its codes
        if owner is not None:
            got = folder.qstate_at(dst, owner, scalars, meta_dst)
            want = _requantized(src, owner, got)
            if not all(_same(want[n].reshape(got[n].shape), got[n]) for n in ("codes", "absmax", "qmap")):
                bad = (owner, "codes differ")
        elif expanded and key in low:
            q = folder.qstate_at(src, key, scalars, meta_src)
            divisor = folder.qstate_at(src, f"{key.rpartition('.')[0]}.{q['divisor']}", scalars, meta_src) \
                if q["transform"] == policy.RATIO_TRANSFORM else None
            if not _same(quant.dequantize_state(q, divisor=divisor), _entry(dst, key, meta_dst[key])):
                bad = (key, "values differ")
        elif not _same(_entry(src, key, meta_src[key]), _entry(dst, key, meta_dst[key])):
            bad = (key, "entry differs")
    found = [b for b in writer.gathered(bad) if b]
    if found:
        raise _fail(dst, *found[0])


class DcpFolder(Source):
    kind = "torch.distributed.checkpoint folder"
    type = "dcp"

    def _replace(self, original, outputs_: list[str], expanded: bool) -> list[str]:
        """Check the output against the source, then delete the source (rank 0); a failed check removes the
        output, and keeps the source. Converting, a signpost folder takes the source's name (a loader that
        looks there stops with ckptq's message instead of finding no checkpoint)."""
        try:
            _check(self.path, outputs_[0], expanded)
        except ReadbackError:
            if writer._rank0():
                files.remove_path(outputs_[0])
            raise
        if not writer._rank0():
            return []
        stand_in = None if expanded else signpost.folder_beside(self.path, outputs_[0])
        return original.remove(outputs_, stand_in=stand_in)

    def convert(self, opts: ConvertOptions) -> ConvertReport:
        t0 = time.perf_counter()
        dst = opts.output or self.path.rstrip("/") + f".q{opts.bits}"
        outputs.check_separate([self.path], dst)
        original = Original(self.path) if opts.replace else None
        writer.join_torchrun()
        r = folder.convert(self.path, dst, bits=opts.bits, block_size=opts.block_size, min_size=opts.min_size,
                           force=opts.force)
        report = ConvertReport(self.path, self.kind, [dst], r["source_bytes"], r["output_bytes"], bits=opts.bits,
                               quantized=r["quantized"], kept_small=r["kept_small"], warnings=r["warnings"])
        if original:
            report.removed = self._replace(original, [dst], expanded=False)
            report.signposts = list(report.removed)
        writer.leave_torchrun()
        report.seconds = time.perf_counter() - t0
        return report

    def expand(self, opts: ExpandOptions) -> ExpandReport:
        t0 = time.perf_counter()
        dst = opts.output or self.path.rstrip("/").removesuffix(".q8").removesuffix(".q4") + ".fp32"
        outputs.check_separate([self.path], dst)
        original = Original(self.path) if opts.replace else None
        writer.join_torchrun()
        r = folder.expand(self.path, dst, force=opts.force)
        report = ExpandReport(self.path, self.kind, [dst], r["output_bytes"])
        if original:
            report.removed = self._replace(original, [dst], expanded=True)
        writer.leave_torchrun()
        report.seconds = time.perf_counter() - t0
        return report

    def check_converted(self, outputs_: list[str], trust: bool) -> None:
        _check(self.path, outputs_[0], expanded=False)

    def check_expanded(self, outputs_: list[str], trust: bool) -> None:
        _check(self.path, outputs_[0], expanded=True)

    def info(self, opts: InfoOptions) -> InfoReport:
        md = folder.read_metadata(self.path)
        meta = md.state_dict_metadata
        r = InfoReport(self.path, self.kind, writer.folder_bytes(self.path), type=self.type,
                       details={"keys": len(meta), "written_by_ckptq": writer.written_by_ckptq(self.path)})
        low = folder.quantized_keys(meta)
        scalars = folder._scalars(self.path, md)
        for key in low:
            stored = sum(m.size.numel() * m.properties.dtype.itemsize
                         for m in (folder.part_meta(self.path, meta, key, n) for n in ("codes", "absmax")))
            r.count(key.rsplit(".", 1)[-1], scalars.get(f"{key}.bits"), folder._numel(scalars[f"{key}.shape"]), stored)
        p = folder.make_plan(self.path, md, opts.min_size)
        for key, m in meta.items():
            role = key.rsplit(".", 1)[-1]
            if role in policy.MOMENT_KEYS and isinstance(m, TensorStorageMetadata) and key not in low:
                r.count(role, None, m.size.numel(), m.size.numel() * m.properties.dtype.itemsize)
        predict.predict(r, p, opts, md)
        stale = signpost.not_a_signpost(self.path)
        if stale is not None:
            r.notes.append(f"its {writer.MARKER} marker says it is ckptq's signpost, but {stale}: a program wrote "
                           "into it since (a DCP save keeps the old marker), so it is read as the DCP folder it is")
        return r
