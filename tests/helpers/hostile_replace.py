"""What ckptq removes and replaces (signposts, ``--replace``): seeded campaigns over signpost folders and
the in-place ``--replace``, each trial ending "refused" (one ``ckptq: error:`` line, exit neither 0 nor 70,
nothing changed on disk), "handled" (the command did what it should, or after a kill the name holds a
complete checkpoint and a later run cleaned up) or "other" (what must never happen: a folder ckptq did not
write removed or replaced, a damaged original replaced, a name missing or holding a partial checkpoint,
something left behind, exit 70, a traceback).

- ``signpost``: folders carrying a ``.ckptq`` marker that says "signpost": crafted ones (a user's files
  beside it, a ``.metadata`` of other bytes, a marker whose list lies, a link), real ones that ``dcp.save``
  wrote into afterwards (accelerate saving into ``optimizer_0/`` again), and real ones, new and old (no
  file list); as the output of ``expand X -o v``, ``convert DCP -o v`` (with and without ``--force``) and of
  a framework folder's ``expand``. Crafted and overwritten ones must be refused, real ones replaced.
- ``kill``: ``convert --replace`` then ``expand --replace`` of a Lightning ``.ckpt``, a litgpt
  ``lit_model.pth``, an OLMo-core ``model_and_optim/`` and an accelerate ``optimizer_0/``, SIGKILLed right
  before and right after each rename, link, unlink, folder removal and swap on the checkpoint's folder, in
  turn (a forked child, so that each kill costs no interpreter start). After each kill the name must hold
  the old checkpoint or the new one, complete (a signpost's stored state complete beside it), and the same
  command run again must leave exactly what an uninterrupted run leaves.
- ``damage``: ``--replace`` of a ``.ckpt`` / ``.pth`` / Trainer ``optimizer.pt`` with one bit flipped in a
  data record (torch.load reads it without a word; its CRC-32 does not match), or whose name is a symbolic
  link: refused, the original and its folder as they were.

Run as a script for figures: ``python -m tests.helpers.hostile_replace [trials] [seed]``.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import shutil
import signal
import sys
import warnings
import zipfile

import torch

from click.testing import CliRunner

import ckptq
from ckptq.cli import main
from ckptq.codec import signpost
from ckptq.format import atomic, journal, torch_zip
from tests.helpers.paths import FIXTURES


def cli(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        return -1, f"{type(r.exception).__name__}: {r.exception}"
    return r.exit_code, r.output


def refusal(code: int, output: str) -> bool:
    lines = output.strip().splitlines()
    return code not in (0, 70, -1) and len(lines) == 1 and lines[0].startswith("ckptq: error: ")


def tree(root: str) -> dict:
    """{relative path: sha256 of a file, "link -> target", or "folder"} of everything under ``root``."""
    out = {}
    for folder, dirs, names in os.walk(root):
        for n in dirs + names:
            p = os.path.join(folder, n)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = f"link -> {os.readlink(p)}"
                if n in dirs:
                    dirs.remove(n)
            elif os.path.isdir(p):
                out[rel] = "folder"
            else:
                with open(p, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def _quiet():
    warnings.filterwarnings("ignore")


# --- the checkpoints --------------------------------------------------------------------------------------------

def _adamw_state(seed: int, shape=(64, 128)) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(shape[1], shape[0])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, shape[1], generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict(), opt.state_dict()


def lightning(folder: str, seed: int = 0) -> tuple[str, str]:
    """A Lightning Trainer's ``last.ckpt``: (the path to give ckptq, the name a resume reads)."""
    os.makedirs(folder)
    model, opt = _adamw_state(seed)
    path = os.path.join(folder, "last.ckpt")
    torch.save({"epoch": 0, "global_step": 2, "state_dict": model, "optimizer_states": [opt], "lr_schedulers": [],
                "loops": {}, "callbacks": {}}, path)
    return path, path


