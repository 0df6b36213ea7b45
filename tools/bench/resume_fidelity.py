"""Does training resume from 8-bit optimizer state as if it had never stopped? Loss curves, side by side.

Trains the GPT of ``tools/scripts/make_checkpoint.py`` on the CPU with ``torch.optim.AdamW`` for ``--pretrain``
steps, saves a checkpoint, then continues ``--steps`` steps on identical batches from:

  (a) fp32      torch AdamW with the checkpoint's own state (the reference)
  (b) ckptq     ckptq AdamW8bit from ``ckptq.convert``'s file (``ckptq.load(...)["optimizer"]``)
  (c) expanded  torch AdamW from ``ckptq.expand`` of that file (8-bit state back in fp32)
  (d) bnb       bitsandbytes AdamW8bit given the same fp32 moments through its own quantizer
  (e) fresh     torch AdamW with no state (the state lost: the floor)
  (f) ckptq4    ckptq AdamW4bit from ``ckptq.convert(..., bits=4)``'s file
  (g) expanded4 torch AdamW from ``ckptq.expand`` of the 4-bit file
(``--variants`` picks a subset.)

``--from-scratch`` trains instead from the same initialization, without a checkpoint, for ``--steps``
steps: fp32, ckptq (AdamW8bit), ckptq4 (AdamW4bit), bnb (bitsandbytes AdamW8bit), ao4 / ao8 (torchao
AdamW4bit / AdamW8bit) and two controls, noise1 / noise001 (fp32 AdamW with every gradient element
multiplied by 1 + 1% / 0.01% Gaussian noise, seeded: what an unbiased perturbation of that size does to the
loss), each with its own state from the first step. ``--seeds 0,1,2,3,4`` runs every seed and prints, per
``--windows`` entry, the mean loss of the 100 steps up to it against fp32's on the same seed (all windows
from one run: the lr is constant after warm-up). ``--preset english``: a byte-level
GPT-2 (n_embd 128, 2 layers, 4 heads) on 16 x 128 bytes of English text (``english_text``: Python's own
help topics, offline), lr 3e-3 after 30 warm-up steps; the default is make_checkpoint's Zipf chains on
the mid model, lr 3e-3 from step 1. Both use betas (0.9, 0.95) and weight decay 0.1 (``--betas``).

Per variant: mean loss over the continuation and max loss over its first 20 steps, each against (a)
(difference and ratio). (b) and (c) should sit as close to (a) as (d) does; (e) spikes.

    python tools/bench/resume_fidelity.py --plot /tmp/resume.png          # ~3 min on 2 cores
    python tools/bench/resume_fidelity.py --size small --pretrain 600 --steps 500
    python tools/bench/resume_fidelity.py --preset english --seeds 0,1,2,3,4 --steps 1000 --windows 300,1000
    python tools/bench/resume_fidelity.py --from-scratch --seeds 0,1,2,3,4 --steps 1000 --windows 300,1000 \
        --variants noise1,noise001,ckptq,ckptq4,bnb --json /tmp/curves.json

bitsandbytes cannot load a torch state dict (its state is ``state1``/``state2`` codes with
``absmax1``/``absmax2`` per block of 256 and maps ``qmap1``/``qmap2``; tensors under 4096 elements keep
fp32 ``state1``/``state2``), so (d) creates its state with one zero-lr step on zero gradients and then
overwrites it with ``bitsandbytes.functional.quantize_blockwise`` of the fp32 moments under its maps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

VARIANTS = ("fp32", "ckptq", "expanded", "bnb", "fresh", "ckptq4", "expanded4")
SCRATCH_VARIANTS = ("fp32", "noise1", "noise001", "ckptq", "ckptq-sr", "ckptq4", "bnb", "ao4", "ao8")
NOISE = {"noise1": 1e-2, "noise001": 1e-4}  # the controls: relative Gaussian gradient noise
# Issue 23's setting: byte-level GPT-2 (n_embd 128, 2 layers, 4 heads), 16 x 128 bytes of English text,
# lr 3e-3 after 30 linear warm-up steps, betas (0.9, 0.95) and weight decay 0.1 (make_checkpoint's).
PRESETS = {"english": dict(size="byte128", data="text", lr=3e-3, warmup=30),
           # #31's second model/corpus pair: a 3-layer byte-level GPT of width 96 on Python source (the standard
           # library's own modules, offline), lr 2e-3 after 30 warm-up steps
           "pysrc": dict(size="byte96x3", data="pysrc", lr=2e-3, warmup=30),
           # the project's default setting (make_checkpoint's Zipf chains, the mid model), warmed up as the others
           "zipf": dict(size="mid", data="zipf", lr=3e-3, warmup=30)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="mid", help="tiny, small, mid, byte128 or byte96x3")
    parser.add_argument("--pretrain", type=int, default=400, help="torch AdamW steps before the checkpoint")
    parser.add_argument("--steps", type=int, default=300, help="steps after resuming (from scratch: in all)")
    parser.add_argument("--lr", type=float, default=None, help="default: make_checkpoint's, 3e-3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--plot", help="write the loss curves to this PNG")
    parser.add_argument("--workdir", help="keep the checkpoints here (default: a temporary folder)")
    parser.add_argument("--variants", default=None, help=f"comma list of {', '.join(VARIANTS)} (--from-scratch: "
                        f"{', '.join(SCRATCH_VARIANTS)}; fp32 always runs)")
    parser.add_argument("--from-scratch", action="store_true", help="train every variant from initialization instead")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="from scratch in a named setting (sets --size, "
                        "--data, --lr, --warmup)")
    parser.add_argument("--data", choices=("zipf", "text", "pysrc"), default="zipf", help="from scratch: "
                        "make_checkpoint's Zipf chains, English text bytes or Python source bytes")
    parser.add_argument("--warmup", type=int, default=0, help="from scratch: linear lr warm-up steps")
    parser.add_argument("--betas", type=lambda x: tuple(float(b) for b in x.split(",")), default=None,
                        help="from scratch: Adam's betas (default: make_checkpoint's, 0.9,0.95)")
    parser.add_argument("--seeds", help="from scratch: comma list of seeds, all run; a table per --windows")
    parser.add_argument("--windows", help="from scratch with --seeds: comma list of last steps of the 100-step "
                        "windows compared (default: --steps)")
    parser.add_argument("--json", help="from scratch with --seeds: write every loss curve here")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import make_checkpoint as mc  # noqa: E402  (tools/scripts/ is not a package)

import ckptq  # noqa: E402
from ckptq.optim import AdamW4bit, AdamW8bit  # noqa: E402

# make_checkpoint's sizes plus "mid" (~0.67 M params), the default: big enough that the moments matter,
# small enough that five continuations run in a few minutes on 2 cores.
# "byte128": a byte-level GPT-2 on English text (``--preset english``).
SIZES = {**mc.SIZES, "mid": dict(vocab_size=2048, n_layer=2, n_head=4, n_embd=128, block_size=64, batch_size=16),
         "byte128": dict(vocab_size=256, n_layer=2, n_head=4, n_embd=128, block_size=128, batch_size=16),
         "byte96x3": dict(vocab_size=256, n_layer=3, n_head=4, n_embd=96, block_size=128, batch_size=16)}
VAL_BATCHES = 8  # held-out batches for the validation loss (text: the corpus' last 10%, never trained on)
# More --from-scratch variants by name: name -> f(param groups, lr, seed) -> optimizer (for experiments
# that import this module).
SCRATCH_FACTORIES: dict = {}
LAST_WINDOW = 100
SPIKE_WINDOW = 20


def model_config(size: str) -> tuple[dict, int]:
    cfg = dict(SIZES[size])
    return cfg, cfg.pop("batch_size")


def param_groups(model: torch.nn.Module, lr: float, betas=mc.BETAS) -> list[dict]:
    """make_checkpoint's (= nanoGPT's) two groups: decay on >= 2-D tensors only."""
    groups = mc.make_optimizer(model).param_groups
    return [dict(params=g["params"], weight_decay=g["weight_decay"], lr=lr, betas=tuple(betas)) for g in groups]


def set_lr(opt, base: list[float], factor: float) -> None:
    """Each group's lr = its base lr x ``factor`` (in place where torchao keeps lr as a tensor)."""
    for group, lr in zip(opt.param_groups, base):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr * factor)
        else:
            group["lr"] = lr * factor


