"""Hostile optimizer state read by role (foreign 8-bit views, odd groups, names): seeded campaigns whose trials each
end "refused" (every call a one-line typed error, exit neither 0 nor 70, the input unchanged, nothing
written), "handled" (the calls succeed, their outputs bounded by the input's bytes) or "other" (what must
never happen: exit 70 or another exception, a traceback, several lines, an allocation out of proportion to
the input, a name printed raw, a file left behind).

- ``foreign``: bitsandbytes (two-state nested and flat, one-state, ``max1`` per-tensor scale) and torchao
  states whose codes, scales or codebook are views that repeat their bytes (stride 0, overlapping strides)
  or claim other shapes; ``ckptq info`` / ``convert`` and ``AdamW8bit`` / ``SGD8bit.load_state_dict``.
  Run it under a memory limit (``RLIMIT_AS``): a regression then fails fast instead of exhausting memory.
- ``roles``: torch's optimizers' param groups and states given values of other types where ckptq reads
  them by role (``centered``, ``decoupled_weight_decay``, ``amsgrad``, ``eps``, ``betas``, unhashable
  ``params`` ids, RMSprop's ``grad_avg`` in another shape, a bitsandbytes ``qmap1`` of another shape);
  ``ckptq info`` / ``convert``.
- ``estimate``: ``ckptq estimate DIR`` of folders whose names hold control, format and bidi characters
  and undecodable bytes: printed escaped, text and JSON.

Run as a script for figures: ``python -m tests.helpers.hostile_roles [trials] [seed]``.
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import sys

import torch

from click.testing import CliRunner

from ckptq.cli import main
from ckptq.codec import foreign
from ckptq.errors import CkptqError

SHAPE = (64, 128)  # 8192 values: 32 bitsandbytes blocks of 256, above min_size
HUGE = [2**20, 2**32, 2**36, 2**40]


def cli(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        return -1, f"{type(r.exception).__name__}: {r.exception}"
    return r.exit_code, r.output


def _cli_outcome(code: int, output: str) -> str:
    lines = output.strip().splitlines()
    if code == 0:
        return "handled"
    if code in (-1, 70) or len(lines) != 1 or not lines[0].startswith("ckptq: error: ") or "Traceback" in output:
        return "other"
    return "refused"


def _combined(outcomes: list[str]) -> str:
    if "other" in outcomes:
        return "other"
    return "refused" if all(o == "refused" for o in outcomes) else "handled"


def _snapshot(folder: str) -> dict:
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


def _run_cli_calls(path: str, calls: list[list]) -> tuple[list[str], str]:
    """Each CLI call on ``path``; a refusal must leave the folder as it was (only ``out.*`` may appear on success)."""
    folder = os.path.dirname(path)
    outcomes, details = [], []
    for args in calls:
        before = _snapshot(folder)
        code, output = cli(*args)
        outcome = _cli_outcome(code, output)
        after = _snapshot(folder)
        if outcome == "refused" and after != before:
            outcome, output = "other", f"refused but the folder changed: {sorted(set(after) ^ set(before))}"
        if outcome == "handled" and {n: b for n, b in after.items() if not n.startswith("out.")} != before:
            outcome, output = "other", "handled but the input or its folder changed"
        for n in after:
            if n.startswith("out."):
                os.unlink(os.path.join(folder, n))
        outcomes.append(outcome)
        details.append(f"{args[0]}: {code}: {output.strip()[:160]}")
    return outcomes, "; ".join(details)


# --- foreign: bitsandbytes and torchao states whose views claim what their bytes do not hold -----------------

def _bnb_state(layout: str, gen: torch.Generator) -> tuple[dict, dict]:
    """(one parameter's bitsandbytes state, its param group) in ``layout``."""
    q = {"state1": torch.randint(0, 256, SHAPE, generator=gen, dtype=torch.uint8),
         "qmap1": torch.linspace(-1, 1, 256), "absmax1": torch.rand(32, generator=gen) * 1e-3}
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": [0]}
    if layout != "one-state":
        q |= {"state2": torch.randint(128, 256, SHAPE, generator=gen, dtype=torch.uint8),
              "qmap2": torch.linspace(0, 1, 256) ** 2, "absmax2": torch.rand(32, generator=gen) * 1e-6}
    else:
        group |= {"betas": (0.9, 0.0), "eps": 0.0}  # SGD8bit: (momentum, dampening), eps 0
    if layout == "max":
        q["max1"], q["max2"] = q.pop("absmax1")[:1].clone(), q.pop("absmax2")[:1].clone()
    pstate = {"step": 3} | ({foreign.BNB_NESTED: q} if layout != "flat" else q)
    return pstate, group


def _repeating(rng: random.Random, like: torch.Tensor, numel: int | None = None) -> tuple[torch.Tensor, str]:
    numel = numel or rng.choice(HUGE)
    how = rng.choice(["stride 0", "stride 0, 2-D", "overlapping"])
    if how == "stride 0":
        return torch.zeros(1, dtype=like.dtype).expand(numel), f"{how} x{numel}"
    if how == "stride 0, 2-D":
        side = max(2, int(numel**0.5))
        return torch.zeros(1, 1, dtype=like.dtype).expand(side, side), f"{how} {side}x{side}"
    side = max(2, min(int(numel**0.5), 2**16))
    base = torch.zeros(2 * side, dtype=like.dtype)
    return base.as_strided((side, side), (1, 1)), f"{how} {side}x{side}"


def _spoil_bnb(q: dict, rng: random.Random) -> str:
    """One field of a bitsandbytes state made a view that repeats its bytes, or all of them at once (a 3 KB
    state claiming 2**32 codes, consistently), or a codebook of another shape."""
    how = rng.choice(["one field", "one field", "consistent claim", "codebook shape"])
    if how == "consistent claim":
        numel = rng.choice(HUGE[1:])
        for name in [n for n in q if n.startswith("state")]:
            q[name] = torch.zeros(1, dtype=torch.uint8).expand(numel)
        for name in [n for n in q if n.startswith(("absmax", "max"))]:
            q[name] = torch.ones(1).expand(-(-numel // 256) if name.startswith("absmax") else 1)
        return f"every field claims {numel} codes"
    if how == "codebook shape":
        name = rng.choice([n for n in q if n.startswith("qmap")])
        shape = rng.choice([(16, 16), (256, 1), (2, 128), (1, 256)])
        q[name] = q[name].reshape(shape)
        return f"{name} shaped {shape}"
    name = rng.choice(sorted(n for n, v in q.items() if isinstance(v, torch.Tensor)))
    q[name], what = _repeating(rng, q[name])
    return f"{name}: {what}"


def _torchao_state(rng: random.Random) -> tuple[dict, str]:
    """AdamW8bit-shaped torchao state whose codes or scales repeat their bytes."""
    from torchao.optim.subclass_8bit import OptimState8bit

    good = OptimState8bit.zeros(SHAPE, signed=True, block_size=256)
    sq = OptimState8bit.zeros(SHAPE, signed=False, block_size=256)
    part = rng.choice(["codes", "scale"])
    if part == "codes":
        numel = rng.choice(HUGE[1:])
        codes, what = torch.zeros(1, dtype=torch.uint8).expand(numel), f"codes stride 0 x{numel}"
        scale = torch.ones(1).expand(numel // 256)
    else:
        codes, what = good.codes, "scale stride 0"
        scale = torch.ones(1).expand(good.scale.numel())
    bad = OptimState8bit(codes, scale, good.qmap, True)
    return {"step": torch.tensor(3.0), "exp_avg": bad, "exp_avg_sq": sq}, what


def _load_outcome(make, sd: dict) -> tuple[str, str]:
    params = [torch.nn.Parameter(torch.zeros(SHAPE))]
    opt = make(params)
    try:
        opt.load_state_dict(sd)
    except CkptqError as e:
        return ("refused" if "\n" not in str(e) and not opt.state else "other"), str(e)[:160]
    except Exception as e:  # noqa: BLE001 -- what the campaign must never see
        return "other", f"{type(e).__name__}: {str(e)[:160]}"
    return "handled", ""


def foreign_trial(rng: random.Random, work: str) -> tuple[str, str]:
    from ckptq.optim import AdamW8bit, SGD8bit

    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    source = rng.choice(["bitsandbytes"] * 4 + ["torchao"])
    if source == "torchao":
        pstate, what = _torchao_state(rng)
        group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "params": [0]}
        layout = "torchao"
    else:
        layout = rng.choice(["nested", "flat", "one-state", "max"])
        pstate, group = _bnb_state(layout, gen)
        what = _spoil_bnb(pstate.get(foreign.BNB_NESTED, pstate), rng)
    sd = {"state": {0: pstate}, "param_groups": [group]}
    path = os.path.join(work, "trial.pt")
    torch.save({"optimizer": sd}, path)
    trust = ["--trust"] if layout == "torchao" else []
    outcomes, detail = _run_cli_calls(path, [["info", path, *trust],
                                             ["convert", path, "-o", os.path.join(work, "out.q8.safetensors"), *trust]])
    make = (lambda ps: SGD8bit(ps, lr=1e-3, momentum=0.9)) if layout == "one-state" else (lambda ps: AdamW8bit(ps))
    loaded, message = _load_outcome(make, sd)  # the last use of sd: no copy (torchao states do not clone)
    return _combined(outcomes + [loaded]), f"{layout} {what}: {detail}; load: {loaded} {message}"


# --- roles: param groups and states of other types where ckptq reads them by role -----------------------------

_ODD = {"2 values": lambda: torch.ones(2), "0-dim": lambda: torch.tensor(1.0), "text": lambda: "x",
        "list": lambda: [1], "dict": lambda: {"a": 1}, "None": lambda: None, "NaN": lambda: float("nan"),
        "2**70": lambda: 2**70, "-1": lambda: -1, "True": lambda: True, "1.5": lambda: 1.5}
_OPTIMIZERS = {
    "rmsprop centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9, centered=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps), "adamw": lambda ps: torch.optim.AdamW(ps),
    "amsgrad": lambda ps: torch.optim.AdamW(ps, amsgrad=True), "nadam": lambda ps: torch.optim.NAdam(ps),
    "radam": lambda ps: torch.optim.RAdam(ps), "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps), "adamax": lambda ps: torch.optim.Adamax(ps),
}


def _trained_state(name: str, gen: torch.Generator) -> dict:
    ps = [torch.nn.Parameter(torch.randn(SHAPE, generator=gen)), torch.nn.Parameter(torch.randn(8, generator=gen))]
    opt = _OPTIMIZERS[name](ps)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt.state_dict()


def _spoil_roles(sd: dict, rng: random.Random, name: str) -> str:
    group = sd["param_groups"][0]
    how = rng.choice(["group value", "group value", "flag", "params id", "state shape"])
    if how == "flag":
        key = rng.choice(["centered", "decoupled_weight_decay", "amsgrad", "nesterov", "maximize"])
        kind = rng.choice(sorted(_ODD))
        group[key] = _ODD[kind]()
        return f"{key} = {kind}"
    if how == "group value":
        key = rng.choice(sorted(k for k in group if k != "params"))
        kind = rng.choice(sorted(_ODD))
        group[key] = _ODD[kind]()
        return f"{key} = {kind}"
    if how == "params id":
        bad = rng.choice([[0], {"a": 0}, {0}, bytearray(b"0")])
        group["params"] = [bad] + list(group["params"][1:])
        state = sd["state"]
        if 0 in state and not isinstance(bad, (list, dict, set, bytearray)):
            state[bad] = state.pop(0)
        return f"params[0] = {type(bad).__name__}"
    pstate = sd["state"][0]
    key = rng.choice(sorted(k for k, v in pstate.items() if isinstance(v, torch.Tensor) and v.dim() > 0))
    shape = rng.choice([(64, 127), (128, 64), (8192,), (64, 128, 1), (2, 64, 128)])
    pstate[key] = torch.rand(shape)
    return f"state 0 {key} shaped {shape}"


def roles_trial(rng: random.Random, work: str) -> tuple[str, str]:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    if rng.random() < 0.15:  # bitsandbytes one-state (SGD8bit) or Adam state with a codebook of another shape
        layout = rng.choice(["nested", "one-state", "flat"])
        pstate, group = _bnb_state(layout, gen)
        q = pstate.get(foreign.BNB_NESTED, pstate)
        name = rng.choice([n for n in q if n.startswith("qmap")])
        shape = rng.choice([(16, 16), (256, 1), (4, 64)])
        q[name] = q[name].reshape(shape)
        sd, what = {"state": {0: pstate}, "param_groups": [group]}, f"bitsandbytes {layout} {name} shaped {shape}"
    else:
        name = rng.choice(sorted(_OPTIMIZERS))
        sd = _trained_state(name, gen)
        what = f"{name}: {_spoil_roles(sd, rng, name)}"
    path = os.path.join(work, "trial.pt")
    torch.save({"optimizer": sd, "model": {"w": torch.zeros(2)}}, path)
    outcomes, detail = _run_cli_calls(path, [["info", path],
                                             ["convert", path, "-o", os.path.join(work, "out.q8.safetensors")]])
    return _combined(outcomes), f"{what}: {detail}"


# --- estimate: folder names printed escaped ----------------------------------------------------------------

_NASTY = ["\x1b]0;PWNED\x07", "\x1b[2J", "\n", "\r", "\t", "\u202e", "\u200b", "\x7f", "\x9b31m", "\x08",
          "\udcff", "\udc80"]
_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 100}


def estimate_trial(rng: random.Random, work: str) -> tuple[str, str]:
    parts = [rng.choice(_NASTY) if rng.random() < 0.5 else rng.choice("abc-_. ") for _ in range(rng.randrange(1, 8))]
    name = "m" + "".join(parts)
    folder = os.path.join(work, name)
    try:
        os.mkdir(os.fsencode(folder))
    except OSError as e:
        return "refused", f"{name!r}: the file system refuses the name ({e.strerror})"
    with open(os.path.join(os.fsencode(folder), b"config.json"), "w") as f:
        json.dump(_CONFIG, f)
    try:
        target = rng.choice([folder, os.path.join(folder, "config.json")])
        outcomes = []
        for extra in ([], ["--json"]):
            code, output = cli("estimate", target, *extra)
            raw = [c for c in output if not c.isprintable() and c != "\n"]
            if code != 0 or raw:
                return "other", f"{name!r} {extra}: exit {code}, raw characters {raw[:3]!r}: {output[:120]!r}"
            outcomes.append("handled")
        return "handled", ""
    finally:
        shutil.rmtree(os.fsencode(folder), ignore_errors=True)


ROLE_KINDS = {"foreign": foreign_trial, "roles": roles_trial, "estimate": estimate_trial}


def roles_campaign(trials: dict | int, seed: int, workdir: str) -> dict:
    """``trials`` per kind (a number, or {kind: number}): {kind: Counter of outcomes, "examples": [other]}."""
    import warnings

    warnings.filterwarnings("ignore")
    rng = random.Random(seed)
    results, examples = {}, []
    for kind, trial in ROLE_KINDS.items():
        n = trials if isinstance(trials, int) else trials.get(kind, 0)
        counts = collections.Counter()
        for _ in range(n):
            work = os.path.join(workdir, kind)
            shutil.rmtree(work, ignore_errors=True)
            os.makedirs(work)
            outcome, detail = trial(rng, work)
            counts[outcome] += 1
            if outcome == "other":
                examples.append(f"{kind}: {detail}")
        results[kind] = dict(counts)
    results["examples"] = examples
    return results


if __name__ == "__main__":
    import resource
    import tempfile

    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a regression fails fast, not by the OOM killer
    n, s = (int(a) for a in (sys.argv[1:] + ["40", "34"])[:2])
    with tempfile.TemporaryDirectory(prefix="ckptq-roles-campaign-") as work:
        print(json.dumps(roles_campaign(n, s, work), indent=1))
