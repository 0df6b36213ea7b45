"""Hostile-input helpers: small plain / compressed / sharded ckptq file sets, and a seeded campaign that
flips one bit (or truncates) somewhere in a set and classifies what the readers do.

Outcomes of one trial: "refused" (a one-line CkptqError), "same" (loads, bit-identical to the
original: the damage provably changed nothing), "wrong" (loads, differs: silently wrong data),
"traceback" (any other exception). Run as a script for figures:
``python -m tests.helpers.hostile [trials per kind] [seed]``.
"""

from __future__ import annotations

import collections
import copy
import os
import pickle
import random
import shutil
import struct
import sys

import torch

import ckptq
from ckptq.codec import codebooks, ops
from ckptq import format
from ckptq.errors import CkptqError
from tests.format.test_format import assert_same
from tests.helpers.paths import FIXTURES

KINDS = ("plain", "compressed", "sharded")


def _q(x, signed, transform, block_size=64):
    qmap = codebooks.dynamic_map(signed)
    codes, absmax = ops.quantize_blockwise(x, qmap, block_size, transform)
    return {"ckptq": "blockwise", "bits": 8, "codes": codes, "absmax": absmax, "qmap": qmap,
            "block_size": block_size, "transform": transform, "shape": tuple(x.shape), "dtype": "float32"}


def small_object(seed: int = 0):
    """A checkpoint in miniature: tied and viewed weights, an 8-bit Adam state with a ratio pair,
    exact small states, scalars of every kind, and a tensor big enough to compress."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(24, 16, generator=g)
    v = (torch.randn(20, 15, generator=g) * 1e-2) ** 2
    m = torch.randn(20, 15, generator=g) * v.sqrt()
    ratio = _q(m / (v.sqrt() + 1e-9), True, "none") | {"transform": "ratio", "eps": 1e-9, "divisor": "exp_avg_sq"}
    model = collections.OrderedDict([("wte", w), ("head", w), ("pos", torch.arange(6).view(2, 3).t()),
                                     ("bias", torch.zeros(8, dtype=torch.bfloat16)),
                                     ("big", torch.randn(1024, generator=g).round(decimals=1))])
    model._metadata = collections.OrderedDict([("", {"version": 1})])
    state = {0: {"step": torch.tensor(7.0), "exp_avg": ratio, "exp_avg_sq": _q(v, False, "sqrt")},
             1: {"step": torch.tensor(7.0), "exp_avg": _q(m, True, "none"), "exp_avg_sq": torch.full((3,), 0.5)}}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False, "params": [0, 1]}]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}, "iter_num": 7,
            "config": {"name": "x", "nan": float("nan"), "dev": torch.device("cpu"), "dt": torch.float16,
                       "size": torch.Size([2, 3]), "t": (1, None, True)}}


def make_set(folder: str, kind: str) -> str:
    """Write the small object as ``kind`` into ``folder``; returns the path to load."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "m.safetensors")
    comp = format.Compression(3, 1) if kind == "compressed" else None
    paths = ckptq.save(small_object(), path, compression=comp, max_shard_size=4000 if kind == "sharded" else None)
    return paths[0]


def header_span(path: str) -> int:
    """Bytes of a file that are not tensor data (the whole file for an index)."""
    data = open(path, "rb").read(8)
    if path.endswith(".json") or len(data) < 8:
        return os.path.getsize(path)
    return 8 + struct.unpack("<Q", data)[0]


def damage(folder: str, rng: random.Random, truncate: bool) -> str:
    """Flip one bit (80% in headers/indexes) or truncate one file of the set; returns what was done."""
    files = sorted(f for f in os.listdir(folder) if not f.startswith("."))
    name = rng.choice(files)
    path = os.path.join(folder, name)
    size = os.path.getsize(path)
    if truncate:
        cut = rng.randrange(size)
        os.truncate(path, cut)
        return f"{name} truncated to {cut}"
    span = header_span(path)
    pos = rng.randrange(span) if rng.random() < 0.8 or span == size else rng.randrange(span, size)
    bit = rng.randrange(8)
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ (1 << bit)]))
    return f"{name} byte {pos} bit {bit}"


