"""Checkpoints that distributed training wrote: ``torch.distributed.checkpoint`` folders (``DcpFolder``:
``ckptq.dcp.folder`` does the work, under torchrun the ranks share it) and DeepSpeed ZeRO checkpoints
(``DeepSpeedCheckpoint``: ``ckptq.deepspeed.zero``, rank files converted beside the originals, where
DeepSpeed reads them)."""

from __future__ import annotations

import os
import time

from ..errors import UsageError
from . import outputs, readback
from .base import Source
from .options import ConvertOptions, ExpandOptions, InfoOptions
from .reports import ConvertReport, ExpandReport, InfoReport


class DcpFolder(Source):
    kind = "torch.distributed.checkpoint folder"
    type = "dcp"

    def check_converted(self, outputs: list[str], trust: bool) -> None:
        raise UsageError("--replace does not handle DCP folders yet; convert without it, check the output, then "
                         "delete the original yourself")

    def convert(self, opts: ConvertOptions) -> ConvertReport:
        from ..dcp import folder  # imports torch.distributed.checkpoint: only when a folder needs it

        t0 = time.perf_counter()
        dst = opts.output or self.path.rstrip("/") + f".q{opts.bits}"
        outputs.check_separate([self.path], dst)
        original = readback.Original(self.path) if opts.replace else None
        r = folder.convert(self.path, dst, block_size=opts.block_size, min_size=opts.min_size, force=opts.force,
                           bits=opts.bits)
        report = ConvertReport(self.path, self.kind, [dst], r["source_bytes"], r["output_bytes"], bits=opts.bits,
                               quantized=r["quantized"], warnings=r["warnings"])
        if original:
            raise UsageError("--replace does not take DCP folders yet")
        report.seconds = time.perf_counter() - t0
        return report

    def expand(self, opts: ExpandOptions) -> ExpandReport:
        from ..dcp import folder

        t0 = time.perf_counter()
        dst = opts.output or self.path.rstrip("/").removesuffix(".q8").removesuffix(".q4") + ".fp32"
        outputs.check_separate([self.path], dst)
        original = readback.Original(self.path) if opts.replace else None
        r = folder.expand(self.path, dst, force=opts.force)
        report = ExpandReport(self.path, self.kind, [dst], r["output_bytes"])
        if original:
            raise UsageError("--replace does not take DCP folders yet")
        report.seconds = time.perf_counter() - t0
        return report

    def info(self, opts: InfoOptions) -> InfoReport:
        from ..dcp import folder

        r = folder.info(self.path, min_size=opts.min_size, block_size=opts.block_size)
        report = InfoReport(self.path, self.kind, r["bytes"], type="dcp", details={"keys": r["keys"]})
        report.row("Adam moments", 8).tensors = r["moments_8bit"]
        report.row("Adam moments", None).tensors = r["moments_fp32"]
        report.details["convert_would_quantize"] = r["convert_would_quantize"]
        return report


class DeepSpeedCheckpoint(Source):
    kind = "DeepSpeed checkpoint"
    type = "deepspeed"

    def _in_place(self, output: str | None, verb: str) -> None:
        if output is not None and os.path.realpath(output) != os.path.realpath(self.path):
            raise UsageError(f"-o {output}: a DeepSpeed checkpoint is {verb} beside its partition files, where "
                             "DeepSpeed reads them; leave -o out")

    def convert(self, opts: ConvertOptions) -> ConvertReport:
        from ..deepspeed import zero

        self._in_place(opts.output, "converted")
        if opts.replace:
            raise UsageError("--replace does not take DeepSpeed checkpoints: DeepSpeed resumes only from its own "
                             ".pt files, so they stay; delete them yourself once you no longer resume from them")
        return zero.convert(self.path, opts)

    def expand(self, opts: ExpandOptions) -> ExpandReport:
        from ..deepspeed import zero

        self._in_place(opts.output, "expanded")
        if opts.replace:
            raise UsageError("--replace does not take DeepSpeed checkpoints; expand, check, then delete the "
                             ".q8.safetensors files yourself")
        return zero.expand(self.path, opts)

    def info(self, opts: InfoOptions) -> InfoReport:
        from ..deepspeed import zero

        return zero.info(self.path, opts)
