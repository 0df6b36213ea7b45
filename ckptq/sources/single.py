"""Single files: a torch.save checkpoint (``TorchFile``: fp32 Adam state, or 8-bit state that ckptq,
bitsandbytes or torchao saved), a ckptq file or shard set (``ConvertedFile``), and a safetensors file that
ckptq did not write (``ForeignSafetensors``: a model's weights, say)."""

from __future__ import annotations

import os
import time
import zipfile
from typing import Any

from .. import __version__, format
from ..codec import checkpoint, foreign, plan, policy, qstate, quant, signpost, tree
from ..errors import InputError, NothingToConvertError
from ..format import torch_stream, torch_zip
from . import inplace, outputs, readback
from .original import Original
from .base import Source
from .options import ConvertOptions, ExpandOptions, InfoOptions
from .reports import ConvertReport, ExpandReport, InfoReport, StateRow


def check_converted(src: str, outputs: list[str], trust: bool = False) -> None:
    """ReadbackError (and ``outputs`` removed) unless the converted ``outputs`` (file, or index + shards) of
    ``src`` (a torch.save file, or a converted file re-encoded at another width) decode to exactly what
    convert meant to write; each tensor's crc32 is checked as it is read."""
    with readback.discarding(outputs):
        if format.is_safetensors(src):  # re-encoded at another width: its decoded states are the source
            want = tree.Converted(src).read(dequantize=True)
        else:  # compared with what a strict torch.load sees: record sizes, and each record's checksum
            want = signpost.unwrapped(checkpoint.load_torch(src, trust=trust))[0]
            if zipfile.is_zipfile(src) and not trust:
                torch_zip.verify_crcs(src)
        foreign.to_torch(want)  # bitsandbytes / torchao state is converted from its fp32 form, as convert does
        conv = tree.Converted(outputs[0], verify=True)
        try:
            readback.check_converted(want, conv.read(dequantize=False), outputs[0])
        finally:
            conv.close()


def check_expanded(src: str, dst: str, trust: bool = False) -> None:
    """ReadbackError (and ``dst`` removed) unless the torch.save file ``dst`` holds exactly the decoding of
    ``src`` (a converted file or set, or a torch.save file holding 8-bit states)."""
    with readback.discarding([dst]):
        got = checkpoint.load_torch(dst)
        if checkpoint.is_torch_file(src):
            if zipfile.is_zipfile(src):  # --replace deletes it: not if it is damaged (no torch.load checks CRCs)
                torch_zip.verify_crcs(src)
            want = signpost.unwrapped(checkpoint.load_torch(src, trust=trust))[0]
            foreign.to_torch(want)
            quant.decode_qstates(want)
            readback.check_expanded(want, got, dst)
            return
        conv = tree.Converted(src, verify=True)
        try:  # lazy: one decoded tensor at a time
            readback.check_expanded(conv.read(dequantize=True, lazy=True), got, dst)
        finally:
            conv.close()


def default_output(src: str, bits: int = 8) -> str:
    """``ckpt.pt`` -> ``ckpt.q8.safetensors`` (``ckpt.q4.safetensors`` for 4 bits; ``ckpt.q8.safetensors``
    -> ``ckpt.q4.safetensors``), beside the input."""
    base = os.path.basename(src.rstrip("/")).removesuffix(format.INDEX_SUFFIX)
    stem = base.rsplit(".", 1)[0] if "." in base else base
    stem = stem.removesuffix(".q8").removesuffix(".q4")
    return os.path.join(os.path.dirname(src), f"{stem}.q{bits}{format.SUFFIX}")


def default_expanded(src: str) -> str:
    """``ckpt.q8.safetensors`` -> ``ckpt.fp32.pt``; ``optimizer.pt`` (a torch.save file) -> ``optimizer.fp32.pt``."""
    base = os.path.basename(src.rstrip("/"))
    for suffix in (format.INDEX_SUFFIX, format.SUFFIX, ".pt", ".pth", ".bin"):
        base = base.removesuffix(suffix)
    return os.path.join(os.path.dirname(src), base.removesuffix(".q8").removesuffix(".q4") + ".fp32.pt")


