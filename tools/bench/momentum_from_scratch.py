"""Do ckptq's low-bit optimizers beyond Adam (SGD8bit, Lion8bit, Muon8bit, RMSprop8bit, Adagrad8bit, NAdam8bit,
RAdam8bit, AdEMAMix8bit and the 4-bit variants) train a tiny GPT from scratch as their fp32 counterparts do?
Issues 29's and 35's figures, with a 1% gradient-noise control beside each.

Setting: ``tools/bench/resume_fidelity.py``'s ``--preset english`` at half its width and context (``--size byte64``: a
byte-level GPT-2, n_embd 64, 2 layers, 4 heads, 0.12 M parameters, on 16 x 64 bytes of English text, every
matrix at or above min_size 4096 so every one has low-bit state; ``--size byte128`` is --preset english's own model);
gradients clipped at 1.0, linear lr warm-up of 30 steps, then constant; ``--steps`` steps from the same
initialization on the same batches per seed. Per run: the mean
train loss of the last 100 steps, relative to the fp32 run of the same family and seed.

Families (``--families``) and their variants:

  muon   Muon hybrid, as Moonlight / modded-nanogpt: Muon (lr 0.02, momentum 0.95, Nesterov, weight decay 0,
         torch's default lr adjustment) on the blocks' 2-D matrices, AdamW (lr 3e-3, betas (0.9, 0.95), weight
         decay 0.1 on the 2-D embeddings / tied head, 0 on vectors) on the rest.
           fp32         torch.optim.Muon + torch.optim.AdamW
           noise1       fp32 with 1% relative Gaussian gradient noise (the control; noise1.1 and noise1.2:
                        two more draws of it, so that the control is a spread, not one number)
           muon8+adam8  ckptq Muon8bit + ckptq AdamW8bit
           muon8+adam   ckptq Muon8bit + torch AdamW (isolates Muon8bit)
           muon+adam8   torch Muon + ckptq AdamW8bit (isolates AdamW8bit on the embeddings and vectors)
           muon4+adam   ckptq Muon4bit + torch AdamW (isolates Muon4bit)
  sgd    SGD on every parameter: lr 0.1, momentum 0.9, Nesterov, weight decay 0.
           fp32         torch.optim.SGD
           noise1       the control
           sgd8, sgd4   ckptq SGD8bit / SGD4bit
           bnb          bitsandbytes SGD8bit: it accepts nesterov=True but runs heavy-ball momentum
                        (its kernel has no Nesterov term), so compare it with the next row as well:
           fp32-hb      torch.optim.SGD, nesterov=False (what Nesterov alone changes)
  lion   Lion on every parameter: lr 3e-4, betas (0.9, 0.99), weight decay 0.1 on >= 2-D tensors.
           fp32         lion-pytorch Lion
           noise1       the control
           lion8, lion4 ckptq Lion8bit / Lion4bit
           bnb          bitsandbytes Lion8bit
  rmsprop, adagrad, nadam, radam, ademamix   torch's class (ademamix: bitsandbytes' 32-bit AdEMAMix) as fp32,
         ckptq's 8-bit and 4-bit classes, bitsandbytes' 8-bit class where it has one (RMSprop8bit, Adagrad8bit,
         AdEMAMix8bit); arguments in RMSPROP, ADAGRAD, NADAM, RADAM, ADEMAMIX below

The control (``noise1``) is resume_fidelity's (``NoisyAdamW``) applied to any optimizer: before each step every
gradient element is multiplied by 1 + 0.01 N(0, 1) from the run's own generator (seeded seed + 7919, the k-th
extra draw ``noise1.k`` seed + 7919 + 1000 k), after clipping. Its distance from fp32 is what an unbiased
perturbation of that size does to the loss. The verdict columns: a run is "within" on a seed when its |distance|
is at most the largest |distance| of the noise draws on that seed; "within max" compares its largest |distance|
over the seeds with the draws' largest over the seeds.

State bytes per parameter: every distinct storage reachable from ``opt.state`` (``harness.state_bytes``),
after training, over the model's parameters (the tied embedding once).

    python tools/bench/momentum_from_scratch.py --threads 2                      # 3 seeds x 3 families x 300 steps
    python tools/bench/momentum_from_scratch.py --threads 1 --families sgd --json /tmp/sgd.json   # one family
    python tools/bench/momentum_from_scratch.py --families muon --variants noise1.1,muon+adam8 --json /tmp/more.json
    python tools/bench/momentum_from_scratch.py --from-json /tmp/sgd.json /tmp/more.json    # tables, runs merged
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

FAMILY_NAMES = ("muon", "sgd", "lion", "rmsprop", "adagrad", "nadam", "radam", "ademamix")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="muon,sgd,lion", help="comma list of " + ", ".join(FAMILY_NAMES))
    parser.add_argument("--size", choices=("byte64", "byte128"), default="byte64")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--variants", help="comma list of variants (fp32 always runs; default: all)")
    parser.add_argument("--json", help="write every loss curve and state size here (rewritten after each seed)")
    parser.add_argument("--from-json", nargs="+", metavar="JSON", help="print the tables of earlier --json runs "
                        "(no training)")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P leaves the tool's folder off sys.path
import harness  # noqa: E402
import resume_fidelity as rf  # noqa: E402  (puts tools/scripts/ on sys.path for make_checkpoint)
import make_checkpoint as mc  # noqa: E402

from ckptq.optim import (AdamW8bit, AdEMAMix4bit, AdEMAMix8bit, Adagrad4bit, Adagrad8bit, Lion4bit,  # noqa: E402
                         Lion8bit, Muon4bit, Muon8bit, NAdam4bit, NAdam8bit, RAdam4bit, RAdam8bit, RMSprop4bit,
                         RMSprop8bit, SGD4bit, SGD8bit)

PRESET = rf.PRESETS["english"]  # English text, warm-up 30 (size: --size)
# issue 23's byte-level GPT-2 at half width and context: 2 CPU cores shared by four jobs run ckptq's PyTorch
# reference step (no C kernel for the one-state step yet) at a few seconds per step at byte128's 0.43 M params
rf.SIZES.setdefault("byte64", dict(vocab_size=256, n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=16))
SIGMA = rf.NOISE["noise1"]  # 1% relative gradient noise
ADAMW = dict(lr=3e-3, betas=mc.BETAS)  # the Muon hybrid's AdamW part (weight decay per group)
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0)
SGD = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.0)
LION = dict(lr=3e-4, betas=(0.9, 0.99))  # weight decay 0.1 on >= 2-D tensors (nanoGPT's groups)
# The engine's optimizers (issue 35), each on every parameter with nanoGPT's weight-decay groups where it decays:
RMSPROP = dict(lr=1e-3, alpha=0.99, momentum=0.9)
ADAGRAD = dict(lr=3e-2)
NADAM = dict(lr=3e-3, betas=mc.BETAS, decoupled_weight_decay=True)
RADAM = dict(lr=3e-3, betas=mc.BETAS, decoupled_weight_decay=True)
ADEMAMIX = dict(lr=3e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0)  # t_alpha = t_beta3 = --steps (the paper's)


class Combined:
    """Several optimizers stepped as one (the Muon hybrid): param_groups and state are theirs, joined."""

    def __init__(self, *opts):
        self.opts = opts
        self.param_groups = [g for o in opts for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {k: v for o in self.opts for k, v in o.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.opts:
            o.step()


class Noisy(Combined):
    """resume_fidelity's control for any optimizer: each gradient element x (1 + sigma N(0, 1)) before the step,
    from its own seeded generator (the formula of ``rf.NoisyAdamW.step``)."""

    def __init__(self, opt, sigma: float, seed: int):
        super().__init__(opt)
        self.sigma, self.gen = sigma, torch.Generator().manual_seed(seed + 7919)

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(torch.randn(p.grad.shape, generator=self.gen).mul_(self.sigma).add_(1.0))
        super().step()


def decay_groups(params: list, wd: float) -> list[dict]:
    """nanoGPT's split: weight decay on >= 2-D tensors only."""
    return [g for g in ({"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
                        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}) if g["params"]]