def rewrite(path: str, edit, reseal: bool = True) -> None:
    """Edit a file's whole header (``edit(header)`` in place, metadata under ``__metadata__``) and seal
    it again as a writer would: what a deliberately crafted file looks like."""
    import json

    from ckptq.format import integrity

    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    meta = header.get("__metadata__", {})
    sealing = reseal and integrity.KEY in meta
    if sealing:
        meta[integrity.KEY] = integrity.PLACEHOLDER
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    raw = bytearray(struct.pack("<Q", len(head)) + head)
    if sealing:
        integrity.seal(raw)
    open(path, "wb").write(bytes(raw) + data[8 + n :])


def edit_skeleton(path: str, edit) -> None:
    """``edit(skeleton)`` returns the new skeleton (a JSON value, or a str of JSON text)."""
    import json

    def go(header):
        meta = header["__metadata__"]
        new = edit(json.loads(meta["ckptq.skeleton"]))
        meta["ckptq.skeleton"] = new if isinstance(new, str) else json.dumps(new)

    rewrite(path, go)


def write_index(path: str, index: dict) -> None:
    """Write an index sealed as ckptq would (a crafted index carries a valid checksum)."""
    import json

    from ckptq.format import integrity

    index["metadata"][integrity.KEY] = integrity.PLACEHOLDER
    raw = bytearray(json.dumps(index, indent=1, separators=(",", ":")).encode())
    integrity.seal(raw)
    open(path, "wb").write(bytes(raw))


class CraftingPickler(pickle._Pickler):
    """Writes a DeepSpeed stand-in class as whatever name it carries, unchecked, and any other global as
    Python would: what a crafted file holds (``ckptq.deepspeed.objects.Pickler`` refuses both)."""

    def save_global(self, obj, name=None):
        ref = getattr(obj, "_ckptq_global", "") if isinstance(obj, type) else ""
        if not ref:
            return super().save_global(obj, name)
        module, _, qualname = ref.rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


def _same(a, b) -> bool:
    try:
        assert_same(a, b)
        return True
    except AssertionError:
        return False


def _expand_and_load(path: str, out: str):
    ckptq.expand(path, out, force=True)
    return torch.load(out, weights_only=True)


def classify(path: str, reference, expanded_reference, scratch: str) -> tuple[str, str]:
    """(outcome, detail) for loading ``path`` with ckptq.load(dequantize=True) and expand + torch.load."""
    for fn, ref in ((lambda: ckptq.load(path, dequantize=True), reference),
                    (lambda: _expand_and_load(path, os.path.join(scratch, "e.pt")), expanded_reference)):
        try:
            got = fn()
        except CkptqError as e:
            msg = str(e)
            if "\n" in msg:
                return "traceback", "multi-line message: " + msg[:200]
            return "refused", msg
        except Exception as e:  # noqa: BLE001 - this is what the campaign measures
            return "traceback", f"{type(e).__name__}: {str(e)[:200]}"
        if ref is not None and not _same(ref, got):
            return "wrong", "loads with different values"
    return "same", ""


def campaign(trials: int, seed: int, kinds=KINDS, truncate_every: int = 5, workdir: str | None = None) -> dict:
    """``trials`` damaged copies per kind; returns {kind: Counter of outcomes, "examples": [...]}."""
    import tempfile

    rng = random.Random(seed)
    work = workdir or tempfile.mkdtemp(prefix="ckptq-campaign-")
    results, examples = {}, []
    for kind in kinds:
        clean = os.path.join(work, kind, "clean")
        entry = os.path.basename(make_set(clean, kind))
        reference = ckptq.load(os.path.join(clean, entry), dequantize=True)
        expanded_reference = _expand_and_load(os.path.join(clean, entry), os.path.join(work, kind, "ref.pt"))
        counts = collections.Counter()
        for i in range(trials):
            trial = os.path.join(work, kind, "trial")
            shutil.rmtree(trial, ignore_errors=True)
            shutil.copytree(clean, trial)
            what = damage(trial, rng, truncate=(i % truncate_every == truncate_every - 1))
            outcome, detail = classify(os.path.join(trial, entry), reference, expanded_reference, work)
            counts[outcome] += 1
            if outcome in ("wrong", "traceback"):
                examples.append(f"{kind}: {what}: {outcome}: {detail}")
        results[kind] = counts
    if workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    results["examples"] = examples
    return results