def litgpt(folder: str, seed: int = 0) -> tuple[str, str]:
    """litgpt's ``step-00000004/`` (the real fixture): its folder, and ``lit_model.pth`` in it."""
    shutil.copytree(os.path.join(FIXTURES, "litgpt", "step-00000004"), folder)
    return folder, os.path.join(folder, "lit_model.pth")


def olmo_core(folder: str, seed: int = 0) -> tuple[str, str]:
    """OLMo-core's ``step3/`` (the real fixture): its folder, and ``model_and_optim/`` in it."""
    shutil.copytree(os.path.join(FIXTURES, "olmo_core", "step3"), folder)
    return folder, os.path.join(folder, "model_and_optim")


def accelerate(folder: str, seed: int = 0) -> tuple[str, str]:
    """accelerate's ``save_state`` under FSDP: ``optimizer_0/`` (DCP) beside its RNG state."""
    import torch.distributed.checkpoint as dcp

    os.makedirs(folder)
    torch.save({"step": 1}, os.path.join(folder, "random_states_0.pkl"))
    _, opt = _adamw_state(seed)
    state = {"optimizer": {"state": {f"w{k}": v for k, v in opt["state"].items()},
                           "param_groups": [{**g, "params": [f"w{p}" for p in g["params"]]} for g in opt["param_groups"]]}}
    dcp.save(state, checkpoint_id=os.path.join(folder, "optimizer_0"), no_dist=True)
    return folder, os.path.join(folder, "optimizer_0")


LAYOUTS = {"lightning": lightning, "litgpt": litgpt, "olmo-core": olmo_core, "accelerate": accelerate}


def _digest(obj) -> str:
    """A fingerprint of loaded contents: every tensor's dtype, shape and bytes, every other value's repr."""
    h = hashlib.sha256()

    def walk(node):
        if isinstance(node, torch.Tensor):
            t = node.detach().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(node, dict):
            h.update(b"{")
            for k in sorted(node, key=str):
                h.update(str(k).encode())
                walk(node[k])
            h.update(b"}")
        elif isinstance(node, (list, tuple)):
            h.update(b"[")
            for v in node:
                walk(v)
            h.update(b"]")
        else:
            h.update(repr(node).encode())
    walk(obj)
    return h.hexdigest()


_SEEN: dict = {}  # the contents of each set of bytes already loaded (the kill trials see the same few again)


def contents(name: str) -> str | None:
    """What a resume finds at ``name``: a fingerprint of the torch.save file or DCP folder loaded whole, a
    signpost folder's message, or None (missing, or does not load: partial)."""
    if not os.path.lexists(name):
        return None
    key = json.dumps(tree(name) if os.path.isdir(name) else tree(os.path.dirname(name)).get(os.path.basename(name)),
                     sort_keys=True)
    if key not in _SEEN:
        _SEEN[key] = _loaded(name)
    return _SEEN[key]


def _loaded(name: str) -> str | None:
    try:
        if os.path.isdir(name):
            message = signpost.folder_message(name)
            if message is not None:
                return f"signpost: {message}"
            from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

            import ckptq.dcp

            state: dict = {}
            _load_state_dict(state, storage_reader=ckptq.dcp.SafeFileSystemReader(name),
                             planner=_EmptyStateDictLoadPlanner(), no_dist=True)
            return _digest(state)
        if not os.path.isfile(name):
            return None
        torch_zip.verify_crcs(name)
        return _digest(torch.load(name, weights_only=True, map_location="cpu"))
    except Exception:  # noqa: BLE001 -- a partial or missing checkpoint: what the campaign looks for
        return None


# --- signpost -------------------------------------------------------------------------------------------------

def _dcp_sources(work: str) -> tuple[str, str]:
    """(an fp32 DCP folder, its conversion) to write over the folder under test."""
    src, q8 = os.path.join(work, "fp32"), os.path.join(work, "X.q8")
    if not os.path.isdir(q8):
        accelerate(os.path.join(work, "acc-src"))
        os.rename(os.path.join(work, "acc-src", "optimizer_0"), src)
        shutil.rmtree(os.path.join(work, "acc-src"))
        ckptq.convert(src, q8)
    return src, q8


