"""Step time and state memory of ckptq's AdamW8bit / AdamW4bit against torch, bitsandbytes and torchao, side
by side, on the tensor shapes of real models.

One run, interleaved rounds: every optimizer owns a copy of the same parameters (the shapes of
``--layout``) and fixed random gradients; after ``--warmup`` steps each (the first one, which includes
torch.compile for torchao and building ckptq's C kernel, is reported separately), each round runs one
step of every optimizer in turn, starting with a different one, so load from other processes hits all
alike. Prints medians and ratios as a markdown table.

Layouts (no weights needed, only shapes):
  many-small   256 tensors of 4,096 (the per-tensor cost)
  d256x48      48 transformer layers of width 256: 384 tensors, 37.9 M parameters
  gpt2-124m    GPT-2 small: 148 tensors, 124 M parameters
  llama-1b     Llama-3.2-1B: 146 tensors, 1.24 G parameters (needs ~10 GB per optimizer: GPU)
  flat4        16.8 M parameters in 4 tensors (the old default)

Optimizers (``--only``): torch-fused, torch-foreach, bnb, torchao, torchao4, ckptq (AdamW8bit), ckptq-sr (AdamW8bit rounding="stochastic"), ckptq4
(AdamW4bit), ckptq-torch (the PyTorch reference backend), ckptq-cap (AdamW8bit capturable=True, eager);
on CUDA also ckptq-graph and torch-graph: a capturable step captured once in a CUDA graph and replayed.

    python tools/bench/optim.py --layout d256x48 --rounds 9 --threads 2
    python tools/bench/optim.py --layout gpt2-124m --gpu --rounds 20       # a CUDA machine

Columns: ms/step (median), µs per tensor, and GB/s of the bytes the update must move at least: read the
gradient (its dtype), read and write the parameter and the state; for fp32 Adam 4 + 8 + 16 = 28 B/param,
for 8-bit state about 16.1 (the state's bytes per parameter, measured, twice). State bytes per parameter
count every distinct storage reachable from ``opt.state`` (codebooks shared by all parameters once;
torchao's tensor subclasses opened to their codes/scale/qmap).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Callable

import torch

OPTIMIZERS = ("torch-fused", "torch-foreach", "bnb", "torchao", "ckptq", "ckptq4", "torchao4", "ckptq-torch", "ckptq-sr",
              "ckptq-cap", "ckptq-graph", "torch-graph")
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


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
    if name == "many-small":
        return [(4, 1024)] * 256
    if name == "d256x48":
        return _transformer(48, 256, 1024, biases=False)
    if name == "gpt2-124m":
        return _transformer(12, 768, 3072, vocab=50257, ctx=1024)
    if name == "llama-1b":
        return _llama()
    if name == "flat4":
        return [(4096, 1024)] * 4
    raise SystemExit(f"unknown layout {name!r}")


class GraphedStep:
    """An optimizer whose ``step()`` replays one CUDA-graph capture of its ``step()``, captured at the third
    call (after two eager steps, which build ckptq's plan and tables); ``state`` is the optimizer's."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.opt, self.calls, self.graph = opt, 0, None
        self.state = opt.state

    def step(self) -> None:
        self.calls += 1
        if self.graph is None and self.calls < 3:
            self.opt.step()
            return
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.opt.step()
        self.graph.replay()


def make_optimizer(name: str, params: list[torch.Tensor]):
    """One optimizer under the same hyperparameters; imports each library only when asked for."""
    if name == "torch-graph":
        return GraphedStep(torch.optim.AdamW(params, fused=True, capturable=True, **HYPER))
    if name == "torch-foreach":
        return torch.optim.AdamW(params, foreach=True, **HYPER)
    if name == "torch-fused":
        return torch.optim.AdamW(params, fused=True, **HYPER)
    if name == "bnb":
        import bitsandbytes.optim

        return bitsandbytes.optim.AdamW8bit(params, **HYPER)
    if name in ("torchao", "torchao4"):
        import torchao.optim

        return (torchao.optim.AdamW8bit if name == "torchao" else torchao.optim.AdamW4bit)(params, **HYPER)
    from ckptq.optim import AdamW4bit, AdamW8bit

    if name == "ckptq4":
        return AdamW4bit(params, **HYPER)
    if name == "ckptq-sr":
        return AdamW8bit(params, **HYPER, rounding="stochastic")
    if name in ("ckptq-cap", "ckptq-graph"):
        opt = AdamW8bit(params, **HYPER, capturable=True)
        return GraphedStep(opt) if name == "ckptq-graph" else opt
    return AdamW8bit(params, **HYPER, backend="torch" if name == "ckptq-torch" else "auto")


def label(name: str, gpu: bool) -> str:
    kernel = "Triton" if gpu else "C"
    return {"torch-foreach": "torch AdamW foreach", "torch-fused": "torch AdamW fused",
            "bnb": "bitsandbytes AdamW8bit", "torchao": "torchao AdamW8bit", "torchao4": "torchao AdamW4bit",
            "ckptq": f"ckptq AdamW8bit ({kernel})", "ckptq4": f"ckptq AdamW4bit ({kernel})",
            "ckptq-sr": f"ckptq AdamW8bit rounding=stochastic ({kernel})",
            "ckptq-torch": "ckptq AdamW8bit (PyTorch reference)", "ckptq-cap": f"ckptq AdamW8bit capturable ({kernel})",
            "ckptq-graph": "ckptq AdamW8bit capturable, CUDA graph", "torch-graph": "torch AdamW fused capturable, CUDA graph"}[name]


def _storages(obj, seen: dict[int, int]) -> None:
    """Collect {storage data_ptr: nbytes} of every tensor reachable from ``obj`` (dicts, lists, subclasses)."""
    if isinstance(obj, dict):
        for value in obj.values():
            _storages(value, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _storages(value, seen)
    elif isinstance(obj, torch.Tensor):
        attrs = getattr(obj, "tensor_attrs", None)  # torchao OptimState8bit: codes u8, scale fp32, qmap fp32
        if attrs is not None and type(obj) is not torch.Tensor:
            for attr in attrs:
                _storages(getattr(obj, attr), seen)
            return
        storage = obj.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state, each storage once (0-dim step tensors included)."""
    seen: dict[int, int] = {}
    for state in opt.state.values():
        _storages(state, seen)
    return sum(seen.values())


def make_params(shapes: list[tuple], device: str, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fp32 weights ~ 0.02 N(0, 1) and gradients ~ 1e-3 N(0, 1) of the given shapes."""
    g = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(s, generator=g) * 0.02).to(device) for s in shapes]
    grads = [(torch.randn(s, generator=g) * 1e-3).to(device) for s in shapes]
    return weights, grads