def resealed_campaign(trials: int, seed: int, workdir: str) -> dict:
    """Flip one bit inside the skeleton or tensor table and seal the header again: a crafted file, which
    the checksum cannot catch. Such a file may legitimately decode to other values, so this counts only
    tracebacks (which must be none): {"refused": n, "loaded": n, "examples": [tracebacks]}."""
    rng = random.Random(seed)
    counts, examples = collections.Counter(), []
    for kind in ("plain", "compressed"):
        clean = os.path.join(workdir, kind, "clean")
        entry = make_set(clean, kind)
        for _ in range(trials):
            trial = os.path.join(workdir, kind, "resealed.safetensors")
            shutil.copy(entry, trial)
            key = rng.choice(["ckptq.skeleton", "ckptq.tensors"])

            def flip(header):
                text = bytearray(header["__metadata__"][key].encode())
                text[rng.randrange(len(text))] ^= 1 << rng.randrange(7)
                header["__metadata__"][key] = text.decode("utf-8", "replace")

            rewrite(trial, flip)
            outcome, detail = classify(trial, None, None, workdir)
            counts["traceback" if outcome == "traceback" else "refused" if outcome == "refused" else "loaded"] += 1
            if outcome == "traceback":
                examples.append(f"{kind} {key}: {detail}")
    return {**counts, "examples": examples}


_ODD = [None, [], {}, "x", -1, 0, 2**70, 1.5, float("inf"), True, [1], {"a": 1}, [[1, 2]], "float32", "F32"]


def _json_paths(value, path=()):
    """Every path into a JSON value (dict keys and list indexes)."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _json_paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _json_paths(v, path + (i,))


def _mutate(value, rng: random.Random):
    """Replace one randomly chosen sub-value of a JSON value by an odd one (or drop a dict key)."""
    import copy

    paths = list(_json_paths(value))[1:]
    if not paths:
        return copy.deepcopy(rng.choice(_ODD))
    *parent, last = rng.choice(paths)
    node = value
    for p in parent:
        node = node[p]
    if isinstance(node, dict) and rng.random() < 0.2:
        del node[last]
    else:
        node[last] = copy.deepcopy(rng.choice(_ODD))  # fresh: the campaign must not alter _ODD
    return value


def mutation_campaign(trials: int, seed: int, workdir: str) -> dict:
    """Replace one value anywhere in the header JSON, skeleton or tensor table by one of another type
    (or drop a key), and seal again: crafted structure. Counts tracebacks only (they must be none)."""
    import json

    rng = random.Random(seed)
    counts, examples = collections.Counter(), []
    for kind in ("plain", "compressed"):
        entry = make_set(os.path.join(workdir, kind, "clean"), kind)
        for _ in range(trials):
            trial = os.path.join(workdir, kind, "mutated.safetensors")
            shutil.copy(entry, trial)
            where = rng.choice(["header", "ckptq.skeleton", "ckptq.tensors"])

            def edit(header):
                if where == "header":
                    key = rng.choice(sorted(k for k in header if k != "__metadata__"))
                    box = _mutate({"v": header[key]}, rng)
                    if "v" in box:
                        header[key] = box["v"]
                    else:
                        del header[key]
                else:
                    meta = header["__metadata__"]
                    meta[where] = json.dumps(_mutate(json.loads(meta[where]), rng))

            rewrite(trial, edit)
            outcome, detail = classify(trial, None, None, workdir)
            counts["traceback" if outcome == "traceback" else "refused" if outcome == "refused" else "loaded"] += 1
            if outcome == "traceback":
                examples.append(f"{kind} {where}: {detail}")
    _mutate_indexes(trials, rng, workdir, counts, examples)
    return {**counts, "examples": examples}


def _mutate_indexes(trials: int, rng: random.Random, workdir: str, counts, examples) -> None:
    """The same for a sharded set's index (its JSON, skeleton or shard checksums), sealed again."""
    import json

    clean = os.path.join(workdir, "sharded", "clean")
    name = os.path.basename(make_set(clean, "sharded"))
    for _ in range(trials):
        trial = os.path.join(workdir, "sharded", "mutated")
        shutil.rmtree(trial, ignore_errors=True)
        shutil.copytree(clean, trial)
        index = json.load(open(os.path.join(trial, name)))
        key = rng.choice([None, "ckptq.skeleton", "ckptq.shards"])
        if key is None:
            index = _mutate(index, rng)
        else:
            index["metadata"][key] = json.dumps(_mutate(json.loads(index["metadata"][key]), rng))
        if isinstance(index, dict) and isinstance(index.get("metadata"), dict):
            write_index(os.path.join(trial, name), index)
        else:
            open(os.path.join(trial, name), "w").write(json.dumps(index))
        outcome, detail = classify(os.path.join(trial, name), None, None, workdir)
        counts["traceback" if outcome == "traceback" else "refused" if outcome == "refused" else "loaded"] += 1
        if outcome == "traceback":
            examples.append(f"sharded index {key}: {detail}")