def _fake_signpost(v: str, rng: random.Random) -> tuple[str, bool]:
    """A folder at ``v`` whose marker says "signpost": (what it is, whether it is ckptq's real signpost)."""
    message = "ckptq: optimizer_0 went to optimizer_0.q8 (8-bit Adam state); for fp32: ckptq expand optimizer_0.q8 -o optimizer_0"
    how = rng.choice(["user's files", "other .metadata", "lying list", "old marker, other .metadata", "linked .metadata",
                      "marker only", "saved into", "saved into", "real", "real, old marker"])
    if how in ("user's files", "marker only"):
        os.mkdir(v)
        if how == "user's files":
            for i in range(rng.randrange(1, 4)):
                with open(os.path.join(v, rng.choice(["thesis.txt", "notes", ".metadata", "results.csv"]) + str(i)), "w") as f:
                    f.write("precious")
        with open(os.path.join(v, ".ckptq"), "w") as f:
            json.dump(rng.choice([{"kind": "signpost", "message": ""}, {"kind": "signpost", "message": message},
                                  {"created_by": "ckptq", "kind": "signpost", "message": message,
                                   "files": {".metadata": 0}}]), f)
        return how, False
    signpost.write_folder(v, message)
    marker = os.path.join(v, ".ckptq")
    if how == "other .metadata":
        with open(os.path.join(v, ".metadata"), "wb") as f:
            f.write(os.urandom(rng.randrange(1, 200)))
    elif how == "lying list":  # same size, other bytes: the list's sizes agree, its hash does not
        data = bytearray(open(os.path.join(v, ".metadata"), "rb").read())
        data[rng.randrange(len(data))] ^= 1
        open(os.path.join(v, ".metadata"), "wb").write(bytes(data))
    elif how.startswith("old marker") or how == "real, old marker":
        json.dump({"created_by": "ckptq", "kind": "signpost", "message": message}, open(marker, "w"))
        if how == "old marker, other .metadata":
            with open(os.path.join(v, ".metadata"), "ab") as f:
                f.write(b"x")
    elif how == "linked .metadata":
        os.rename(os.path.join(v, ".metadata"), v + ".elsewhere")
        os.symlink(os.path.abspath(v + ".elsewhere"), os.path.join(v, ".metadata"))
    elif how == "saved into":  # accelerate's dcp.save into optimizer_0/ again, after convert --replace
        import torch.distributed.checkpoint as dcp

        dcp.save({"optimizer": {"state": {"w": {"exp_avg": torch.randn(8, 8)}}, "param_groups": []}},
                 checkpoint_id=v, no_dist=True)
    return how, how.startswith("real")


def signpost_trial(rng: random.Random, work: str) -> tuple[str, str]:
    src, q8 = _dcp_sources(work)
    trial = os.path.join(work, "trial")
    shutil.rmtree(trial, ignore_errors=True)
    os.makedirs(trial)
    command = rng.choice(["expand -o", "expand -o --force", "convert -o", "convert -o --force", "framework expand",
                          "framework expand --replace"])
    if command.startswith("framework"):  # accelerate's folder: optimizer_0.q8 beside the folder under test
        torch.save({"step": 1}, os.path.join(trial, "random_states_0.pkl"))
        shutil.copytree(q8, os.path.join(trial, "optimizer_0.q8"))
        v = os.path.join(trial, "optimizer_0")
        args = ["expand", trial] + (["--replace"] if command.endswith("--replace") else [])
    else:
        v = os.path.join(trial, "v")
        verb, *flags = command.split()
        args = [verb, q8 if verb == "expand" else src, *flags[:1], v, *flags[1:]]
    what, real = _fake_signpost(v, rng)
    before = tree(work)
    code, output = cli(*args)
    detail = f"{command} over {what}: {code}: {output.strip()[:200]}"
    if not real:
        if refusal(code, output) and tree(work) == before:
            return "refused", detail
        return "other", detail + " (a folder ckptq did not write as it is was replaced, or something changed)"
    if code == 0 and not signpost.is_signpost_folder(v) and os.path.isfile(os.path.join(v, ".metadata")):
        left = [n for n in os.listdir(trial) if journal.TMP_MARK in n or journal.ASIDE_MARK in n]
        return ("handled", detail) if not left else ("other", f"{detail}: left {left}")
    return "other", detail + " (ckptq's own signpost was not replaced)"


