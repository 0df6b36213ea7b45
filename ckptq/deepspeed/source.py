"""DeepSpeed checkpoints as a ckptq source: ZeRO stage 1-3 rank files (``ranks``) and universal checkpoint
folders (``universal``). ``convert`` writes each rank file's (or parameter's) low-bit file beside it, all
or none, at 8 or 4 bits per value (the one planner and quantizer, ``plan``); ``expand`` writes the fp32
files back where DeepSpeed reads them; ``info`` describes both kinds. Outputs go beside the originals, so
an output path is refused, and ``--replace`` is refused (DeepSpeed resumes only from its own files)."""

from __future__ import annotations

import os
import time

from ..codec import tree
from ..errors import FormatError, InputError, UsageError
from ..format import atomic, torch_stream
from ..sources.base import Source
from ..sources.options import ConvertOptions, ExpandOptions, InfoOptions
from ..sources.reports import ConvertReport, ExpandReport, InfoReport, StateRow
from . import objects, plan, ranks, universal


def is_zero_checkpoint(path: str) -> bool:
    """A DeepSpeed ZeRO checkpoint (save dir, tag folder, rank file) or universal checkpoint folder."""
    return universal.is_universal(path) or ranks.is_rank_checkpoint(path)


def _report(src: str, kind: str, outputs: list[str], sources: list[str], planned: list, bits: int, t0: float):
    return ConvertReport(src, kind, outputs, sum(os.path.getsize(p) for p in sources),
                         sum(os.path.getsize(p) for p in outputs), bits=bits, optimizers=len(outputs),
                         quantized=sum(pl.quantized for pl in planned), kept_small=sum(pl.kept_small for pl in planned),
                         warnings=[w for pl in planned for w in pl.warnings], seconds=time.perf_counter() - t0)


def _convert_ranks(src: str, opts: ConvertOptions, kind: str) -> ConvertReport:
    """Every rank's optimizer file -> ``<name>.q8.safetensors`` (``.q4``) beside it; all of them or none."""
    t0 = time.perf_counter()
    parts, objs = ranks.fp32_parts(src)
    planned = [plan.plan_tree(o, p.pt, opts.block_size, opts.min_size, ranks.describe(p, o), opts.bits)
               for p, o in zip(parts, objs)]
    empty = [p.pt for p, pl in zip(parts, planned) if not pl.quantized]
    if empty:
        raise InputError(f"{empty[0]}: no Adam moment to store low-bit (a flat partition below --min-size "
                         f"{opts.min_size}, or no exp_avg/exp_avg_sq); lower --min-size")
    outputs = [p.converted(opts.bits) for p in parts]
    plan.write_all(outputs, planned, opts.force, opts.progress)
    return _report(src, kind, outputs, [p.pt for p in parts], planned, opts.bits, t0)


def _convert_universal(src: str, opts: ConvertOptions, kind: str) -> ConvertReport:
    """Every parameter's two moment files -> ``moments.q8.safetensors`` (``.q4``) beside them; all or none."""
    t0 = time.perf_counter()
    group, folders = universal.group(src), universal.fp32_folders(src)
    planned = [plan.plan_tree(universal.param_state(f, group), os.path.join(f, "exp_avg.pt"), opts.block_size,
                              opts.min_size, {"universal": os.path.basename(f)}, opts.bits) for f in folders]
    if not any(pl.quantized for pl in planned):
        raise InputError(f"{src}: no parameter's moments are large enough to store low-bit (--min-size "
                         f"{opts.min_size}); lower --min-size")
    outputs = [os.path.join(f, universal.CONVERTED[opts.bits]) for f in folders]
    plan.write_all(outputs, planned, opts.force, opts.progress)
    sources = [os.path.join(f, n + ".pt") for f in folders for n in universal.MOMENT_FILES]
    return _report(src, kind, outputs, sources, planned, opts.bits, t0)


def _expand_ranks(src: str, opts: ExpandOptions) -> tuple[str, list[str]]:
    """Write each rank's ``.pt`` back from its converted file (all or none), where DeepSpeed reads it."""
    every = ranks.partitions(src)
    parts = [p for p in every if p.q8]
    if not parts:
        raise InputError(f"{src}: no converted DeepSpeed ZeRO optimizer files (*_optim_states.q8.safetensors) to expand")
    metas = [plan.converted_meta(p.q8) for p in parts]
    if os.path.isdir(src):
        ranks.check_world(every, {p.q8: m[ranks.INFO_KEY].get("world_size") for p, m in zip(parts, metas)})
    with atomic.atomic_outputs([p.pt for p in parts], opts.force, "torch") as tmps:
        for p, tmp in zip(parts, tmps):
            conv = tree.Converted(p.q8, opts.verify)
            try:
                obj = objects.from_plain(conv.read(dequantize=True, lazy=True))
            except FormatError as e:
                raise FormatError(f"{p.q8}: {e}") from None
            torch_stream.save(obj, tmp, opts.progress, pickler=objects.Pickler)
            conv.close()
    return (parts[0].folder if os.path.isdir(src) else parts[0].pt), [p.pt for p in parts]


def _expand_universal(src: str, opts: ExpandOptions) -> tuple[str, list[str]]:
    """Write every parameter's ``exp_avg.pt`` / ``exp_avg_sq.pt`` back from its converted file; all or none."""
    found = [(f, universal.converted(f)) for f in universal.param_folders(src)]
    found = [(f, c) for f, c in found if c]
    if not found:
        raise InputError(f"{src}: no converted moments (zero/<param>/{universal.CONVERTED[8]}) to expand")
    for _, c in found:
        plan.converted_meta(c)
    finals = [os.path.join(f, n + ".pt") for f, _ in found for n in universal.MOMENT_FILES]
    with atomic.atomic_outputs(finals, opts.force, "torch") as tmps:
        for i, (_, c) in enumerate(found):
            conv = tree.Converted(c, opts.verify)
            obj = conv.read(dequantize=True)
            for j, name in enumerate(universal.MOMENT_FILES):
                out = {k: (obj["state"][0][name] if k == "param" else x) for k, x in obj["files"][name].items()}
                torch_stream.save(out, tmps[2 * i + j], opts.progress)
            conv.close()
    return os.path.join(src, "zero"), finals


