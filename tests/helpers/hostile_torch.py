"""Hostile torch.save files: a seeded campaign over the zip records (cut, extended, doubled, aliased), the
pickled state of the objects inside, and tensors whose views repeat their bytes. Every trial runs
``info``, ``convert`` and ``expand`` (and ``convert --bits 4`` of a ckptq file holding the same object);
what must never happen: a traceback, a hang, an output that no input bytes back (larger than the
input's bytes, plus the skeleton's overhead), or silently wrong data (a record that does not hold its
storage, read as if it did). Run as a script for figures: ``python -m tests.helpers.hostile_torch [trials] [seed]``.
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import struct
import sys
import zipfile

import torch

import ckptq
from tests.helpers.hostile import Shadowed, trial_outcome

TORCH_KINDS = ("records", "shadow", "views")
_OVERHEAD = 256 << 10  # a converted or expanded file's own bytes beyond its tensors' (skeleton, codebooks)


def clean_object(seed: int = 0, quantized: bool = False) -> dict:
    """A nanoGPT-like checkpoint: a state dict with ``_metadata``, AdamW state of two parameters whose
    moments convert stores 8-bit (or, ``quantized``, AdamW8bit's own 8-bit state)."""
    from ckptq.optim import AdamW8bit

    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 128))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    opt = (AdamW8bit if quantized else torch.optim.AdamW)(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 128, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": 2}


def _records(path: str) -> list[zipfile.ZipInfo]:
    with zipfile.ZipFile(path) as z:
        return [i for i in z.infolist() if "/data/" in i.filename]


def _rewrite_zip(path: str, edit) -> None:
    """Write the archive at ``path`` again, each record through ``edit(info, data)`` -> [(info, data, compress)]."""
    with zipfile.ZipFile(path) as z:
        entries = [(i, z.read(i.filename)) for i in z.infolist()]
    with open(path, "wb") as f, zipfile.ZipFile(f, "w") as out:
        for info, data in entries:
            for new_info, new_data, compress in edit(info, data):
                new_info.compress_type = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
                out.writestr(new_info, new_data)


def _alias_records(path: str, rng: random.Random) -> str:
    """Point one data record's directory entry at another record of the same size (one set of bytes,
    two storages)."""
    records = _records(path)
    by_size = collections.defaultdict(list)
    for r in records:
        by_size[r.file_size].append(r)
    pairs = [rs for rs in by_size.values() if len(rs) >= 2]
    if not pairs:
        return _record_edit(path, rng, "truncate")
    a, b = rng.sample(rng.choice(pairs), 2)
    raw = bytearray(open(path, "rb").read())
    with zipfile.ZipFile(path) as z:
        at = z.start_dir
        for info in z.infolist():  # the central directory: 46 bytes per entry, then name, extra, comment
            if info.filename == b.filename:
                break
            n, m, k = struct.unpack_from("<HHH", raw, at + 28)
            at += 46 + n + m + k
    assert raw[at:at + 4] == b"PK\x01\x02"
    struct.pack_into("<I", raw, at + 42, a.header_offset)
    open(path, "wb").write(bytes(raw))
    return f"{b.filename} aliased to {a.filename}"


def _record_edit(path: str, rng: random.Random, how: str | None = None) -> str:
    how = how or rng.choice(["truncate", "extend", "compress", "duplicate", "drop", "alias"])
    if how == "alias":
        return _alias_records(path, rng)
    target = rng.choice(_records(path)).filename

    def edit(info, data):
        if info.filename != target:
            return [(info, data, False)]
        if how == "truncate":
            return [(info, data[: rng.randrange(len(data))], False)]
        if how == "extend":
            return [(info, data + bytes(rng.randrange(1, 4096)), False)]
        if how == "compress":
            return [(info, data, True)]
        if how == "duplicate":
            return [(info, data, False), (zipfile.ZipInfo(info.filename), bytes(len(data)), False)]
        return []  # drop

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name it is asked to write
        _rewrite_zip(path, edit)
    return f"{target}: {how}"


_METHODS = ["items", "keys", "values", "get", "__iter__", "__len__", "copy", "pop", "setdefault", "update"]
_TENSOR_METHODS = ["numel", "element_size", "view", "detach", "contiguous", "reshape", "float",
                   "cpu", "to", "dim", "is_contiguous"]  # methods torch.save itself does not call


def _shadow(obj: dict, rng: random.Random) -> str:
    """Give a state dict (or a tensor in it) attributes that shadow its methods."""
    if rng.random() < 0.5:
        where = rng.choice(["model", "optimizer"])
        name = rng.choice(_METHODS)
        obj[where] = Shadowed(list(obj[where].items()), {name: rng.choice([set, list, dict, 0, "x"]),
                                                          "_metadata": collections.OrderedDict()})
        return f"{where} pickled as an OrderedDict shadowing {name}"
    key = rng.choice(sorted(obj["model"]))
    name = rng.choice(_TENSOR_METHODS)
    t = obj["model"][key].clone()
    t.__dict__[name] = rng.choice([0, "x", None, torch.zeros(1)])
    obj["model"][key] = t
    return f"model[{key}] with attribute {name}"


def _repeating_view(rng: random.Random, like: torch.Tensor) -> torch.Tensor:
    numel = rng.choice([like.numel(), 2**20, 2**28, 2**40])
    if rng.random() < 0.6:
        return torch.zeros(1, dtype=like.dtype).expand(numel)
    n = min(numel, 2**31)  # overlapping strides: rows that start one element apart
    side = int(n**0.5)
    return torch.arange(2 * side, dtype=torch.float32).to(like.dtype).as_strided((side, side), (1, 1))


def _views(obj: dict, rng: random.Random) -> str:
    """A moment, or an 8-bit state's codes or scales, replaced by a view that repeats its bytes."""
    state = obj["optimizer"]["state"]
    pid = rng.choice(sorted(state))
    key = rng.choice(["exp_avg", "exp_avg_sq"])
    value = state[pid][key]
    if isinstance(value, dict):  # an 8-bit state: its codes or scales
        part = rng.choice(["codes", "absmax"])
        value[part] = _repeating_view(rng, value[part])
        return f"state {pid} {key}.{part} -> {tuple(value[part].shape)} view"
    state[pid][key] = _repeating_view(rng, value)
    return f"state {pid} {key} -> {tuple(state[pid][key].shape)} view"


def _bounded(call, src: str, outputs: list[str]):
    """Run ``call``; AssertionError if what it wrote holds more bytes than ``src`` backs."""
    def run():
        try:
            call()
        finally:
            limit = 2 * os.path.getsize(src) + _OVERHEAD
            for out in outputs:
                size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out)) if os.path.isdir(out) \
                    else os.path.getsize(out) if os.path.exists(out) else 0
                assert size <= limit, f"{os.path.basename(out)}: {size} bytes from an input of {os.path.getsize(src)}"
    return run