# --- kill -----------------------------------------------------------------------------------------------------

_OPS = [(os, "rename"), (os, "replace"), (os, "unlink"), (os, "remove"), (os, "link"), (os, "rmdir"),
        (shutil, "rmtree"), (atomic, "exchange")]


def _inside(args, root: str) -> bool:
    for a in args:
        if isinstance(a, (str, bytes, os.PathLike)):
            p = os.path.abspath(os.fsdecode(a))
            if p == root or p.startswith(root + os.sep):
                return True
    return False


def _hook(root: str, kill_at: int, when: str, counter: list) -> None:
    """In a child: SIGKILL itself right ``when`` ("before" / "after") the ``kill_at``-th rename, link, unlink,
    removal or swap of a path under ``root`` (0: never; ``counter[0]`` counts them)."""
    for owner, name in _OPS:
        real = getattr(owner, name)

        def hooked(*a, _real=real, **kw):
            if not _inside(a, root):
                return _real(*a, **kw)
            counter[0] += 1
            mine = counter[0]  # an operation may make others inside it (rmtree its rmdir)
            if mine == kill_at and when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            out = _real(*a, **kw)
            if mine == kill_at and when == "after":
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        setattr(owner, name, hooked)


def _forked(args: list, root: str, kill_at: int = 0, when: str = "before", seconds: int = 120) -> tuple[int, int]:
    """Run the CLI with ``args`` in a forked child (hooked as ``_hook`` says): (how it ended: its exit code,
    or -9 for the SIGKILL; how many operations it made under ``root``)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 71
        try:
            os.close(read)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            counter = [0]
            _hook(root, kill_at, when, counter)
            try:
                main([str(a) for a in args], standalone_mode=False)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            os.write(write, str(counter[0]).encode())
        finally:
            os._exit(code)
    os.close(write)
    signal.signal(signal.SIGALRM, lambda *_: os.kill(pid, signal.SIGKILL))
    signal.alarm(seconds)
    try:
        _, status = os.waitpid(pid, 0)
    finally:
        signal.alarm(0)
    with os.fdopen(read) as f:
        ops = f.read()
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return code, int(ops or 0)


def _companion(name: str) -> str | None:
    """The folder a signpost stands in for (its state converted beside it), or None for a file."""
    return name + ".q8" if os.path.isdir(name) or not os.path.splitext(name)[1] else None


def kill_scenarios(work: str, layouts=tuple(LAYOUTS)) -> list[dict]:
    """Per layout and direction: the command, the folder to copy for each trial, and what the name (and a
    signpost's stored state beside it) holds before and after an uninterrupted run, and the folder's files then."""
    out = []
    for layout in layouts:
        make = LAYOUTS[layout]
        base = os.path.join(work, layout)
        fp32 = os.path.join(base, "fp32")
        target, name = make(fp32)
        rel_target, rel_name = os.path.relpath(target, fp32), os.path.relpath(name, fp32)
        states = {"fp32": fp32}
        for stage, verb, prev in (("q8", ckptq.convert, "fp32"), ("back", ckptq.expand, "q8")):
            states[stage] = os.path.join(base, stage)
            shutil.copytree(states[prev], states[stage], symlinks=True)
            verb(os.path.join(states[stage], rel_target), replace=True)  # here: the children fork warm
        for verb, before, after in (("convert", "fp32", "q8"), ("expand", "q8", "back")):
            out.append({"layout": layout, "verb": verb, "start": states[before], "target": rel_target,
                        "name": rel_name, "old": _state(states[before], rel_name), "new": _state(states[after], rel_name),
                        "final": tree(states[after])})
    return out


def _state(folder: str, rel_name: str) -> tuple:
    """What a resume reads at the name: its contents, and a signpost's stored state beside it."""
    name = os.path.join(folder, rel_name)
    beside = _companion(name)
    held = contents(name)
    stored = contents(beside) if beside and held and held.startswith("signpost: ") else None
    return held, stored


def kill_trial(s: dict, kill_at: int, when: str, work: str) -> tuple[str, str]:
    trial = os.path.join(work, "kill-trial")
    shutil.rmtree(trial, ignore_errors=True)
    shutil.copytree(s["start"], trial, symlinks=True)
    args = [s["verb"], os.path.join(trial, s["target"]), "--replace"]
    where = f"{s['layout']} {s['verb']} --replace, kill {when} op {kill_at}"
    code, _ = _forked(args, trial, kill_at, when)
    if code != -signal.SIGKILL:
        return "other", f"{where}: not killed (exit {code})"
    now = _state(trial, s["name"])
    if now not in (s["old"], s["new"]) or now[0] is None:
        return "other", f"{where}: the name holds neither the old checkpoint nor the new one, complete ({now[0]})"
    which = "old" if now == s["old"] else "new"
    code, _ = _forked(args, trial)  # the next run on the folder: cleans up, and finishes the work
    left = [p for p in tree(trial) if journal.TMP_MARK in p or journal.ASIDE_MARK in p]
    if left:
        return "other", f"{where} (name {which}): the next run (exit {code}) left {left[:4]}"
    if set(tree(trial)) != set(s["final"]) and code == 4:  # an output of the killed run's, complete: --force
        code, _ = _forked(args + ["--force"], trial)
    if _state(trial, s["name"]) != s["new"] or set(tree(trial)) != set(s["final"]):
        extra = sorted(set(tree(trial)) ^ set(s["final"]))[:4]
        return "other", f"{where} (name {which}): the next runs (exit {code}) leave {extra}"
    return "handled", which


def kill_campaign(work: str, seed: int = 0, per_scenario: int | None = None, layouts=tuple(LAYOUTS),
                  whens=("before", "after")) -> dict:
    """Every kill point (right ``whens`` each operation) of every scenario of ``layouts`` (or ``per_scenario``
    of them, drawn with ``seed``): {"<layout> <verb>": Counter, "examples": [...]}."""
    rng = random.Random(seed)
    results, examples = {}, []
    for s in kill_scenarios(work, layouts):
        probe = os.path.join(work, "kill-probe")
        shutil.rmtree(probe, ignore_errors=True)
        shutil.copytree(s["start"], probe, symlinks=True)
        _, ops = _forked([s["verb"], os.path.join(probe, s["target"]), "--replace"], probe)
        points = [(k, when) for k in range(1, ops + 1) for when in whens]
        if per_scenario is not None and per_scenario < len(points):
            points = rng.sample(points, per_scenario)
        counts = collections.Counter()
        for k, when in points:
            outcome, detail = kill_trial(s, k, when, work)
            counts[outcome if outcome != "handled" else f"handled ({detail})"] += 1
            if outcome == "other":
                examples.append(detail)
        results[f"{s['layout']} {s['verb']}"] = dict(counts) | {"operations": ops}
    results["examples"] = examples
    return results


# --- damage ---------------------------------------------------------------------------------------------------

def _flip_data_record(path: str, rng: random.Random) -> str:
    """Flip one bit inside a data record of a torch.save zip (sizes intact: only its CRC-32 tells)."""
    with zipfile.ZipFile(path) as z:
        records = [i for i in z.infolist() if "/data/" in i.filename and i.file_size > 0]
    rec = rng.choice(records)
    with open(path, "rb") as f:
        start = torch_zip._data_offset(f, rec)
    at = start + rng.randrange(rec.file_size)
    raw = bytearray(open(path, "rb").read())
    raw[at] ^= 1 << rng.randrange(8)
    open(path, "wb").write(bytes(raw))
    return f"{rec.filename} byte {at - start}"


def _trainer(folder: str, seed: int = 0) -> tuple[str, str]:
    os.makedirs(folder)
    model, opt = _adamw_state(seed)
    torch.save(opt, os.path.join(folder, "optimizer.pt"))
    torch.save({}, os.path.join(folder, "scheduler.pt"))
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 2}, f)
    return folder, os.path.join(folder, "optimizer.pt")