def train_steps(model, opt, batches, losses: list[float] | None = None, schedule=None, after=None) -> None:
    """make_checkpoint's step: loss, backward, clip at 1.0, step; appends each loss to ``losses``.
    ``schedule``: lr factor of step t (t from 1), applied to each group's lr as it was on entry; ``after``:
    called with t after step t."""
    base = [float(g["lr"]) for g in opt.param_groups]
    for t, (x, y) in enumerate(batches, start=1):
        if schedule is not None:
            set_lr(opt, base, schedule(t))
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if losses is not None:
            losses.append(loss.item())
        if after is not None:
            after(t)


def batches(cfg: dict, batch_size: int, perm: torch.Tensor, count: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [mc.make_batch(cfg["vocab_size"], batch_size, cfg["block_size"], perm, gen) for _ in range(count)]


def pretrain(size: str, steps: int, lr: float, seed: int, path: str) -> torch.Tensor:
    """Train with torch AdamW, save a nanoGPT-style checkpoint at ``path``; return the token permutation."""
    cfg, batch_size = model_config(size)
    torch.manual_seed(seed)
    perm = mc._transition_table(cfg["vocab_size"], torch.Generator().manual_seed(seed))
    model = mc.GPT(**cfg)
    opt = torch.optim.AdamW(param_groups(model, lr), lr=lr)
    train_steps(model, opt, batches(cfg, batch_size, perm, steps, seed + 1))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "model_args": cfg, "iter_num": steps}, path)
    return perm