def _calls(path: str, work: str, also_ckptq: bool, obj) -> list:
    q8, fp32, q4 = (os.path.join(work, n) for n in ("out.q8.safetensors", "out.fp32.pt", "re.q4.safetensors"))
    for p in (q8, fp32, q4):
        if os.path.exists(p):
            os.unlink(p)
    calls = [lambda: ckptq.info(path),
             _bounded(lambda: ckptq.convert(path, q8, force=True), path, [q8]),
             _bounded(lambda: ckptq.expand(q8 if os.path.exists(q8) else path, fp32, force=True), path, [fp32])]
    if also_ckptq:  # the same object as a ckptq file (its writer keeps views as views), re-encoded at 4 bits
        saved = os.path.join(work, "saved.safetensors")
        try:
            ckptq.save(obj, saved, force=True)
        except ckptq.errors.CkptqError:
            return calls
        calls.append(_bounded(lambda: ckptq.convert(saved, q4, bits=4, force=True), saved, [q4]))
    return calls


def torch_campaign(trials: int, seed: int, workdir: str) -> dict:
    """``trials`` crafted torch.save files per kind (half with fp32 Adam state, half with 8-bit state):
    {kind: Counter of outcomes, "examples": [what must not happen]}."""
    rng = random.Random(seed)
    marker = os.path.join(workdir, "RAN")
    results, examples = {}, []
    for kind in TORCH_KINDS:
        counts = collections.Counter()
        for i in range(trials):
            quantized = rng.random() < 0.5
            obj = clean_object(i, quantized)
            path = os.path.join(workdir, "trial.pt")
            what, also_ckptq = "", False
            if kind == "shadow":
                what = _shadow(obj, rng)
            elif kind == "views":
                what, also_ckptq = _views(obj, rng), True
            torch.save(obj, path)
            if kind == "records":
                what = _record_edit(path, rng)
            outcome, detail = trial_outcome(_calls(path, workdir, also_ckptq, obj), marker)
            counts[outcome] += 1
            if outcome not in ("refused", "loaded") or (kind != "views" and outcome != "refused"):
                examples.append(f"torch {kind}: {what}: {outcome}: {detail}")
        results[kind] = counts
    results["examples"] = examples
    return results


if __name__ == "__main__":
    import json
    import tempfile

    work = tempfile.mkdtemp(prefix="ckptq-torch-campaign-")
    n, s = (int(a) for a in (sys.argv[1:] + ["50", "2026"])[:2])
    print(json.dumps(torch_campaign(n, s, work), indent=1))
    shutil.rmtree(work, ignore_errors=True)