def hidden_split(model: torch.nn.Module) -> tuple[list, list]:
    """(the blocks' 2-D matrices: Muon's, everything else: AdamW's). parameters() dedupes the tied head."""
    hidden = {id(p) for n, p in model.named_parameters() if n.startswith("transformer.h.") and p.dim() == 2}
    params = list(model.parameters())
    return [p for p in params if id(p) in hidden], [p for p in params if id(p) not in hidden]


def muon(model, muon_cls, adam_cls):
    hidden, rest = hidden_split(model)
    return Combined(muon_cls(hidden, **MUON), adam_cls(decay_groups(rest, mc.WEIGHT_DECAY), **ADAMW))


def sgd(model, cls, nesterov=True, **kw):
    return cls(list(model.parameters()), **{**SGD, "nesterov": nesterov}, **kw)


def lion(model, cls):
    return cls(decay_groups(list(model.parameters()), mc.WEIGHT_DECAY), **LION)


def grouped(model, cls, wd: float = 0.0, **kw):
    """``cls`` on every parameter, weight decay ``wd`` on >= 2-D tensors where it decays."""
    params = list(model.parameters())
    return cls(decay_groups(params, wd) if wd else params, **kw)


def ademamix(model, cls):
    return grouped(model, cls, mc.WEIGHT_DECAY, **ADEMAMIX, t_alpha=STEPS[0], t_beta3=STEPS[0])