def bnb_optimizer(model: torch.nn.Module, lr: float, torch_state: dict):
    """bitsandbytes AdamW8bit holding ``torch_state``'s fp32 moments, quantized by bitsandbytes itself."""
    import bitsandbytes.functional as bnbf
    import bitsandbytes.optim

    opt = bitsandbytes.optim.AdamW8bit(param_groups(model, lr), lr=lr)
    params = [p for g in opt.param_groups for p in g["params"]]
    saved_lr = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # creates state1/state2 (+ absmax, qmaps) for every parameter; lr 0, zero grads: no update
    for g, lr_g in zip(opt.param_groups, saved_lr):
        g["lr"] = lr_g
    for index, p in enumerate(params):
        src, dst = torch_state["state"][index], opt.state[p]
        dst["step"] = int(src["step"])
        for slot, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
            moment = src[key].float().reshape(p.shape)
            if dst[f"state{slot}"].dtype == torch.uint8:
                codes, qs = bnbf.quantize_blockwise(moment, code=dst[f"qmap{slot}"], blocksize=256)
                dst[f"state{slot}"].copy_(codes)
                dst[f"absmax{slot}"].copy_(qs.absmax)
            else:
                dst[f"state{slot}"].copy_(moment)
    opt.zero_grad(set_to_none=True)
    return opt


def start(variant: str, size: str, lr: float, paths: dict):
    """(model, optimizer) for one variant, weights from the file that variant resumes from."""
    cfg, _ = model_config(size)
    model = mc.GPT(**cfg)
    if variant in ("ckptq", "ckptq4"):
        ckpt = ckptq.load(paths["q8" if variant == "ckptq" else "q4"])
        model.load_state_dict(ckpt["model"])
        opt = (AdamW8bit if variant == "ckptq" else AdamW4bit)(param_groups(model, lr), lr=lr)
        opt.load_state_dict(ckpt["optimizer"])
        return model, opt
    ckpt = torch.load(paths[variant if variant.startswith("expanded") else "fp32"], weights_only=True)
    model.load_state_dict(ckpt["model"])
    if variant == "bnb":
        return model, bnb_optimizer(model, lr, ckpt["optimizer"])
    opt = torch.optim.AdamW(param_groups(model, lr), lr=lr)
    if variant != "fresh":
        opt.load_state_dict(ckpt["optimizer"])
    return model, opt


