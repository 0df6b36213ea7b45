"""Step time and state memory of ckptq's low-bit optimizers against torch's and other libraries', family by
family, side by side, on the tensor shapes of real models.

Per family every optimizer owns a copy of the same parameters (the shapes of ``--layout``) and fixed random
gradients; after ``--warmup`` steps each (the first one, which includes torch.compile for torchao and
building C kernels, is reported separately), interleaved rounds (harness.py) run one step of every
optimizer in turn. Families run one after another: only one family's copies are alive at a time.

Columns (``--only`` picks by key; a column whose library is missing or cannot run here says so in one line
and is left out):
  every family   ckptq (the 8-bit class, round to nearest), ckptq-sr (rounding="stochastic"), ckptq4 (the
                 4-bit class); ckptq-torch (backend="torch", the PyTorch reference) and ckptq-cap
                 (capturable=True) only when named in --only or with --reference
  adamw          torch-fused, torch-foreach (torch.optim.AdamW), bnb (bitsandbytes AdamW8bit), torchao /
                 torchao4 (torchao AdamW8bit / AdamW4bit), deepspeed (DeepSpeedCPUAdam, adamw_mode=True, fp32
                 state; CPU only, its C++ op is built on first use); with --gpu: ckptq-graph, torch-graph
                 (a capturable step captured once in a CUDA graph and replayed)
  sgd            torch-fused, torch-foreach (momentum 0.9, Nesterov), bnb SGD8bit (heavy-ball: it accepts
                 nesterov and ignores it)
  lion           lion-pytorch Lion (the baseline), bnb Lion8bit
  muon           torch-foreach (torch.optim.Muon, its defaults); the layout's 2-D tensors only
  rmsprop        torch-foreach, bnb RMSprop8bit
  adagrad        torch-fused, torch-foreach, bnb Adagrad8bit
  nadam, radam   torch-foreach
  ademamix       bnb-fp32 (bitsandbytes AdEMAMix, fp32 state: the baseline), bnb AdEMAMix8bit

Layouts (no weights needed, only shapes):
  many-small   256 tensors of 4,096 (the per-tensor cost)
  d256x48      48 transformer layers of width 256: 384 tensors, 37.9 M parameters
  gpt2-124m    GPT-2 small: 148 tensors, 124 M parameters
  llama-1b     Llama-3.2-1B: 146 tensors, 1.24 G parameters (needs ~10 GB per optimizer: GPU)
  flat4        16.8 M parameters in 4 tensors

    python tools/bench/optim.py --family adamw --layout d256x48 --rounds 9 --threads 2
    python tools/bench/optim.py --family all --layout many-small --rounds 15 --threads 2
    python tools/bench/optim.py --family adamw --layout gpt2-124m --gpu --rounds 20      # a CUDA machine

Table columns: ms/step (median), µs per tensor, the ratio to the family's baseline (torch fused, else torch
foreach, else the fp32 optimizer named above) and to bitsandbytes' 8-bit class, state bytes per parameter
(every distinct storage reachable from ``opt.state``), GB/s of the bytes the update must move at least (read
the gradient, read and write the parameter and the state: numel x (4 + 8 + 2 x state B/param)), and the first
step's seconds.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P leaves the tool's folder off sys.path
import harness  # noqa: E402

FAMILIES = ("adamw", "sgd", "lion", "muon", "rmsprop", "adagrad", "nadam", "radam", "ademamix")
CKPTQ_CLASS = {"adamw": "AdamW", "sgd": "SGD", "lion": "Lion", "muon": "Muon", "rmsprop": "RMSprop",
               "adagrad": "Adagrad", "nadam": "NAdam", "radam": "RAdam", "ademamix": "AdEMAMix"}
TORCH_CLASS = {"adamw": "AdamW", "sgd": "SGD", "muon": "Muon", "rmsprop": "RMSprop", "adagrad": "Adagrad",
               "nadam": "NAdam", "radam": "RAdam"}
FUSED_ON_CPU = {"adamw", "sgd", "adagrad"}  # torch's fused CPU kernels (Adam, AdamW, SGD, Adagrad)
HYPER = {"adamw": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
         "sgd": dict(lr=1e-3, momentum=0.9, nesterov=True),
         "lion": dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=1e-2),
         "muon": dict(lr=1e-3),  # torch's defaults: weight decay 0.1, momentum 0.95, Nesterov, 5 Newton-Schulz steps
         "rmsprop": dict(lr=1e-3, alpha=0.99, eps=1e-8),
         "adagrad": dict(lr=1e-2, eps=1e-10),
         "nadam": dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8),
         "radam": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8),
         "ademamix": dict(lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, eps=1e-8, weight_decay=1e-2)}
BNB_CLASS = {"adamw": "AdamW8bit", "sgd": "SGD8bit", "lion": "Lion8bit", "rmsprop": "RMSprop8bit",
             "adagrad": "Adagrad8bit", "ademamix": "AdEMAMix8bit"}
CKPTQ_KEYS = ("ckptq", "ckptq-sr", "ckptq4", "ckptq-torch", "ckptq-cap")
OPTIONAL = {"ckptq-torch", "ckptq-cap", "ckptq-graph", "torch-graph"}  # only when asked for
GRAPH = {"ckptq-graph", "torch-graph"}
BASELINES = ("torch-fused", "torch-foreach", "lion-pytorch", "bnb-fp32")
LAYOUTS = ("many-small", "d256x48", "gpt2-124m", "llama-1b", "flat4")


def columns(family: str, gpu: bool) -> list[str]:
    """Every column key of a family, in table order (baselines first)."""
    keys = []
    if family in TORCH_CLASS:
        keys += ["torch-fused"] * (family in FUSED_ON_CPU or (gpu and family == "adamw")) + ["torch-foreach"]
    keys += ["lion-pytorch"] * (family == "lion") + ["bnb-fp32"] * (family == "ademamix")
    keys += list(CKPTQ_KEYS) + ["bnb"] * (family in BNB_CLASS)
    if family == "adamw":
        keys += ["torchao", "torchao4"] + (["ckptq-graph", "torch-graph"] if gpu else ["deepspeed"])
    return keys


def label(family: str, key: str, gpu: bool) -> str:
    name, kernel = CKPTQ_CLASS[family], "Triton" if gpu else "C"
    torch_name, bnb_name = TORCH_CLASS.get(family), BNB_CLASS.get(family)
    foreach = "" if family == "muon" else " foreach"  # torch's Muon has one implementation
    return {"torch-fused": f"torch {torch_name} fused", "torch-foreach": f"torch {torch_name}{foreach}",
            "lion-pytorch": "lion-pytorch Lion", "bnb-fp32": "bitsandbytes AdEMAMix (fp32)",
            "bnb": f"bitsandbytes {bnb_name}", "torchao": "torchao AdamW8bit", "torchao4": "torchao AdamW4bit",
            "deepspeed": "DeepSpeedCPUAdam (fp32)", "ckptq": f"ckptq {name}8bit ({kernel})",
            "ckptq-sr": f"ckptq {name}8bit rounding=stochastic ({kernel})",
            "ckptq4": f"ckptq {name}4bit ({kernel})", "ckptq-torch": f"ckptq {name}8bit (PyTorch reference)",
            "ckptq-cap": f"ckptq {name}8bit capturable ({kernel})",
            "ckptq-graph": f"ckptq {name}8bit capturable, CUDA graph",
            "torch-graph": "torch AdamW fused capturable, CUDA graph"}[key]


class GraphedStep:
    """An optimizer whose ``step()`` replays one CUDA-graph capture of its ``step()``, captured at the third
    call (after two eager steps, which build ckptq's plan and tables); ``state`` is the optimizer's."""

    def __init__(self, opt):
        self.opt, self.calls, self.graph = opt, 0, None
        self.state = opt.state

    def step(self) -> None:
        import torch

        self.calls += 1
        if self.graph is None and self.calls < 3:
            self.opt.step()
            return
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.opt.step()
        self.graph.replay()


def make_optimizer(family: str, key: str, params: list):
    """One column's optimizer on ``params``, under the family's hyperparameters; each library is imported
    only when its column is asked for (ImportError or RuntimeError when it cannot run here)."""
    import torch

    hyper = HYPER[family]
    if key in ("torch-fused", "torch-foreach", "torch-graph"):
        cls = getattr(torch.optim, TORCH_CLASS[family])
        if key == "torch-graph":
            return GraphedStep(cls(params, fused=True, capturable=True, **hyper))
        if family == "muon":
            return cls(params, **hyper)  # torch's Muon has a single implementation
        return cls(params, **({"fused": True} if key == "torch-fused" else {"foreach": True}), **hyper)
    if key == "lion-pytorch":
        from lion_pytorch import Lion

        return Lion(params, **hyper)
    if key in ("bnb", "bnb-fp32"):
        import bitsandbytes.optim

        return getattr(bitsandbytes.optim, BNB_CLASS[family] if key == "bnb" else "AdEMAMix")(params, **hyper)
    if key in ("torchao", "torchao4"):
        import torchao.optim

        return (torchao.optim.AdamW8bit if key == "torchao" else torchao.optim.AdamW4bit)(params, **hyper)
    if key == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **hyper)
    import ckptq.optim

    name = CKPTQ_CLASS[family]
    if key == "ckptq4":
        return getattr(ckptq.optim, f"{name}4bit")(params, **hyper)
    options = {"ckptq-sr": dict(rounding="stochastic"), "ckptq-torch": dict(backend="torch"),
               "ckptq-cap": dict(capturable=True), "ckptq-graph": dict(capturable=True)}.get(key, {})
    opt = getattr(ckptq.optim, f"{name}8bit")(params, **hyper, **options)
    return GraphedStep(opt) if key == "ckptq-graph" else opt


def _transformer(layers: int, d: int, ff: int, vocab: int = 0, ctx: int = 0, biases: bool = True) -> list[tuple]:
    """GPT-2-style shapes: embeddings, per layer ln, qkv, proj, ln, fc, fc2 (with biases), final ln."""
    shapes = [(vocab, d)] * bool(vocab) + [(ctx, d)] * bool(ctx)
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d)] + [(3 * d,)] * biases + [(d, d)] + [(d,)] * biases
        shapes += [(d,), (d,), (ff, d)] + [(ff,)] * biases + [(d, ff)] + [(d,)] * biases
    return shapes + [(d,), (d,)] * bool(vocab)


def _llama(layers=16, d=2048, ff=8192, kv=512, vocab=128256) -> list[tuple]:
    shapes = [(vocab, d)]
    for _ in range(layers):
        shapes += [(d, d), (kv, d), (kv, d), (d, d), (ff, d), (ff, d), (d, ff), (d,), (d,)]
    return shapes + [(d,)]


def layout_shapes(name: str) -> list[tuple]:
    return {"many-small": lambda: [(4, 1024)] * 256, "d256x48": lambda: _transformer(48, 256, 1024, biases=False),
            "gpt2-124m": lambda: _transformer(12, 768, 3072, vocab=50257, ctx=1024), "llama-1b": _llama,
            "flat4": lambda: [(4096, 1024)] * 4}[name]()


def make_params(shapes: list[tuple], device: str, seed: int) -> tuple[list, list]:
    """fp32 weights ~ 0.02 N(0, 1) and gradients ~ 1e-3 N(0, 1) of the given shapes."""
    import torch

    g = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(s, generator=g) * 0.02).to(device) for s in shapes]
    grads = [(torch.randn(s, generator=g) * 1e-3).to(device) for s in shapes]
    return weights, grads


def step_timer(opt, gpu: bool):
    """A function that runs ``opt.step()`` once and returns its seconds (CUDA events on a GPU)."""
    if not gpu:
        return lambda: harness.timed(opt.step)
    import torch

    def gpu_step() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    return gpu_step


def build(family: str, keys: list[str], weights, grads) -> dict:
    """Each column's optimizer on its own copy of the weights and gradients; a column that cannot be made
    (library missing, op that does not build) is reported in one line and left out."""
    opts = {}
    for key in keys:
        params = [w.clone().requires_grad_(True) for w in weights]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        try:
            opts[key] = make_optimizer(family, key, params)
        except Exception as e:  # noqa: BLE001 (any library's failure to load or build only drops its column)
            why = (str(e).strip().splitlines() or [""])[0][:160]
            print(f"{family}: {label(family, key, weights[0].is_cuda)} left out ({type(e).__name__}: {why})")
    return opts


def table(family: str, opts: dict, first: dict, times: dict, numel: int, tensors: int, gpu: bool) -> str:
    median = harness.medians(times)
    base = next((k for k in BASELINES if k in median), next(iter(median)))
    bnb = median.get("bnb")
    head = ["optimizer", "ms/step", "µs/tensor", f"vs {label(family, base, gpu)}", "vs bitsandbytes 8-bit",
            "state B/param", "GB/s moved", "first step s"]
    rows = []
    for key, opt in opts.items():
        state = harness.state_bytes(opt) / numel
        moved = numel * (4 + 8 + 2 * state)  # read g; read + write p; read + write the state
        rows.append([label(family, key, gpu), f"{median[key] * 1e3:.2f}", f"{median[key] * 1e6 / tensors:.1f}",
                     harness.ratio(median[key], median[base]), harness.ratio(median[key], bnb), f"{state:.3f}",
                     f"{moved / median[key] / 1e9:.1f}", f"{first[key]:.2f}"])
    return harness.markdown_table(head, rows)


def run_family(family: str, args, weights, grads) -> None:
    import torch

    keep = [i for i, w in enumerate(weights) if family != "muon" or w.dim() == 2]  # Muon: matrices only
    w, g = [weights[i] for i in keep], [grads[i] for i in keep]
    wanted = set(args.only.split(",")) if args.only else None
    keys = [k for k in columns(family, args.gpu)
            if (k in wanted if wanted else k not in OPTIONAL or (args.reference and k == "ckptq-torch"))]
    opts = build(family, keys, w, g)
    if not opts:
        print(f"{family}: no column to run")
        return
    runs = {key: step_timer(opt, args.gpu) for key, opt in opts.items()}
    first, times = harness.interleaved(runs, args.rounds, max(1, args.warmup))
    numel = sum(x.numel() for x in w)
    print(f"\n{family}: {numel / 1e6:.1f} M params in {len(w)} tensors\n")
    print(table(family, opts, first, times, numel, len(w), args.gpu))
    del opts, runs
    if args.gpu:
        torch.cuda.empty_cache()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--family", default="adamw", help=f"comma list of {', '.join(FAMILIES)}, or all")
    parser.add_argument("--layout", default="d256x48", choices=LAYOUTS)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3, help="steps per optimizer before timing (>= 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--only", help="comma list of column keys (default: every non-optional column)")
    parser.add_argument("--reference", action="store_true", help="also ckptq on backend='torch' (slow)")
    parser.add_argument("--gpu", action="store_true", help="run on CUDA (ckptq uses its Triton kernels)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    families = FAMILIES if args.family == "all" else tuple(f for f in args.family.split(",") if f)
    if set(families) - set(FAMILIES):
        parser.error(f"unknown families {sorted(set(families) - set(FAMILIES))}; choose from {', '.join(FAMILIES)}")
    args.families = families
    known = {k for f in FAMILIES for k in columns(f, True) + columns(f, False)}
    unknown = set(args.only.split(",")) - known if args.only else set()
    if unknown:
        parser.error(f"unknown columns {sorted(unknown)}; choose from {', '.join(sorted(known))}")
    if not args.gpu and args.only and GRAPH & set(args.only.split(",")):
        parser.error("ckptq-graph and torch-graph capture CUDA graphs: pass --gpu")
    return args


def main() -> None:
    args = parse_args()  # before torch loads: --help answers at once
    harness.set_threads(args.threads)
    shapes = layout_shapes(args.layout)
    weights, grads = make_params(shapes, "cuda" if args.gpu else "cpu", args.seed)
    print(f"layout {args.layout}: {sum(w.numel() for w in weights) / 1e6:.1f} M params in {len(shapes)} tensors, "
          f"{args.rounds} interleaved rounds after {max(1, args.warmup)} warm-up steps\n{harness.machine_line()}")
    for family in args.families:
        run_family(family, args, weights, grads)


if __name__ == "__main__":
    main()