STEPS = [300]  # --steps, for AdEMAMix's schedules


def _bnb(name: str):
    import bitsandbytes.optim

    return getattr(bitsandbytes.optim, name)


def _lion_pytorch():
    from lion_pytorch import Lion

    return Lion


# family -> variant -> f(model) -> optimizer; "noise1" is added to every family (its fp32 wrapped in Noisy)
FAMILIES = {
    "muon": {
        "fp32": lambda m: muon(m, torch.optim.Muon, torch.optim.AdamW),
        "muon8+adam8": lambda m: muon(m, Muon8bit, AdamW8bit),
        "muon8+adam": lambda m: muon(m, Muon8bit, torch.optim.AdamW),
        "muon4+adam": lambda m: muon(m, Muon4bit, torch.optim.AdamW),
        "muon+adam8": lambda m: muon(m, torch.optim.Muon, AdamW8bit),
    },
    "sgd": {
        "fp32": lambda m: sgd(m, torch.optim.SGD, foreach=True),
        "sgd8": lambda m: sgd(m, SGD8bit),
        "sgd4": lambda m: sgd(m, SGD4bit),
        "bnb": lambda m: sgd(m, _bnb("SGD8bit")),  # nesterov accepted, not applied (heavy-ball)
        "fp32-hb": lambda m: sgd(m, torch.optim.SGD, nesterov=False, foreach=True),
    },
    "lion": {
        "fp32": lambda m: lion(m, _lion_pytorch()),
        "lion8": lambda m: lion(m, Lion8bit),
        "lion4": lambda m: lion(m, Lion4bit),
        "bnb": lambda m: lion(m, _bnb("Lion8bit")),
    },
    "rmsprop": {
        "fp32": lambda m: grouped(m, torch.optim.RMSprop, foreach=True, **RMSPROP),
        "rmsprop8": lambda m: grouped(m, RMSprop8bit, **RMSPROP),
        "rmsprop4": lambda m: grouped(m, RMSprop4bit, **RMSPROP),
        "bnb": lambda m: grouped(m, _bnb("RMSprop8bit"), **RMSPROP),
    },
    "adagrad": {
        "fp32": lambda m: grouped(m, torch.optim.Adagrad, foreach=True, **ADAGRAD),
        "adagrad8": lambda m: grouped(m, Adagrad8bit, **ADAGRAD),
        "adagrad4": lambda m: grouped(m, Adagrad4bit, **ADAGRAD),
        "adagrad8-sr": lambda m: grouped(m, Adagrad8bit, rounding="stochastic", **ADAGRAD),
        "bnb": lambda m: grouped(m, _bnb("Adagrad8bit"), **ADAGRAD),
    },
    "nadam": {
        "fp32": lambda m: grouped(m, torch.optim.NAdam, mc.WEIGHT_DECAY, foreach=True, **NADAM),
        "nadam8": lambda m: grouped(m, NAdam8bit, mc.WEIGHT_DECAY, **NADAM),
        "nadam4": lambda m: grouped(m, NAdam4bit, mc.WEIGHT_DECAY, **NADAM),
    },
    "radam": {
        "fp32": lambda m: grouped(m, torch.optim.RAdam, mc.WEIGHT_DECAY, foreach=True, **RADAM),
        "radam8": lambda m: grouped(m, RAdam8bit, mc.WEIGHT_DECAY, **RADAM),
        "radam4": lambda m: grouped(m, RAdam4bit, mc.WEIGHT_DECAY, **RADAM),
    },
    "ademamix": {
        "fp32": lambda m: ademamix(m, _bnb("AdEMAMix")),  # bitsandbytes' 32-bit AdEMAMix
        "ademamix8": lambda m: ademamix(m, AdEMAMix8bit),
        "ademamix4": lambda m: ademamix(m, AdEMAMix4bit),
        "bnb": lambda m: ademamix(m, _bnb("AdEMAMix8bit")),
    },
}