def summary(curves: dict[str, list[float]]) -> str:
    ref = curves["fp32"]
    ref_mean, ref_max, ref_last = statistics.fmean(ref), max(ref[:SPIKE_WINDOW]), statistics.fmean(ref[-LAST_WINDOW:])
    rows = [
        f"| variant | mean loss | Δ mean vs fp32 | ratio | max loss first {SPIKE_WINDOW} | Δ max vs fp32 | ratio "
        f"| max step Δ first {SPIKE_WINDOW} | mean loss last {LAST_WINDOW} | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, losses in curves.items():
        mean, peak, last = statistics.fmean(losses), max(losses[:SPIKE_WINDOW]), statistics.fmean(losses[-LAST_WINDOW:])
        # Batches are identical, so the per-step difference cancels batch noise: the spike itself.
        step_gap = max(a - b for a, b in zip(losses[:SPIKE_WINDOW], ref))
        rows.append(
            f"| {name} | {mean:.4f} | {mean - ref_mean:+.4f} | {mean / ref_mean:.4f} "
            f"| {peak:.4f} | {peak - ref_max:+.4f} | {peak / ref_max:.4f} | {step_gap:+.4f} "
            f"| {last:.4f} | {last / ref_last:.4f} |"
        )
    return "\n".join(rows)


class NoisyAdamW(torch.optim.AdamW):
    """fp32 torch AdamW that multiplies each gradient element by (1 + ``sigma`` * N(0, 1)) before stepping,
    from its own seeded generator: an unbiased perturbation of known size, the control rows."""

    def __init__(self, params, sigma: float, seed: int, **kwargs):
        super().__init__(params, **kwargs)
        self.sigma, self.gen = sigma, torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(torch.randn(p.grad.shape, generator=self.gen).mul_(self.sigma).add_(1.0))
        return super().step(closure)


def _third_party(variant: str, groups: list[dict], lr: float):
    """bitsandbytes AdamW8bit (``bnb``), torchao AdamW4bit / AdamW8bit (``ao4`` / ``ao8``, lr a tensor as
    torchao requires)."""
    if variant == "bnb":
        import bitsandbytes.optim

        return bitsandbytes.optim.AdamW8bit(groups, lr=lr)
    import torchao.optim

    cls = {"ao4": torchao.optim.AdamW4bit, "ao8": torchao.optim.AdamW8bit}[variant]
    for g in groups:
        g["lr"] = torch.tensor(g["lr"])
    return cls(groups, lr=torch.tensor(lr))


def scratch_optimizer(variant: str, model: torch.nn.Module, lr: float, seed: int = 0, betas=mc.BETAS):
    """A fresh optimizer of ``--from-scratch``'s variant for ``model`` (``seed``: the noise controls' own)."""
    groups = param_groups(model, lr, betas)
    if variant in SCRATCH_FACTORIES:
        return SCRATCH_FACTORIES[variant](groups, lr, seed)
    if variant in NOISE:
        return NoisyAdamW(groups, NOISE[variant], seed + 7919, lr=lr)
    if variant in ("bnb", "ao4", "ao8"):
        return _third_party(variant, groups, lr)
    if variant == "ckptq-sr":
        return AdamW8bit(groups, lr=lr, rounding="stochastic")
    cls = {"fp32": torch.optim.AdamW, "ckptq": AdamW8bit, "ckptq4": AdamW4bit}[variant]
    return cls(groups, lr=lr)


def english_text() -> torch.Tensor:
    """Plain English text, offline and deterministic: the bytes of Python's own help topics (the language
    reference's prose, ``pydoc_data.topics``, ~466 KB in Python 3.11), in sorted topic order, as int64 ids."""
    import pydoc_data.topics

    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def python_source() -> torch.Tensor:
    """Python source code, offline and deterministic: the bytes of the standard library's ``json``, ``email``,
    ``http``, ``logging``, ``unittest`` and ``asyncio`` packages (their .py files in sorted order), as int64 ids."""
    import pathlib
    import sysconfig

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for pkg in ("json", "email", "http", "logging", "unittest", "asyncio")
                   for f in (root / pkg).rglob("*.py") if "test" not in f.parts[-2:-1])
    text = b"\n".join(f.read_bytes() for f in files)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def corpus(data: str, part: str) -> torch.Tensor:
    """A byte corpus' training part (its first 90%) or its held-out part (the last 10%)."""
    ids = english_text() if data == "text" else python_source()
    cut = ids.numel() * 9 // 10
    return ids[:cut] if part == "train" else ids[cut:]


