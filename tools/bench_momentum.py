"""Step time and state memory of ckptq's one-state optimizers (SGD8bit, Lion8bit, Muon8bit; --four: the 4-bit
ones) against torch / lion-pytorch and bitsandbytes, side by side, on ``tools/bench_optim.py``'s layouts.

``bench_optim``'s method (its layouts, weights and gradients, its interleaved rounds, its state count): per
family, every optimizer owns a copy of the same parameters and fixed gradients; after ``--warmup`` steps each,
every round runs one step of each optimizer in turn, starting with a different one, so that load from other
processes hits all alike. Medians and ratios to the family's torch row, as markdown tables. Families run one
after another (only one family's copies are alive at a time).

  sgd   torch.optim.SGD (momentum 0.9, Nesterov, foreach=True) | ckptq SGD8bit | bitsandbytes SGD8bit (heavy-ball:
        it accepts nesterov and ignores it)
  lion  lion-pytorch Lion (lr 1e-4, betas (0.9, 0.99), weight decay 1e-2) | ckptq Lion8bit | bitsandbytes Lion8bit
  muon  torch.optim.Muon (its defaults, lr 1e-3) | ckptq Muon8bit, on the layout's 2-D tensors only

Which kernel ran ckptq's step is printed: ``ckptq.codec.ops.momentum_backend`` is recorded on each call (the C
kernels' module has no ``momentum_step`` yet on main, so the CPU runs the PyTorch reference).

    python tools/bench_momentum.py --layout d256x48 --threads 2 --rounds 7
    python tools/bench_momentum.py --layout many-small --threads 2 --rounds 15
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_optim  # noqa: E402  (tools/ is not a package)

from ckptq.codec import ops  # noqa: E402
from ckptq.kernels import backend_native  # noqa: E402
from ckptq.optim import Lion4bit, Lion8bit, Muon4bit, Muon8bit, SGD4bit, SGD8bit  # noqa: E402

SGD = dict(lr=1e-3, momentum=0.9, nesterov=True)
LION = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=1e-2)
MUON = dict(lr=1e-3)  # torch's defaults: weight decay 0.1, momentum 0.95, Nesterov, 5 Newton-Schulz steps


def _bnb(name: str):
    import bitsandbytes.optim

    return getattr(bitsandbytes.optim, name)


def _lion():
    from lion_pytorch import Lion

    return Lion


# family -> [(label, f(params) -> optimizer)]; the first is the baseline of the ratios
FAMILIES = {
    "sgd": [("torch SGD foreach", lambda ps: torch.optim.SGD(ps, foreach=True, **SGD)),
            ("ckptq SGD8bit", lambda ps: SGD8bit(ps, **SGD)),
            ("bitsandbytes SGD8bit", lambda ps: _bnb("SGD8bit")(ps, **SGD)),
            ("ckptq SGD4bit", lambda ps: SGD4bit(ps, **SGD))],
    "lion": [("lion-pytorch Lion", lambda ps: _lion()(ps, **LION)),
             ("ckptq Lion8bit", lambda ps: Lion8bit(ps, **LION)),
             ("bitsandbytes Lion8bit", lambda ps: _bnb("Lion8bit")(ps, **LION)),
             ("ckptq Lion4bit", lambda ps: Lion4bit(ps, **LION))],
    "muon": [("torch Muon", lambda ps: torch.optim.Muon(ps, **MUON)),
             ("ckptq Muon8bit", lambda ps: Muon8bit(ps, **MUON)),
             ("ckptq Muon4bit", lambda ps: Muon4bit(ps, **MUON))],
}

BACKENDS: set[str] = set()
_momentum_backend = ops.momentum_backend


def _recording_backend(*args, **kwargs):
    impl = _momentum_backend(*args, **kwargs)
    BACKENDS.add(impl.__name__.rsplit(".", 1)[-1])
    return impl


ops.momentum_backend = _recording_backend  # grouped.momentum_group looks it up on ops at each call


def build(entries, weights, grads) -> dict:
    """Each optimizer gets its own copy of the weights and gradients (as ``bench_optim.build``)."""
    opts = {}
    for name, factory in entries:
        params = [w.clone().requires_grad_(True) for w in weights]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opts[name] = factory(params)
    return opts


def table(family, opts, first, times, numel: int, tensors: int) -> str:
    median = {name: statistics.median(ts) for name, ts in times.items()}
    base = next(iter(median))
    bnb = next((n for n in median if n.startswith("bitsandbytes")), None)
    head = f"| {family} | ms/step | µs/tensor | vs {base} | vs bitsandbytes | state B/param | first step s |"
    rows = [head, "|---|" + "---:|" * (head.count("|") - 2)]
    for name, opt in opts.items():
        cells = [name, f"{median[name] * 1e3:.2f}", f"{median[name] * 1e6 / tensors:.1f}",
                 f"{median[name] / median[base]:.2f}x", f"{median[name] / median[bnb]:.2f}x" if bnb else "-",
                 f"{bench_optim.state_bytes(opt) / numel:.3f}", f"{first[name]:.2f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="d256x48", choices=["many-small", "d256x48", "gpt2-124m", "flat4"])
    parser.add_argument("--families", default="sgd,lion,muon", help="comma list of " + ", ".join(FAMILIES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3, help="steps per optimizer before timing (>= 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--four", action="store_true", help="also the 4-bit variants")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = bench_optim.layout_shapes(args.layout)
    weights, grads = bench_optim.make_params(shapes, "cpu", args.seed)
    print(f"layout {args.layout}: {sum(w.numel() for w in weights) / 1e6:.1f} M params in {len(shapes)} tensors, "
          f"{args.rounds} interleaved rounds after {max(1, args.warmup)} warm-up steps; "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, {os.cpu_count()} CPUs; backend_native has momentum_step: "
          f"{hasattr(backend_native, 'momentum_step')}")
    for family in [f for f in args.families.split(",") if f]:
        entries = [e for e in FAMILIES[family] if args.four or "4bit" not in e[0]]
        keep = [i for i, w in enumerate(weights) if family != "muon" or w.dim() == 2]
        w, g = [weights[i] for i in keep], [grads[i] for i in keep]
        BACKENDS.clear()
        opts = build(entries, w, g)
        first, times = bench_optim.run(opts, max(1, args.warmup), args.rounds, False)
        numel = sum(x.numel() for x in w)
        print(f"\n{family}: {numel / 1e6:.1f} M params in {len(w)} tensors; ckptq's one-state step ran on "
              f"{', '.join(sorted(BACKENDS)) or 'no grouped kernel (every tensor under min_size: fp32 state)'}\n")
        print(table(family, opts, first, times, numel, len(w)))
        del opts


if __name__ == "__main__":
    main()