# --- DCP folders and DeepSpeed checkpoints ----------------------------------------------------------------
# Outcomes of one trial, over every command that reads the input (info, convert, expand): "refused" (each
# a one-line CkptqError), "loaded" (some succeeded: damaged data bytes carry no checksum in DCP or
# DeepSpeed files), and what must never happen: "ran code" (a marker folder appeared), "wrote unsafe" (an
# expanded DeepSpeed file names a global outside DeepSpeed's list), "hung", "traceback".

class Runs:
    """Unpickling it creates the folder ``path`` through ``how``: the proof that a pickle ran code."""

    def __init__(self, path: str, how: str = "mkdir"):
        self.path, self.how = str(path), how

    def __reduce__(self):
        code = f"__import__('os').mkdir({self.path!r})"
        return {"mkdir": (os.mkdir, (self.path,)), "exec": (exec, (code,)), "eval": (eval, (code,)),
                "system": (os.system, (f"mkdir '{self.path}'",))}[self.how]


def nested(depth: int, inner=None) -> list:
    out = [] if inner is None else [inner]
    for _ in range(depth - 1):
        out = [out]
    return out


def dcp_folder(path, lr=1e-3, quantized: bool = False, edit=None):
    """A one-process DCP folder of torch AdamW state: two moments convert stores 8-bit (``quantized``:
    stored 8-bit already, as ``ckptq.dcp.LowBitSavePlanner`` stores them, after ``edit(the 8-bit state)``), ``lr``
    saved as a byte entry."""
    import torch.distributed.checkpoint as dcp
    from ckptq.dcp.planners import quantized_copy

    g = torch.Generator().manual_seed(0)
    m, v = torch.randn(16, 256, generator=g) * 1e-3, torch.rand(16, 256, generator=g) * 1e-6
    groups = [{"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": ["w"]}]
    sd = {"model": {"w": torch.randn(16, 256, generator=g)},
          "optimizer": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": m, "exp_avg_sq": v}}, "param_groups": groups}}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))  # a deeply nested lr pickles only with a deeper stack
    try:
        if quantized:  # what LowBitSavePlanner.set_up_planner does, with a chance to craft the result
            sd = quantized_copy(sd, min_size=4096)
            if edit:
                edit(sd["optimizer"]["state"]["w"])
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    finally:
        sys.setrecursionlimit(limit)
    return path


class _Hung(Exception):
    pass


def _alarm(*_):
    raise _Hung()


def trial_outcome(calls, marker: str, seconds: int = 60) -> tuple[str, str]:
    """(outcome, detail) of running ``calls`` (each under a time limit) on one damaged input."""
    import signal

    refusals, old = 0, signal.signal(signal.SIGALRM, _alarm)
    try:
        for call in calls:
            signal.alarm(seconds)
            try:
                call()
            except _Hung:
                return "hung", ""
            except CkptqError as e:
                if "\n" in str(e):
                    return "traceback", "multi-line message: " + str(e)[:200]
                refusals += 1
            except Exception as e:  # noqa: BLE001 - this is what the campaign measures
                return "traceback", f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                signal.alarm(0)
            if os.path.exists(marker):
                return "ran code", ""
    finally:
        signal.signal(signal.SIGALRM, old)
    return ("refused" if refusals == len(calls) else "loaded"), ""


def _flip_or_cut(files: list[str], rng: random.Random, cut: bool) -> str:
    path = rng.choice(files)
    size = os.path.getsize(path)
    if cut:
        os.truncate(path, rng.randrange(size))
        return f"{os.path.basename(path)} truncated"
    pos, bit = rng.randrange(size), rng.randrange(8)
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ (1 << bit)]))
    return f"{os.path.basename(path)} byte {pos} bit {bit}"