def text_batches(cfg: dict, batch_size: int, count: int, seed: int, data: str = "text", part: str = "train") -> list:
    """``count`` batches of ``batch_size`` random windows of a byte corpus' ``part`` (inputs, next-byte targets)."""
    data, block = corpus(data, part), cfg["block_size"]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        starts = torch.randint(data.numel() - block - 1, (batch_size,), generator=gen)
        rows = torch.stack([data[s : s + block + 1] for s in starts.tolist()])
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


def scratch_data(args, seed: int) -> list:
    """The batches of one seed: English bytes for ``--data text``, make_checkpoint's Zipf chains otherwise."""
    cfg, batch_size = model_config(args.size)
    if args.data in ("text", "pysrc"):
        return text_batches(cfg, batch_size, args.steps, seed + 1, args.data)
    perm = mc._transition_table(cfg["vocab_size"], torch.Generator().manual_seed(seed))
    return batches(cfg, batch_size, perm, args.steps, seed + 1)


def validation_data(args, seed: int) -> list:
    """``VAL_BATCHES`` held-out batches: windows of the corpus' last 10% (text), or fresh chains from the same
    transition table (zipf: an unlimited source, so new samples are unseen ones)."""
    cfg, batch_size = model_config(args.size)
    if args.data in ("text", "pysrc"):
        return text_batches(cfg, batch_size, VAL_BATCHES, 10_000 + seed, args.data, "val")
    perm = mc._transition_table(cfg["vocab_size"], torch.Generator().manual_seed(seed))
    return batches(cfg, batch_size, perm, VAL_BATCHES, 10_000 + seed)


@torch.no_grad()
def validation_loss(model, data: list) -> float:
    was = model.training
    model.eval()
    loss = statistics.fmean(float(model(x, y)) for x, y in data)
    model.train(was)
    return loss


def warmup_schedule(warmup: int):
    """lr factor of step t (from 1): t / warmup for the first ``warmup`` steps, then 1; None without warm-up."""
    return (lambda t: min(1.0, t / warmup)) if warmup > 0 else None


def from_scratch_seed(args, seed: int, val: dict | None = None) -> dict[str, list[float]]:
    """Every variant trained from the same initialization on the same batches, for one seed; ``val`` (a dict)
    receives each variant's held-out loss at the end of every ``--windows`` window: {variant: {step: loss}}."""
    cfg, _ = model_config(args.size)
    data = scratch_data(args, seed)
    held_out = validation_data(args, seed)
    ends = set(getattr(args, "window_list", None) or [args.steps])
    curves: dict[str, list[float]] = {}
    for variant in ["fp32"] + [v for v in args.variants.split(",") if v != "fp32"]:
        torch.manual_seed(seed)
        model = mc.GPT(**cfg)
        opt = scratch_optimizer(variant, model, args.lr, seed, args.betas)
        seen = (val if val is not None else {}).setdefault(variant, {})
        train_steps(model, opt, data, curves.setdefault(variant, []), warmup_schedule(args.warmup),
                    lambda t: seen.__setitem__(t, validation_loss(model, held_out)) if t in ends else None)
        print(f"seed {seed} {variant}: last {LAST_WINDOW} mean {statistics.fmean(curves[variant][-LAST_WINDOW:]):.4f}",
              file=sys.stderr, flush=True)
    return curves