class DeepSpeedCheckpoint(Source):
    type = "deepspeed"

    def __init__(self, path: str):
        super().__init__(path)
        self.universal = universal.is_universal(path)
        self.kind = "DeepSpeed universal checkpoint" if self.universal else "DeepSpeed ZeRO checkpoint"

    def _in_place(self, output: str | None, verb: str, replace: bool) -> None:
        if output is not None and os.path.realpath(output) != os.path.realpath(self.path):
            raise UsageError(f"-o {output}: a DeepSpeed checkpoint is {verb} beside its partition files, where "
                             "DeepSpeed reads them; leave -o out")
        if replace:
            raise UsageError(f"--replace does not take DeepSpeed checkpoints: DeepSpeed resumes only from its own "
                             f"files, so the originals stay; delete them yourself once they are {verb} and checked")

    def convert(self, opts: ConvertOptions) -> ConvertReport:
        self._in_place(opts.output, "converted", opts.replace)
        return (_convert_universal if self.universal else _convert_ranks)(self.path, opts, self.kind)

    def expand(self, opts: ExpandOptions) -> ExpandReport:
        self._in_place(opts.output, "expanded", opts.replace)
        t0 = time.perf_counter()
        out, written = (_expand_universal if self.universal else _expand_ranks)(self.path, opts)
        return ExpandReport(self.path, self.kind, [out], sum(os.path.getsize(p) for p in written),
                            time.perf_counter() - t0)

    def info(self, opts: InfoOptions) -> InfoReport:
        r = InfoReport(self.path, self.kind, type=self.type)
        if self.universal:
            folders = universal.param_folders(self.path)
            held = [c for c in map(universal.converted, folders) if c]
            fp32 = [f for f in folders if all(os.path.isfile(os.path.join(f, n + ".pt")) for n in universal.MOMENT_FILES)]
            group = universal.group(self.path)
            planned = [plan.plan_tree(universal.param_state(f, group), os.path.join(f, "exp_avg.pt"), opts.block_size,
                                      opts.min_size, {"universal": os.path.basename(f)}, opts.bits) for f in fp32]
            sources = [os.path.join(f, n + ".pt") for f in fp32 for n in universal.MOMENT_FILES]
            r.details |= {"parameters": len(folders), "params": sum(map(universal.param_numel, folders))}
        else:
            every = ranks.partitions(self.path)
            held = [p.q8 for p in every if p.q8]
            parts, objs = ([], []) if not any(os.path.isfile(p.pt) for p in every) else ranks.fp32_parts(self.path)
            planned = [plan.plan_tree(o, p.pt, opts.block_size, opts.min_size, ranks.describe(p, o), opts.bits)
                       for p, o in zip(parts, objs)]
            sources = [p.pt for p in parts]
            r.details |= _ranks_details(every, objs, held)
            if r.details["stage"] is not None:
                r.kind = f"DeepSpeed ZeRO stage {r.details['stage']} checkpoint"
        _describe(r, held, planned, sources, opts)
        return r


def _ranks_details(every: list, objs: list, held: list[str]) -> dict:
    """Stage, world sizes and files of a ZeRO checkpoint, from its fp32 files or what its converted ones record."""
    described = [ranks.describe(p, o) for p, o in zip([p for p in every if os.path.isfile(p.pt)], objs)]
    described += [plan.converted_meta(h)[ranks.INFO_KEY] for h in held] if not described else []
    stages = {d.get("stage") for d in described}
    return {"stage": stages.pop() if len(stages) == 1 else None,
            "world_size": described[0].get("world_size") if described else None,
            "mp_world_size": len({p.mp_rank for p in every}), "bf16": every[0].stem.startswith("bf16_"),
            "rank_files": len(every), "params": ranks.param_count(every[0].folder, every[0].mp_rank)}


def _describe(r: InfoReport, held: list[str], planned: list, sources: list[str], opts: InfoOptions) -> None:
    """The states the checkpoint's converted files hold, its fp32 moments, and what convert would write."""
    r.details["converted_bytes"] = sum(os.path.getsize(p) for p in held)
    for path in held:
        conv = tree.Converted(path, verify=False)
        try:
            for role, bits, numel, stored in conv.states():
                if bits:
                    r.count(role, bits, numel, stored)
        finally:
            conv.close()
        r.bytes += os.path.getsize(path)
    for pl in planned:
        for d in pl.plan.decisions:
            r.count(d.key, None, d.tensor.numel(), d.tensor.numel() * d.tensor.element_size())
            if d.exact is None:
                width = pl.widths[d.name]
                row = next((w for w in r.would_store if (w.role, w.bits) == (d.key, width)), None)
                if row is None:
                    row = StateRow(d.key, width)
                    r.would_store.append(row)
                row.tensors, row.elements = row.tensors + 1, row.elements + d.tensor.numel()
        r.warnings += pl.warnings
    r.bytes += sum(os.path.getsize(p) for p in sources)
    if planned:
        r.options = {"bits": opts.bits, "block_size": opts.block_size, "min_size": opts.min_size}
        r.would_write = sum(plan.planned_bytes(pl) for pl in planned)
        r.details["convertible_bytes"] = sum(os.path.getsize(p) for p in sources)