_SIZES = [torch.Size([-1, 256]), torch.Size([2**40]), torch.Size([2**25, 2**24]), torch.Size([16, 512]),
          torch.Size([]), torch.Size([0]), torch.Size([8, 256]), torch.Size([16]), torch.Size([16, 256, 1])]
_ODD_DCP = _ODD + _SIZES + ["/etc/passwd", "../x.distcp", ".", "sub/x", "__0_0.distcp", ["stream.zstd"],
                            torch.float64, torch.int8, torch.bool, torch.strided, (1, 2), {"k": [1, {2: 3}]}]


def _metadata_slots(md) -> list[tuple]:
    """(holder, field) pairs of a DCP Metadata that a crafted file can set: its own fields, each entry,
    each tensor's size, chunks and dtype, each chunk's offsets and sizes, each stored item's location."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = [(md, f) for f in ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")]
    for key, m in md.state_dict_metadata.items():
        out.append((md.state_dict_metadata, key))
        if isinstance(m, TensorStorageMetadata):
            out += [(m, "size"), (m, "chunks"), (m, "properties"), (m.properties, "dtype")]
            out += [(c, f) for c in m.chunks for f in ("offsets", "sizes")]
    for index, info in md.storage_data.items():
        out += [(md.storage_data, index)] + [(info, f) for f in ("relative_path", "offset", "length",
                                                                 "transform_descriptors")]
    return out


def _set(holder, field, value) -> None:
    if isinstance(holder, dict):
        holder[field] = value
    else:
        setattr(holder, field, value)


def edit_metadata(folder: str, edit) -> None:
    """Rewrite a DCP folder's ``.metadata`` after ``edit(metadata)`` (plain pickle: for our own files only)."""
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)  # the campaign's own clean file
    edit(md)
    with open(path, "wb") as f:
        pickle.dump(md, f)


_GLOBALS = ["posix.system", "builtins.eval", "builtins.getattr", "torch.load", "torch.distributed.checkpoint.metadata.os",
            "torch.distributed.checkpoint.filesystem.pickle", "torch.serialization.load", "pathlib.Path.write_text",
            "collections.OrderedDict.fromkeys", "torch.Size\nposix", "torch.distributed.checkpoint.metadata.Metadata2"]


def _crafted_metadata(folder: str, rng: random.Random, marker: str) -> str:
    if rng.random() < 0.3:  # a bare global, called with no arguments: GLOBAL (text lines) or STACK_GLOBAL
        name = rng.choice(_GLOBALS + ["posix\nsystem.x", "torch.distributed.checkpoint.metadata.Metadata\n"])
        module, _, attr = name.rpartition(".")
        text = [s.encode() for s in (module, attr)]
        op = b"\x80\x02c" + b"\n".join(text) + b"\n" if rng.random() < 0.5 else \
            b"\x80\x04" + b"".join(b"\x8c" + bytes([len(t)]) + t for t in text) + b"\x93"
        with open(os.path.join(folder, ".metadata"), "wb") as f:
            f.write(op + b")R.")
        return f"GLOBAL {name!r}"
    how = rng.choice(["mkdir", "exec", "eval", "system"])
    where = []
    edit_metadata(folder, lambda md: where.append(_put(md, rng, Runs(marker, how))))
    return f"{how} at {where[0]}"


def _put(md, rng: random.Random, value) -> str:
    holder, field = rng.choice(_metadata_slots(md))
    _set(holder, field, value)
    return f"{type(holder).__name__}.{str(field)[:60]}"


def _fifo(folder: str, rng: random.Random) -> str:
    """A data file, a symlink to one, or a companion in a subfolder replaced by a FIFO."""
    how = rng.choice(["data", "symlink", "companion"])
    data = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))
    if how == "companion":
        os.makedirs(os.path.join(folder, "extra"), exist_ok=True)
        os.mkfifo(os.path.join(folder, "extra", "pipe"))
    elif how == "data":
        os.unlink(os.path.join(folder, data[0]))
        os.mkfifo(os.path.join(folder, data[0]))
    else:
        os.unlink(os.path.join(folder, data[0]))
        os.mkfifo(os.path.join(folder, "pipe"))
        os.symlink("pipe", os.path.join(folder, data[0]))
    return f"FIFO as {how}"