def convert_info(src: str, source_bytes: int, counts: dict, block_size: int, min_size: int, bits: int) -> dict:
    """The ``ckptq.info`` metadata of a converted file (``save`` adds ``stored_bytes``)."""
    return {"created_by": f"ckptq {__version__}", "source": os.path.basename(src), "source_bytes": source_bytes,
            "block_size": block_size, "min_size": min_size, "quantized": counts["quantized"]} | \
        ({"bits": bits} if bits != 8 else {})


def quant_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    return device


def load(path: str, *, dequantize: bool = False, verify: bool = True) -> Any:
    """Read a converted checkpoint (file, index, or folder). Quantized states stay qstate dicts (what
    ``ckptq.optim.AdamW8bit.load_state_dict`` takes) unless ``dequantize=True``. A torch.save file (e.g. an
    ``optimizer.pt`` that Trainer wrote from AdamW8bit's state) is read with ``torch.load(weights_only=True)``."""
    if checkpoint.is_torch_file(path):
        obj = checkpoint.load_torch(path)
        if dequantize:
            quant.decode_qstates(obj)
        return obj
    conv = tree.Converted(path, verify)
    try:
        return conv.read(dequantize)
    finally:
        conv.close()


def save(obj: Any, path: str, *, info: dict | None = None, force: bool = False, compression=None,
         max_shard_size: int | None = None, progress=None) -> list[str]:
    """Write any checkpoint structure (tensors, qstate dicts, containers, scalars) in ckptq format.

    Quantized states (e.g. from ``AdamW8bit.state_dict()``) are stored as they are; returns the paths written.
    """
    skeleton, stored = tree.flatten(obj)
    total, done = sum(s.nbytes for s in stored), 0

    def on_tensor(s) -> None:
        nonlocal done
        done += s.nbytes
        if progress:
            progress(done, total)

    info = dict(info or {"created_by": f"ckptq {__version__}"})
    info["stored_bytes"] = total
    return format.write(path, skeleton, stored, info, force=force, compression=compression,
                        max_shard_size=max_shard_size, on_tensor=on_tensor)


def planned(src: str, obj: Any, opts: ConvertOptions, kind: str):
    """``(report, marked)``: the plan for ``obj`` (loaded from ``src``) applied (``tree.mark``: each state
    stored low-bit a ``PendingQuant``), and the convert report counting it; NothingToConvertError when it
    stores nothing (``convert --all`` passes over such a checkpoint and says so)."""
    report = ConvertReport(src, kind, source_bytes=os.path.getsize(src), bits=opts.bits)
    report.foreign_states = foreign.to_torch(obj)  # bitsandbytes / torchao 8-bit state, decoded first
    held = quant.count_qstates(obj)
    marked = tree.mark(obj, opts.key, opts.block_size, opts.min_size, opts.bits, opts.backend,
                       quant_device(opts.device))
    counts = marked.counts()
    report.__dict__.update(counts)
    report.warnings = marked.warnings()
    report.nonfinite_names = [d.name for d in marked.kept("holds NaN/Inf")]
    if held and not counts["quantized"]:
        raise NothingToConvertError(f"{src} holds ckptq's low-bit optimizer state already ({held} states); `ckptq "
                                    "expand` turns it back into fp32 state", reason="already converted")
    if not counts["optimizers"]:
        raise NothingToConvertError(f"{src}: no optimizer state dict (a dict with 'state' and 'param_groups') found; "
                                    "name it with --key if it is stored differently", reason="no optimizer state")
    if not counts["quantized"]:
        raise NothingToConvertError(f"{src}: {marked.nothing_to_quantize(opts.min_size)}",
                                    reason="no Adam moments to store low-bit")
    return report, marked


def _write_converted(src: str, obj: Any, opts: ConvertOptions, kind: str, t0: float) -> ConvertReport:
    """Plan and write ``obj`` (loaded from ``src``) as a converted file at ``opts.output``."""
    report, marked = planned(src, obj, opts, kind)
    compression = None if opts.compress_level is None else format.Compression(opts.compress_level, opts.compress_threads)
    info = convert_info(src, report.source_bytes, marked.counts(), opts.block_size, opts.min_size, opts.bits)
    report.outputs = save(obj, opts.output, info=info, force=opts.force, compression=compression,
                          max_shard_size=opts.max_shard_size, progress=opts.progress)
    report.output_bytes = sum(os.path.getsize(p) for p in report.outputs)
    return report