def from_scratch(args) -> tuple[dict[str, list[float]], str]:
    """``from_scratch_seed`` for ``--seed`` (the single-seed report)."""
    return from_scratch_seed(args, args.seed), f"trained from scratch, lr {args.lr:g}, warm-up {args.warmup}"


def window_ratio(losses: list[float], ref: list[float], end: int) -> float:
    """Mean loss over the ``LAST_WINDOW`` steps ending at step ``end``, relative to ``ref``'s, minus 1."""
    lo = max(0, end - LAST_WINDOW)
    return statistics.fmean(losses[lo:end]) / statistics.fmean(ref[lo:end]) - 1.0


def seed_table(runs: dict[int, dict[str, list[float]]], end: int) -> str:
    """Per variant and seed: mean loss of the last 100 steps up to ``end`` vs fp32 on the same seed, and the
    largest deviation over the seeds."""
    seeds = sorted(runs)
    variants = [v for v in runs[seeds[0]] if v != "fp32"]
    head = f"| steps {max(1, end - LAST_WINDOW + 1)}-{end} vs fp32 | " + " | ".join(f"seed {s}" for s in seeds)
    rows = [head + " | max abs |",
            "|---|" + "---:|" * (len(seeds) + 1)]
    for v in variants:
        vals = [100 * window_ratio(runs[s][v], runs[s]["fp32"], end) for s in seeds]
        rows.append(f"| {v} | " + " | ".join(f"{x:+.2f}%" for x in vals) + f" | {max(map(abs, vals)):.2f}% |")
    fp32 = [statistics.fmean(runs[s]["fp32"][max(0, end - LAST_WINDOW):end]) for s in seeds]
    rows.append("| (fp32 mean loss) | " + " | ".join(f"{x:.4f}" for x in fp32) + " | |")
    return "\n".join(rows)


def val_table(vals: dict[int, dict[str, dict[int, float]]], end: int) -> str:
    """Per variant and seed: the held-out loss after step ``end`` vs fp32's on the same seed."""
    seeds = sorted(vals)
    variants = [v for v in vals[seeds[0]] if v != "fp32"]
    rows = [f"| validation loss at step {end} vs fp32 | " + " | ".join(f"seed {s}" for s in seeds) + " | max abs |",
            "|---|" + "---:|" * (len(seeds) + 1)]
    for v in variants:
        xs = [100 * (vals[s][v][end] / vals[s]["fp32"][end] - 1) for s in seeds]
        rows.append(f"| {v} | " + " | ".join(f"{x:+.2f}%" for x in xs) + f" | {max(map(abs, xs)):.2f}% |")
    rows.append("| (fp32 validation loss) | " + " | ".join(f"{vals[s]['fp32'][end]:.4f}" for s in seeds) + " | |")
    return "\n".join(rows)


def many_seeds(args) -> None:
    """``--seeds``: every seed, then per ``--windows`` entry a table of the train loss (last 100 steps) and
    one of the held-out loss (the curves and held-out losses to ``--json``, rewritten after each seed)."""
    runs, vals = {}, {}
    for seed in args.seed_list:
        vals[seed] = {}
        runs[seed] = from_scratch_seed(args, seed, vals[seed])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "runs": {str(s): c for s, c in runs.items()},
                           "val": {str(s): v for s, v in vals.items()}}, f)
    cfg, _ = model_config(args.size)
    n = sum(p.numel() for p in mc.GPT(**cfg).parameters())
    print(f"{args.size} ({n / 1e6:.2f} M params, {args.data} data), from scratch, lr {args.lr:g}, warm-up "
          f"{args.warmup}, betas {args.betas}, seeds {','.join(map(str, args.seed_list))}")
    for end in args.window_list:
        print(f"\n{seed_table(runs, end)}\n\n{val_table(vals, end)}")


