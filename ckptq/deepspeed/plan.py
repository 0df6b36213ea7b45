"""What convert writes for one DeepSpeed optimizer file: the Adam moments marked low-bit by the one planner
(``codec.tree.mark``: ``codec.plan``'s rules, the widths of ``--bits``), the tree flattened for the
safetensors format, and a writer for a set of such files (all or none)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .. import __version__
from ..codec import plan as codec_plan, policy, tree
from ..errors import InputError
from ..format import atomic, container
from .ranks import INFO_KEY


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
    plan: object = None  # the codec.plan.Plan it applies
    widths: dict = None  # the code width of each low-bit state, by its name


def plan_tree(obj, source: str, block_size: int, min_size: int, described: dict, bits: int = 8) -> Planned:
    """Mark the Adam moments in ``obj`` (loaded from the file ``source``) that go low-bit, in place, and
    flatten it; ``described`` goes into the file's info under ``INFO_KEY``."""
    p = tree.mark(obj, None, block_size, min_size, bits)
    moments = sum(d.tensor.numel() * d.tensor.element_size() for d in p.decisions if d.key in policy.MOMENT_KEYS)
    skeleton, stored = tree.flatten(obj)
    meta = {"created_by": f"ckptq {__version__}", "source": os.path.basename(source),
            "source_bytes": os.path.getsize(source), "block_size": block_size, "min_size": min_size, "bits": bits,
            "quantized": len(p.quantized), INFO_KEY: described | {"moment_bytes": moments},
            "stored_bytes": sum(s.nbytes for s in stored)}
    widths = {d.name: codec_plan.convert_width(d, bits) for d in p.quantized}
    return Planned(skeleton, stored, meta, len(p.quantized), len(p.kept("below min_size")), p.warnings(), moments,
                   p, widths)


def planned_bytes(pl: Planned) -> int:
    return container.planned_bytes(pl.skeleton, pl.stored, pl.meta)


def write_all(finals: list[str], planned: list[Planned], force: bool, progress=None) -> None:
    """Write each planned file to its final path: all of them, or none (temp files, renamed at the end)."""
    total, done = sum(pl.meta["stored_bytes"] for pl in planned), 0

    def on_tensor(s: tree.Stored) -> None:
        nonlocal done
        done += s.nbytes
        if progress:
            progress(done, total)

    with atomic.atomic_outputs(finals, force, "ckptq") as tmps:
        for pl, tmp in zip(planned, tmps):
            container.write(tmp, pl.skeleton, pl.stored, pl.meta, force=True, on_tensor=on_tensor)


def converted_meta(path: str) -> dict:
    """The ``ckptq.info`` of a converted file; InputError unless convert wrote it from a DeepSpeed file."""
    conv = tree.Converted(path, verify=False)
    meta = dict(conv.info)
    conv.close()
    if not isinstance(meta.get(INFO_KEY), dict):
        raise InputError(f"{path} was not converted from a DeepSpeed ZeRO optimizer file; "
                         "`ckptq expand` of it writes an ordinary torch.save file (rename it first)")
    return meta