def _dcp_damage(kind: str, trial: str, rng: random.Random, marker: str, quantized: bool) -> str:
    files_ = sorted(os.path.join(trial, n) for n in os.listdir(trial))
    if kind in ("flip", "truncate"):
        return _flip_or_cut(files_, rng, kind == "truncate")
    if kind == "metadata":
        where = []
        value = rng.choice(_ODD_DCP)
        edit_metadata(trial, lambda md: where.append(_put(md, rng, copy.deepcopy(value))))
        return f"{where[0]} = {value!r:.60}"
    if kind == "pickle":
        return _crafted_metadata(trial, rng, marker)
    if kind == "fifo":
        return _fifo(trial, rng)
    if kind == "shadow":
        return _shadowed_metadata(trial, rng)
    if kind == "qstate":  # an 8-bit state's scalars or parts replaced by odd values
        shutil.rmtree(trial)
        where = []

        def edit(pstate):
            role = rng.choice(["exp_avg", "exp_avg_sq"])
            field = rng.choice(sorted(pstate[role]))
            pstate[role] = {**pstate[role], field: copy.deepcopy(rng.choice(_ODD_DCP + [torch.zeros(3), "nope"]))}
            where.append(f"{role}.{field} = {pstate[role][field]!r:.40}")
        dcp_folder(trial, quantized=True, edit=edit)
        return where[0]
    shutil.rmtree(trial)  # "entry": a byte entry that runs code or nests too deep
    lr = Runs(marker, rng.choice(["mkdir", "exec", "eval", "system"])) if rng.random() < 0.5 \
        else nested(rng.randrange(101, 3000))
    dcp_folder(trial, lr=lr, quantized=quantized)
    return f"lr = {type(lr).__name__}"


class Shadowed:
    """Pickles as an OrderedDict holding ``items`` (real entries, written by SETITEMS) with instance state
    ``state`` (written by BUILD afterwards): what a crafted file holds. Setting the attribute on a real
    OrderedDict would not do: pickling it calls the shadowed ``items`` itself."""

    def __init__(self, items, state):
        self.items_, self.state = list(items), state

    def __reduce_ex__(self, protocol):
        return (collections.OrderedDict, (), self.state, None, iter(self.items_))


def _shadowed_metadata(folder: str, rng: random.Random) -> str:
    """Stored items pointed outside the folder, behind state that hides them from a check that iterates:
    a container pickled as an OrderedDict whose instance state shadows one of its methods, or a metadata
    object carrying attributes beyond its fields."""
    target = rng.choice(["../victim/__0_0.distcp", "/etc/passwd", "__0_0.distcp"])
    where = []

    def edit(md):
        for info in md.storage_data.values():
            info.relative_path = target
        if rng.random() < 0.6:
            field = rng.choice(["storage_data", "state_dict_metadata", "planner_data"])
            name = rng.choice(["items", "keys", "values", "get", "__iter__", "__len__", "__contains__", "_metadata"])
            setattr(md, field, Shadowed((getattr(md, field) or {}).items(),
                                        {name: rng.choice([set, list, dict, frozenset, 0, "x"])}))
            where.append(f"{field} shadowing {name}")
        else:
            holders = [md, *md.storage_data, *md.storage_data.values()]
            holders += [c for m in md.state_dict_metadata.values() for c in [m, *getattr(m, "chunks", [])]]
            holder = rng.choice(holders)
            holder.__dict__[rng.choice(["relative_path_", "items", "fqn2", "__dict__x"])] = target
            where.append(f"{type(holder).__name__} with extra state")
    edit_metadata(folder, edit)
    return f"{where[0]}, data at {target}"


DCP_KINDS = ("flip", "truncate", "metadata", "pickle", "entry", "qstate", "fifo", "shadow")