def _running_mean(xs: list[float], width: int) -> list[float]:
    return [statistics.fmean(xs[max(0, i - width + 1): i + 1]) for i in range(len(xs))]


def plot(curves: dict[str, list[float]], path: str, title: str) -> None:
    """Left: loss (running mean over 10 steps); right: loss minus fp32's on the same batch, per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, gap_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    ref = curves["fp32"]
    for name, losses in curves.items():
        steps = range(1, len(losses) + 1)
        loss_ax.plot(steps, _running_mean(losses, 10), label=name, lw=1)
        gap_ax.plot(steps, [a - b for a, b in zip(losses, ref)], label=name, lw=1)
    loss_ax.set(xlabel="steps after resume", ylabel="training loss (running mean of 10)", title=title)
    gap_ax.set(xlabel="steps after resume", ylabel="loss - fp32 loss (same batch)", title="gap to fp32 resume")
    loss_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.preset:
        args.from_scratch = True
        vars(args).update(PRESETS[args.preset])
    if args.size not in SIZES:
        parser.error(f"unknown --size {args.size}; choose from {', '.join(sorted(SIZES))}")
    args.lr = mc.LEARNING_RATE if args.lr is None else args.lr
    args.betas = args.betas or mc.BETAS
    if args.seeds:
        args.from_scratch = True
        args.seed_list = [int(s) for s in args.seeds.split(",")]
        args.window_list = [int(w) for w in (args.windows or str(args.steps)).split(",")]
    if args.variants is None:
        args.variants = ",".join(SCRATCH_VARIANTS if args.from_scratch else VARIANTS)
    known = (*SCRATCH_VARIANTS, *SCRATCH_FACTORIES) if args.from_scratch else VARIANTS
    unknown = [v for v in args.variants.split(",") if v not in known]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.seeds:
        many_seeds(args)
        return
    if args.from_scratch:
        curves, setting = from_scratch(args)
    else:
        curves, setting = resume(args)
    cfg, _ = model_config(args.size)
    n = sum(p.numel() for p in mc.GPT(**cfg).parameters())
    title = f"{args.size} ({n / 1e6:.2f} M params), {setting}"
    print(f"{title}; {args.steps} steps on identical batches\n")
    print(summary(curves))
    if args.plot:
        plot(curves, args.plot, title)
        print(f"\nwrote {args.plot}")


def resume(args) -> tuple[dict[str, list[float]], str]:
    """fp32 and the chosen variants resumed from one torch AdamW checkpoint of ``--pretrain`` steps."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.workdir or tmp
        os.makedirs(folder, exist_ok=True)
        paths = {k: os.path.join(folder, f) for k, f in (("fp32", "ckpt.pt"), ("q8", "ckpt.q8.safetensors"),
                                                          ("q4", "ckpt.q4.safetensors"))}
        perm = pretrain(args.size, args.pretrain, args.lr, args.seed, paths["fp32"])
        ckptq.convert(paths["fp32"], paths["q8"], force=True)
        ckptq.convert(paths["fp32"], paths["q4"], bits=4, force=True)
        paths["expanded"] = ckptq.expand(paths["q8"], os.path.join(folder, "ckpt.expanded.pt"), force=True).output
        paths["expanded4"] = ckptq.expand(paths["q4"], os.path.join(folder, "ckpt.expanded4.pt"), force=True).output
        cfg, batch_size = model_config(args.size)
        data = batches(cfg, batch_size, perm, args.steps, args.seed + 2)
        curves: dict[str, list[float]] = {}
        chosen = ["fp32"] + [v for v in args.variants.split(",") if v in VARIANTS and v != "fp32"]
        for variant in chosen:
            torch.manual_seed(args.seed)
            model, opt = start(variant, args.size, args.lr, paths)
            train_steps(model, opt, data, curves.setdefault(variant, []))
    return curves, f"resumed at step {args.pretrain}, lr {args.lr:g}"


if __name__ == "__main__":
    main()