def damage_trial(rng: random.Random, work: str) -> tuple[str, str]:
    trial = os.path.join(work, "damage")
    shutil.rmtree(trial, ignore_errors=True)
    os.makedirs(trial)
    layout, verb = rng.choice([("lightning", "convert"), ("lightning", "expand"), ("litgpt", "convert"),
                               ("litgpt", "expand"), ("trainer", "convert")])
    folder = os.path.join(trial, "ckpt")
    target, name = {"lightning": lightning, "litgpt": litgpt, "trainer": _trainer}[layout](folder, rng.randrange(100))
    if verb == "expand":  # the checkpoint converted in place is the input
        assert ckptq.convert(target, replace=True).removed
    how = rng.choice(["bit flip", "bit flip", "symlink"])
    if how == "symlink":  # the checkpoint moved away, a link at its name
        moved = os.path.join(trial, "elsewhere-" + os.path.basename(name))
        os.rename(name, moved)
        os.symlink(moved, name)
        what = "a symbolic link"
    else:
        what = _flip_data_record(name, rng)
    arg = target if rng.random() < 0.5 or layout == "lightning" else name
    before = tree(trial)
    code, output = cli(verb, arg, "--replace")
    detail = f"{layout} {verb} {os.path.relpath(arg, trial)} --replace, {what}: {code}: {output.strip()[:200]}"
    if refusal(code, output) and tree(trial) == before:
        return "refused", detail
    return "other", detail