def step_timer(gpu: bool) -> Callable[[torch.optim.Optimizer], float]:
    """A function that runs ``opt.step()`` once and returns its seconds (CUDA events on GPU)."""
    if not gpu:

        def cpu_step(opt: torch.optim.Optimizer) -> float:
            start = time.perf_counter()
            opt.step()
            return time.perf_counter() - start

        return cpu_step

    def gpu_step(opt: torch.optim.Optimizer) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    return gpu_step


def build(names, weights, grads) -> dict[str, torch.optim.Optimizer]:
    """Each optimizer gets its own copy of the weights and gradients."""
    opts = {}
    for name in names:
        params = [w.clone().requires_grad_(True) for w in weights]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opts[name] = make_optimizer(name, params)
    return opts


def run(opts: dict, warmup: int, rounds: int, gpu: bool) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Return (first-step seconds, per-round step seconds) per optimizer; rounds rotate the start."""
    timer = step_timer(gpu)
    first = {name: timer(opt) for name, opt in opts.items()}
    for _ in range(warmup - 1):
        for opt in opts.values():
            timer(opt)
    times: dict[str, list[float]] = {name: [] for name in opts}
    names = list(opts)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(timer(opts[name]))
    return first, times


def table(opts, first, times, numel: int, tensors: int, gpu: bool) -> str:
    median = {name: statistics.median(ts) for name, ts in times.items()}
    base = "torch-fused" if "torch-fused" in median else next(iter(median))
    head = (f"| optimizer | ms/step | µs/tensor | vs {label(base, gpu)} | vs bitsandbytes | state B/param "
            "| GB/s moved | first step s |")
    rows = [head, "|---|" + "---:|" * (head.count("|") - 2)]
    for name, opt in opts.items():
        state = state_bytes(opt) / numel
        moved = numel * (4 + 8 + 2 * state)  # read g; read + write p; read + write the state
        cells = [label(name, gpu), f"{median[name] * 1e3:.2f}", f"{median[name] * 1e6 / tensors:.1f}",
                 f"{median[name] / median[base]:.2f}x",
                 f"{median[name] / median['bnb']:.2f}x" if "bnb" in median else "-",
                 f"{state:.3f}", f"{moved / median[name] / 1e9:.1f}", f"{first[name]:.2f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="d256x48",
                        choices=["many-small", "d256x48", "gpt2-124m", "llama-1b", "flat4"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3, help="steps per optimizer before timing (>= 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--only", default="torch-fused,torch-foreach,bnb,torchao,ckptq,ckptq4",
                        help=f"comma list of {', '.join(OPTIMIZERS)}")
    parser.add_argument("--gpu", action="store_true", help="run on CUDA (ckptq uses its Triton kernels)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(OPTIMIZERS))
    if unknown:
        parser.error(f"unknown optimizers {unknown}; choose from {', '.join(OPTIMIZERS)}")
    if not args.gpu and {"ckptq-graph", "torch-graph"} & set(names):
        parser.error("ckptq-graph and torch-graph capture CUDA graphs: pass --gpu")
    shapes = layout_shapes(args.layout)
    weights, grads = make_params(shapes, "cuda" if args.gpu else "cpu", args.seed)
    numel = sum(w.numel() for w in weights)
    opts = build(names, weights, grads)
    first, times = run(opts, max(1, args.warmup), args.rounds, args.gpu)
    where = torch.cuda.get_device_name() if args.gpu else f"{platform.processor() or platform.machine()}"
    print(f"layout {args.layout}: {numel / 1e6:.1f} M params in {len(shapes)} tensors, {args.rounds} interleaved "
          f"rounds after {max(1, args.warmup)} warm-up steps; {where}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs\n")
    print(table(opts, first, times, numel, len(shapes), args.gpu))


if __name__ == "__main__":
    main()