def dcp_campaign(trials: int, seed: int, workdir: str) -> dict:
    """``trials`` damaged or crafted DCP folders per kind (half plain, half 8-bit): {kind: Counter,
    "examples": [what must not happen]}."""
    rng = random.Random(seed)
    clean = {q: dcp_folder(os.path.join(workdir, f"clean-{q}"), quantized=q) for q in (False, True)}
    marker, trial, out = (os.path.join(workdir, n) for n in ("RAN", "trial", "out"))
    results, examples = {}, []
    for kind in DCP_KINDS:
        counts = collections.Counter()
        for _ in range(trials):
            quantized = rng.random() < 0.5
            shutil.rmtree(trial, ignore_errors=True)
            shutil.copytree(clean[quantized], trial)
            what = _dcp_damage(kind, trial, rng, marker, quantized)
            outcome, detail = trial_outcome([lambda: ckptq.info(trial), lambda: ckptq.convert(trial, out, force=True),
                                             lambda: ckptq.expand(trial, out, force=True)], marker)
            counts[outcome] += 1
            if outcome not in ("refused", "loaded"):
                examples.append(f"dcp {kind}: {what}: {outcome}: {detail}")
            shutil.rmtree(marker, ignore_errors=True)
        results[kind] = counts
    results["examples"] = examples
    return results


ZERO = os.path.join(FIXTURES, "zero", "zero2")  # 2 ranks, ZeRO stage 2
_NAMES = ["posix.system", "builtins.eval", "deepspeed.runtime.engine.DeepSpeedEngine", "deepspeed.runtime.zero.config",
          "deepspeed.runtime.zero.config.ZeroStageEnum\nposix\nsystem", "deepspeed.utils.tensor_fragment.fragment_addres",
          "deepspeed.runtime.fp16.loss_scaler.LossScaler ", "deepspeed..x", "torch.load", "argparse.Namespace"]


def _odd_value(rng: random.Random):
    from ckptq.deepspeed import objects as zero_pickle

    return rng.choice(_ODD + [torch.device("cpu"), torch.Size([2]), {1, 2}, bytearray(b"x"), complex(1, 2),
                              {"not a name": 1}, zero_pickle._standin("deepspeed.runtime.zero.config.ZeroStageEnum")(2),
                              (torch.zeros(2),), nested(rng.randrange(90, 2000))])


def _standins(obj, found: list) -> list:
    from ckptq.deepspeed import objects as zero_pickle

    if isinstance(obj, zero_pickle._Standin):
        found.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _standins(v, found)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _standins(v, found)
    return found


def _crafted_rank_file(kind: str, path: str, rng: random.Random) -> str:
    """A rank file saved again with odd DeepSpeed objects, foreign globals or deep nesting in it."""
    from ckptq.deepspeed import objects as zero_pickle
    from ckptq.format import torch_stream

    obj = zero_pickle.load(path)
    if kind == "objects":
        target = rng.choice(_standins(obj, []))
        value = _odd_value(rng)
        field = rng.choice(["_args", "_state"])
        setattr(target, field, (value,) if field == "_args" else value)
        what = f"{target._ckptq_global}.{field} = {type(value).__name__}"
    elif kind == "globals":
        name = rng.choice(_NAMES)
        cls = zero_pickle._standin(name)
        obj["optimizer_state_dict"][rng.choice(["zero_stage", "extra"])] = cls.__new__(cls)
        what = f"global {name!r}"
    else:
        loop: list = []
        loop.append(loop)
        obj["optimizer_state_dict"]["deep"] = loop if rng.random() < 0.2 else nested(rng.randrange(101, 3000))
        what = "nesting"
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))
    try:
        torch_stream.save(obj, path + ".new", pickler=CraftingPickler)  # obj's tensors map ``path``: write beside it
    finally:
        sys.setrecursionlimit(limit)
    os.replace(path + ".new", path)
    return what


def _crafted_converted(q8: str, rng: random.Random) -> str:
    """A converted rank file whose DeepSpeed objects (MARK dicts in the skeleton) say something else,
    sealed again as a writer would."""
    import json

    from ckptq.deepspeed.objects import MARK

    what = []

    def edit(sk):
        marks = [n for n in _json_nodes(sk) if isinstance(n, dict) and "dict" in n and n["dict"][:1]
                 and n["dict"][0][0] == MARK]
        pairs = rng.choice(marks)["dict"]
        i = rng.randrange(len(pairs))
        pairs[i][1] = rng.choice([rng.choice(_NAMES), {"device": "cpu"}, {"size": [2]}, {"list": [{"dtype": "F32"}]},
                                  None, True, 7, "x", {"dict": [["a b", 1]]}, {"list": [{"float": "nan"}]}])
        what.append(f"{pairs[i][0]} = {json.dumps(pairs[i][1])[:60]}")
        return sk

    edit_skeleton(q8, edit)
    return what[0]