def _input_bits(obj: Any) -> int:
    """The widest code width of the low-bit state a loaded file holds (4 for torchao's ``OptimState4bit``);
    8 when it holds none (fp32 moments)."""
    widths = {4 if type(t).__name__ == "OptimState4bit" else 8 for t in checkpoint.iter_tensors(obj) if foreign.is_torchao(t)}
    return max(widths, default=8)


class _OneFile(Source):
    """A source that is one file (or one shard set) ckptq reads whole: ``--replace`` reads its outputs back
    against it."""

    def check_converted(self, outputs: list[str], trust: bool) -> None:
        check_converted(self.path, outputs, trust)

    def check_expanded(self, outputs: list[str], trust: bool) -> None:
        check_expanded(self.path, outputs[0], trust)


class TorchFile(_OneFile):
    kind = "torch.save checkpoint"
    type = "torch"

    def _load(self, trust: bool) -> tuple[Any, int]:
        """(the file's contents, how many states of a Lightning checkpoint were put back from under ckptq's
        signposts); InputError for a signpost itself, which holds no state."""
        obj = checkpoint.load_torch(self.path, trust=trust)
        if signpost.is_signpost(obj) and not signpost.carries(obj):
            raise InputError(f"{self.path} is a signpost, not optimizer state: {obj[signpost.SIGNPOST_KEY]}")
        return signpost.unwrapped(obj)

    def planned(self, obj: Any, opts: ConvertOptions):
        return planned(self.path, obj, opts.narrowed(_input_bits(obj)), self.kind)

    def convert(self, opts: ConvertOptions) -> ConvertReport:
        if inplace.applies(self.path, opts.replace, opts.output):  # a Lightning / Fabric / litgpt file
            return inplace.convert(self, opts)
        t0 = time.perf_counter()
        obj = self._load(opts.trust)[0]
        opts = opts.narrowed(_input_bits(obj))
        opts = opts.with_output(opts.output or default_output(self.path, opts.bits))
        outputs.check_separate([self.path], opts.output)
        original = Original(self.path) if opts.replace else None
        report = _write_converted(self.path, obj, opts, self.kind, t0)
        if original:  # the original goes only once the output reads back as what was meant
            self.check_converted(report.outputs, opts.trust)
            report.removed = original.remove(report.outputs)
        report.seconds = time.perf_counter() - t0
        return report

    def expand(self, opts: ExpandOptions) -> ExpandReport:
        """A torch.save file holding 8-bit states (saved from AdamW8bit, or a bitsandbytes or torchao
        optimizer's): the same file with every state decoded to torch's fp32 form."""
        if opts.replace and opts.output is None and inplace.converted_in_place(self.path):
            return inplace.expand(self, opts)  # back under the name its framework resumes from
        t0 = time.perf_counter()
        dst = opts.output or default_expanded(self.path)
        outputs.check_separate([self.path], dst)
        original = Original(self.path) if opts.replace else None
        obj, restored = self._load(opts.trust)
        if not quant.count_qstates(obj) + foreign.to_torch(obj) + restored:
            raise InputError(f"{self.path} is a torch.save checkpoint without 8-bit states (ckptq, bitsandbytes or "
                             "torchao): it is already expanded (torch.load reads it; `ckptq convert` shrinks it)")
        quant.decode_qstates(obj)
        with format.atomic_outputs([dst], opts.force, "torch") as (tmp,):
            torch_stream.save(obj, tmp, opts.progress)
        report = ExpandReport(self.path, self.kind, [dst], os.path.getsize(dst))
        if original:
            self.check_expanded([dst], opts.trust)
            report.removed = original.remove([dst])
        report.seconds = time.perf_counter() - t0
        return report

    def info(self, opts: InfoOptions) -> InfoReport:
        """What the file holds, and what ``convert`` with these options would store (the same plan, sized
        tensor by tensor as its writer would write them; nothing is quantized)."""
        obj = checkpoint.load_torch(self.path, trust=opts.trust)
        r = InfoReport(self.path, self.kind, os.path.getsize(self.path), type=self.type)
        if signpost.is_signpost(obj) and not signpost.carries(obj):  # a stock framework stops here
            r.kind, r.notes = "ckptq signpost (no optimizer state)", [obj[signpost.SIGNPOST_KEY]]
            return r
        obj, carried = signpost.unwrapped(obj)
        if carried:
            r.notes.append(f"{carried} optimizer states stored by ckptq behind signposts (a stock framework stops "
                           "at them; `ckptq expand PATH --replace` writes them back fp32)")
        plan.recognise_all(obj, opts.key)  # what cannot be read (heavyball's nested state) is said first
        held = _count_qstates(obj, r)
        for s in tree.flatten(obj)[1]:  # the tensors as stored (shared storage once), by their state key
            if s.role in ("exact", "codebook"):
                role = s.name.rsplit("/", 1)[-1] if s.role == "exact" else "codebooks"
                r.count(role if role in policy.MOMENT_KEYS or role == "codebooks" else "other", None,
                        int(s.nbytes // s.dtype.itemsize), s.nbytes)
        foreign_params = foreign.to_torch(obj)
        marked = tree.mark(obj, opts.key, opts.block_size, opts.min_size, opts.bits)
        r.details["optimizers"] = ", ".join("/".join(map(str, f.path)) or "<root>" for f in marked.optimizers) or \
            "no optimizer state dict found"
        if marked.optimizers:
            r.details["recognised"] = "; ".join(marked.recognised())
        _describe_plan(r, obj, held, foreign_params, marked, opts)
        return r


def _count_qstates(obj: Any, r: InfoReport) -> int:
    """Count the quantized states ``obj`` holds into ``r``, by role and width; returns how many."""
    found = 0

    def walk(node, key) -> None:
        nonlocal found
        if qstate.is_qstate(node):
            q = qstate.QState.from_dict(node)
            r.count(str(key), q.bits, q.numel, q.nbytes)
            found += 1
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v, key)

    walk(obj, None)
    return found


def _describe_plan(r: InfoReport, obj: Any, held: int, foreign_params: int, marked, opts: InfoOptions) -> None:
    """What convert would write (``obj`` marked by ``tree.mark``), and the notes of a torch.save file's info."""
    skeleton, stored = tree.flatten(obj)
    counts = marked.counts()
    for d in marked.quantized:
        row = next((w for w in r.would_store if (w.role, w.bits) == (d.key, plan.convert_width(d, opts.bits))), None)
        if row is None:
            row = StateRow(d.key, plan.convert_width(d, opts.bits))
            r.would_store.append(row)
        row.tensors, row.elements = row.tensors + 1, row.elements + d.tensor.numel()
    r.details.update(low_bit_states=held, foreign_8bit_params=foreign_params)
    r.options = {"bits": opts.bits, "block_size": opts.block_size, "min_size": opts.min_size}
    if counts["quantized"]:
        meta = convert_info(r.path, r.bytes, counts, opts.block_size, opts.min_size, opts.bits)
        r.would_write = format.planned_bytes(skeleton, stored, meta | {"stored_bytes": sum(s.nbytes for s in stored)})
    elif marked.optimizers and not held and not foreign_params:
        r.notes.append(marked.nothing_to_quantize(opts.min_size))
    r.warnings += marked.warnings()
    if foreign_params:
        r.notes.append(f"{foreign_params} parameters hold bitsandbytes/torchao 8-bit state: convert re-encodes it as "
                       "ckptq's, expand turns it into its torch counterpart's fp32 state (AdamW's, SGD's, Lion's, ...)")
    if held:
        r.notes.append(f"holds {held} ckptq low-bit states (saved from AdamW8bit/AdamW4bit or a ckptq integration): "
                       "`ckptq expand` turns them into fp32 state; AdamW8bit.load_state_dict and ckptq.load read "
                       "them as they are")


class ConvertedFile(_OneFile):
    kind = "ckptq file"
    type = "converted"

    def convert(self, opts: ConvertOptions) -> ConvertReport:
        """A converted file re-encoded at the other budget (8 <-> 4): its states decoded, then quantized."""
        t0 = time.perf_counter()
        opts = opts.with_output(opts.output or default_output(self.path, opts.bits))
        conv = tree.Converted(self.path)
        try:
            outputs.check_separate(conv.files, opts.output)
            if policy.budget_of(_widths(conv)) == opts.bits:
                other = 4 if opts.bits == 8 else 8
                raise NothingToConvertError(f"{self.path} already holds {opts.bits}-bit states; `ckptq convert --bits {other}` "
                                            f"re-encodes them at {other} bits, `ckptq expand` turns them back into fp32",
                                            reason="already converted")
            original = Original(self.path) if opts.replace else None
            obj = conv.read(dequantize=True)
            files = list(conv.files)
        finally:
            conv.close()
        report = _write_converted(self.path, obj, opts, self.kind, t0)
        report.source_bytes = sum(os.path.getsize(f) for f in files)
        if original:
            self.check_converted(report.outputs, opts.trust)
            report.removed = original.remove(report.outputs, also=files[1:])
        report.seconds = time.perf_counter() - t0
        return report

    def expand(self, opts: ExpandOptions) -> ExpandReport:
        """The converted file as an ordinary torch.save checkpoint: every state decoded to its dtype."""
        t0 = time.perf_counter()
        dst = opts.output or default_expanded(self.path)
        conv = tree.Converted(self.path, opts.verify)
        try:
            outputs.check_separate(conv.files, dst)
            original = Original(self.path) if opts.replace else None
            obj = conv.read(dequantize=True, lazy=True)  # tensors are produced one at a time while writing
            with format.atomic_outputs([dst], opts.force, "torch") as (tmp,):
                torch_stream.save(obj, tmp, opts.progress)
            files = list(conv.files)
        finally:
            conv.close()
        report = ExpandReport(self.path, self.kind, [dst], os.path.getsize(dst))
        if original:
            self.check_expanded([dst], opts.trust)
            report.removed = original.remove([dst], also=files[1:])
        report.seconds = time.perf_counter() - t0
        return report

    def info(self, opts: InfoOptions) -> InfoReport:
        conv = tree.Converted(self.path, verify=False)
        try:
            r = InfoReport(self.path, f"{self.kind}, format {conv.version}", sum(os.path.getsize(f) for f in conv.files),
                           type=self.type)
            for role, bits, numel, stored in conv.states():
                r.count(role, bits, numel, stored)
            codecs = sorted({t.get("codec", {}).get("codec", "raw") for t in conv.tensors.values()})
            r.options = {k: v for k, v in conv.info.items() if k in ("block_size", "min_size", "source", "source_bytes")}
            if conv.block_sizes() and "block_size" not in r.options:  # saved by ckptq.save: what the states use
                r.options["block_size"] = ", ".join(map(str, conv.block_sizes()))
            r.details = {"created_by": conv.info.get("created_by", "ckptq"), "codecs": ", ".join(codecs),
                         "files": list(conv.files)}
        finally:
            conv.close()
        return r


def _widths(conv) -> set:
    """The code widths of a converted file's quantized states."""
    return {bits for _, bits, _, _ in conv.states() if bits}


class ForeignSafetensors(Source):
    """A safetensors file that ckptq did not write (a model's weights, say): described, never converted."""

    kind = "safetensors file not written by ckptq"
    type = "safetensors"

    def _what(self) -> str:
        from ..format.reader import Reader

        Reader(self.path).close()  # a damaged file is called damaged (FormatError), not somebody else's
        return (f"{self.path} is a safetensors file that ckptq did not write (model weights?); ckptq converts "
                "optimizer state: pass the torch.save checkpoint or the checkpoint folder that holds it")

    def convert(self, opts: ConvertOptions) -> ConvertReport:
        raise InputError(self._what())

    def expand(self, opts: ExpandOptions) -> ExpandReport:
        raise InputError(self._what())

    def info(self, opts: InfoOptions) -> InfoReport:
        from ..format.reader import Reader

        reader = Reader(self.path)  # validated as any input: entries tile the data, shapes are sane
        try:
            r = InfoReport(self.path, self.kind, os.path.getsize(self.path), type=self.type)
            for e in reader.entries.values():
                numel = 1
                for d in e["shape"]:
                    numel *= d
                r.count(f"{e['dtype']} tensors", None, numel, e["data_offsets"][1] - e["data_offsets"][0])
        finally:
            reader.close()
        r.notes.append("ckptq converts optimizer state; a model's weights stay as they are")
        return r
