"""What convert writes for one DeepSpeed optimizer file: the Adam moments marked 8-bit by ``ckptq.plan``'s
rules, the tree flattened for the safetensors format, and a writer for a set of such files (all or none)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .. import __version__
from .. import format
from ..format import files
from ..codec import plan, policy, tree
from ..errors import InputError

Q8 = ".q8" + format.SUFFIX
INFO_KEY = "deepspeed_zero"  # the ckptq.info entry that marks a file converted from a DeepSpeed checkpoint


@dataclass
class Planned:
    """What convert writes for one file."""

    skeleton: object
    stored: list
    meta: dict
    quantized: int
    kept_small: int
    warnings: list
    moment_bytes: int  # the fp32 bytes of the file's Adam moments


def plan_tree(obj, source: str, block_size: int, min_size: int, described: dict, backend: str = "auto") -> Planned:
    """Mark the Adam moments in ``obj`` (loaded from the file ``source``) that go 8-bit, in place, and
    flatten it; ``described`` goes into the file's info under ``INFO_KEY``."""
    p = plan.make_plan(obj, None, min_size)
    for d in p.quantized:
        node = obj
        for k in d.path:
            node = node[k]
        node[d.key] = tree.PendingQuant(d.tensor, d.key, block_size, backend, divisor=d.divisor, device="cpu")
    moments = sum(d.tensor.numel() * d.tensor.element_size() for d in p.decisions if d.key in policy.MOMENT_KEYS)
    skeleton, stored = tree.flatten(obj)
    meta = {"created_by": f"ckptq {__version__}", "source": os.path.basename(source),
            "source_bytes": os.path.getsize(source), "block_size": block_size, "min_size": min_size,
            "quantized": len(p.quantized), INFO_KEY: described | {"moment_bytes": moments},
            "stored_bytes": sum(s.nbytes for s in stored)}
    return Planned(skeleton, stored, meta, len(p.quantized), len(p.kept("below min_size")), p.warnings(), moments)


def planned_bytes(pl: Planned) -> int:
    return format.planned_bytes(pl.skeleton, pl.stored, pl.meta)


def write_all(finals: list[str], planned: list[Planned], force: bool, progress=None) -> None:
    """Write each planned file to its final path: all of them, or none (temp files, renamed at the end)."""
    total, done = sum(pl.meta["stored_bytes"] for pl in planned), 0

    def on_tensor(s: tree.Stored) -> None:
        nonlocal done
        done += s.nbytes
        if progress:
            progress(done, total)

    with files.atomic_outputs(finals, force, "ckptq") as tmps:
        for pl, tmp in zip(planned, tmps):
            format.write(tmp, pl.skeleton, pl.stored, pl.meta, force=True, on_tensor=on_tensor)


def converted_meta(path: str) -> dict:
    """The ``ckptq.info`` of a converted file; InputError unless convert wrote it from a DeepSpeed file."""
    conv = tree.Converted(path, verify=False)
    meta = dict(conv.info)
    conv.close()
    if not isinstance(meta.get(INFO_KEY), dict):
        raise InputError(f"{path} was not converted from a DeepSpeed ZeRO optimizer file; "
                         "`ckptq expand` of it writes an ordinary torch.save file (rename it first)")
    return meta


def report(source: str, outputs: list[str], sources: list[str], planned: list[Planned], seconds: float) -> dict:
    """The fields of ``pipeline.ConvertReport``."""
    return {"source": source, "outputs": outputs, "source_bytes": sum(os.path.getsize(p) for p in sources),
            "output_bytes": sum(os.path.getsize(p) for p in outputs), "optimizers": len(outputs),
            "quantized": sum(pl.quantized for pl in planned), "kept_small": sum(pl.kept_small for pl in planned),
            "warnings": [w for pl in planned for w in pl.warnings], "seconds": seconds}