def _json_nodes(value):
    yield value
    if isinstance(value, dict):
        for v in value.values():
            yield from _json_nodes(v)
    elif isinstance(value, list):
        for v in value:
            yield from _json_nodes(v)


def _unsafe_outputs(save: str) -> list[str]:
    """Globals outside DeepSpeed's list in the rank files expand wrote (DeepSpeed unpickles them fully)."""
    from ckptq.deepspeed.objects import DEEPSPEED_GLOBALS

    step = os.path.join(save, "global_step3")
    return [g for n in sorted(os.listdir(step)) if n.endswith("_optim_states.pt")
            for g in torch.serialization.get_unsafe_globals_in_checkpoint(os.path.join(step, n))
            if g not in DEEPSPEED_GLOBALS]


ZERO_KINDS = ("flip", "truncate", "objects", "globals", "nesting", "latest", "converted")
_LATEST = ["..", ".", "/etc", "global_step3/..", "..\\global_step3", "global_step3\0", "", " ", "x" * 5000,
           "global_step3\n..", "../zero2/global_step3"]


def zero_campaign(trials: int, seed: int, workdir: str) -> dict:
    """``trials`` damaged or crafted DeepSpeed ZeRO checkpoints per kind (info, convert; expand of converted
    ones): {kind: Counter, "examples": [what must not happen]}."""
    rng = random.Random(seed)
    clean, conv = os.path.join(workdir, "zero-clean"), os.path.join(workdir, "zero-converted")
    shutil.copytree(ZERO, clean)
    shutil.copytree(ZERO, conv)
    ckptq.convert(conv, min_size=256)
    marker, save = os.path.join(workdir, "RAN"), os.path.join(workdir, "zero-trial")
    results, examples = {}, []
    for kind in ZERO_KINDS:
        counts = collections.Counter()
        for _ in range(trials):
            shutil.rmtree(save, ignore_errors=True)
            shutil.copytree(conv if kind == "converted" else clean, save)
            step = os.path.join(save, "global_step3")
            ranks = sorted(os.path.join(step, n) for n in os.listdir(step) if n.endswith("_optim_states.pt"))
            if kind in ("flip", "truncate"):
                what = _flip_or_cut(ranks + [os.path.join(step, "mp_rank_00_model_states.pt")], rng, kind == "truncate")
            elif kind == "latest":
                tag = rng.choice(_LATEST)
                with open(os.path.join(save, "latest"), "w") as f:
                    f.write(tag)
                what = repr(tag[:40])
            elif kind == "converted":
                for p in ranks:
                    os.unlink(p)
                what = _crafted_converted(rng.choice(sorted(p[:-3] + ".q8.safetensors" for p in ranks)), rng)
            else:
                what = _crafted_rank_file(kind, rng.choice(ranks), rng)
            calls = [lambda: ckptq.info(save, min_size=256),
                     lambda: ckptq.expand(save, force=True) if kind == "converted" else ckptq.convert(save, min_size=256, force=True)]
            outcome, detail = trial_outcome(calls, marker)
            if outcome == "loaded" and kind == "converted" and _unsafe_outputs(save):
                outcome, detail = "wrote unsafe", str(_unsafe_outputs(save))[:200]
            counts[outcome] += 1
            if outcome not in ("refused", "loaded"):
                examples.append(f"zero {kind}: {what}: {outcome}: {detail}")
        results[kind] = counts
    results["examples"] = examples
    return results


if __name__ == "__main__":  # python -m tests.helpers.hostile [trials] [seed] [files|dcp|zero]
    import tempfile

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    which = sys.argv[3] if len(sys.argv) > 3 else "files"
    with tempfile.TemporaryDirectory(prefix="ckptq-campaign-") as work:
        res = {"files": lambda: campaign(n, seed), "dcp": lambda: dcp_campaign(n, seed, work),
               "zero": lambda: zero_campaign(n, seed, work)}[which]()
    for line in res.pop("examples")[:40]:
        print(line)
    for kind, counts in res.items():
        print(kind, dict(counts))