REPLACE_KINDS = {"signpost": signpost_trial, "damage": damage_trial}


def replace_campaign(trials: dict | int, seed: int, workdir: str, kill_points: int | None = None,
                     layouts=tuple(LAYOUTS), whens=("before", "after")) -> dict:
    """``trials`` per kind (a number, or {kind: number}), and the kill campaign over ``layouts`` (every kill
    point, or ``kill_points`` per scenario; 0: none): {kind: Counter, "kill": {...}, "examples": [...]}."""
    _quiet()
    os.environ["XDG_CACHE_HOME"] = os.path.join(workdir, "cache")  # this campaign's journals only
    torch.set_num_threads(1)  # the kill campaign forks: no thread pool in the parent to inherit
    rng = random.Random(seed)
    results, examples = {}, []
    for kind, trial in REPLACE_KINDS.items():
        n = trials if isinstance(trials, int) else trials.get(kind, 0)
        counts = collections.Counter()
        work = os.path.join(workdir, kind)
        os.makedirs(work, exist_ok=True)
        for _ in range(n):
            outcome, detail = trial(rng, work)
            counts[outcome] += 1
            if outcome == "other":
                examples.append(f"{kind}: {detail}")
        results[kind] = dict(counts)
    if kill_points != 0:
        killed = kill_campaign(os.path.join(workdir, "kill"), seed, kill_points, layouts, whens)
        examples += killed.pop("examples")
        results["kill"] = killed
    results["examples"] = examples
    return results


if __name__ == "__main__":
    import tempfile

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    n, s = (int(a) for a in (sys.argv[1:] + ["40", "34"])[:2])
    with tempfile.TemporaryDirectory(prefix="ckptq-replace-campaign-") as work:
        os.chdir(work)
        print(json.dumps(replace_campaign(n, s, work), indent=1))