NOISE_DRAWS = ("noise1", "noise1.1", "noise1.2")


def variants(family: str, chosen: str | None = None) -> list[str]:
    """fp32 first (always), then ``chosen`` (a comma list) or every variant, the noise draws first."""
    names = list(FAMILIES[family])
    every = names[:1] + list(NOISE_DRAWS) + names[1:]
    if chosen is None:
        return every
    known = set(NOISE_DRAWS).union(*(FAMILIES[f] for f in FAMILIES))  # a name of another family: not this one's
    unknown = sorted(set(chosen.split(",")) - known)
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(sorted(known))}")
    return ["fp32"] + [v for v in every[1:] if v in chosen.split(",")]


def make(family: str, variant: str, model: torch.nn.Module, seed: int):
    if variant in NOISE_DRAWS:
        draw = int(variant.partition(".")[2] or 0)
        return Noisy(FAMILIES[family]["fp32"](model), SIGMA, seed + 1000 * draw)
    return FAMILIES[family][variant](model)


def run_seed(args, family: str, seed: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Every variant of ``family`` from the same initialization on the same batches: (losses, state B/param)."""
    cfg, _ = rf.model_config(args.size)
    data = rf.scratch_data(args, seed)
    curves, state = {}, {}
    for variant in variants(family, args.variants):
        torch.manual_seed(seed)
        model = mc.GPT(**cfg)
        opt = make(family, variant, model, seed)
        start = time.perf_counter()
        rf.train_steps(model, opt, data, curves.setdefault(variant, []), rf.warmup_schedule(args.warmup))
        state[variant] = harness.state_bytes(opt) / sum(p.numel() for p in model.parameters())
        print(f"{family} seed {seed} {variant}: last {rf.LAST_WINDOW} mean "
              f"{statistics.fmean(curves[variant][-rf.LAST_WINDOW:]):.4f}, state {state[variant]:.3f} B/param, "
              f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return curves, state


def family_table(family: str, runs: dict[int, dict[str, list[float]]], state: dict[str, float], end: int) -> str:
    """Per variant and seed: last-100 mean loss vs fp32 (%), the largest |.|, the state, and whether it sits within
    the noise draws' spread: |x| <= max over the draws of |noise| on every seed (and over all seeds)."""
    seeds = sorted(runs)
    names = [v for v in variants(family) if all(v in runs[s] for s in seeds)]
    rel = {v: [100 * rf.window_ratio(runs[s][v], runs[s]["fp32"], end) for s in seeds] for v in names}
    draws = [v for v in NOISE_DRAWS if v in rel]
    control = [max(abs(rel[d][i]) for d in draws) for i in range(len(seeds))] if draws else None
    head = (f"| {family}: steps {end - rf.LAST_WINDOW + 1}-{end} vs fp32 | " + " | ".join(f"seed {s}" for s in seeds)
            + f" | max abs | state B/param | within noise ({len(draws)} draws), each seed | within max noise |")
    rows = [head, "|---|" + "---:|" * (len(seeds) + 2) + ":---:|:---:|"]
    for v, vals in rel.items():
        if v == "fp32":
            continue
        if v in draws:
            each = spread = "(control)"
        elif control is None:
            each = spread = "(no control run)"
        else:
            each = "yes" if all(abs(x) <= c for x, c in zip(vals, control)) else "no"
            spread = "yes" if max(map(abs, vals)) <= max(control) else "no"
        rows.append(f"| {v} | " + " | ".join(f"{x:+.3f}%" for x in vals)
                    + f" | {max(map(abs, vals)):.3f}% | {state[v]:.3f} | {each} | {spread} |")
    if "bnb" in rel and "fp32-hb" in rel:  # bitsandbytes SGD8bit runs heavy-ball: its own fp32 reference
        vals = [100 * rf.window_ratio(runs[s]["bnb"], runs[s]["fp32-hb"], end) for s in seeds]
        each = spread = "(no control run)"
        if control is not None:
            each = "yes" if all(abs(x) <= c for x, c in zip(vals, control)) else "no"
            spread = "yes" if max(map(abs, vals)) <= max(control) else "no"
        rows.append("| bnb vs fp32-hb (its own math) | " + " | ".join(f"{x:+.3f}%" for x in vals)
                    + f" | {max(map(abs, vals)):.3f}% | | {each} | {spread} |")
    fp32 = [statistics.fmean(runs[s]["fp32"][end - rf.LAST_WINDOW:end]) for s in seeds]
    rows.append("| (fp32 last-100 mean loss) | " + " | ".join(f"{x:.4f}" for x in fp32)
                + f" | | {state['fp32']:.3f} | | |")
    return "\n".join(rows)


def print_saved(paths: list[str]) -> None:
    """The tables of ``--json`` files, their runs merged per family and seed (same fp32 curve required: runs of
    one setting)."""
    merged: dict = {}
    steps = set()
    for path in paths:
        with open(path) as f:
            saved = json.load(f)
        print(f"{path}: {saved['args']}")
        steps.add(saved["args"]["steps"])
        for family, res in saved["results"].items():
            fam = merged.setdefault(family, {"runs": {}, "state": {}})
            fam["state"].update(res["state"])
            for seed, curves in res["runs"].items():
                into = fam["runs"].setdefault(int(seed), {})
                if "fp32" in into and into["fp32"] != curves["fp32"]:
                    raise SystemExit(f"{path}: {family} seed {seed}'s fp32 curve differs from an earlier file's")
                into.update(curves)
    if len(steps) != 1:
        raise SystemExit(f"the files have different --steps: {sorted(steps)}")
    end = steps.pop()
    for family, res in merged.items():
        print(f"\n{family_table(family, res['runs'], res['state'], end)}")


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.from_json:
        print_saved(args.from_json)
        return
    args.data, args.warmup = PRESET["data"], PRESET["warmup"]
    if args.steps < rf.LAST_WINDOW:
        parser.error(f"--steps must be at least {rf.LAST_WINDOW}")
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    STEPS[0] = args.steps
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict = {}
    for family in families:
        runs, states = {}, {}
        for seed in seeds:
            runs[seed], states[seed] = run_seed(args, family, seed)
            results[family] = {"runs": {str(s): c for s, c in runs.items()}, "state": states[seeds[0]]}
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"args": vars(args), "results": results}, f)
        results[family]["table"] = family_table(family, runs, states[seeds[0]], args.steps)
    cfg, _ = rf.model_config(args.size)
    n = sum(p.numel() for p in mc.GPT(**cfg).parameters())
    print(f"{args.size} ({n / 1e6:.2f} M params, {args.data} data), from scratch, {args.steps} steps, warm-up "
          f"{args.warmup}, seeds {args.seeds}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"Muon {MUON} + AdamW {ADAMW}; SGD {SGD}; Lion {LION}; RMSprop {RMSPROP}; Adagrad {ADAGRAD}; NAdam {NADAM}; "
          f"RAdam {RADAM}; AdEMAMix {ADEMAMIX}; noise control {SIGMA:g} relative")
    for family in families:
        print(f"\n{results[family]['table']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f)


if __name__ == "__main__":
    main()
