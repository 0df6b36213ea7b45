"""Step time and state memory of ckptq's AdamW8bit against torch, bitsandbytes and torchao, side by side.

One run, interleaved rounds: every optimizer owns a copy of the same parameters (``--tensors`` fp32
tensors of ``--numel-per-tensor`` elements) and fixed random gradients; after ``--warmup`` steps each
(the first one, which includes torch.compile for torchao and building ckptq's C kernel, is reported
separately), each round runs one step of every optimizer in turn, so load from other processes hits
all alike. Prints medians and ratios as a markdown table.

    python tools/bench_optim.py --numel-per-tensor 4194304 --tensors 4 --rounds 7 --threads 2
    python tools/bench_optim.py --gpu --numel-per-tensor 67108864 --tensors 4 --rounds 20   # CUDA machine

State bytes per parameter count every distinct tensor storage reachable from ``opt.state`` (codes,
absmax, codebooks, steps; torchao's tensor subclasses are opened to their ``codes``/``scale``/``qmap``),
so a codebook shared by all parameters is counted once. ``--gpu`` also reports achieved memory bandwidth:
the minimum traffic of a step, read p, g, state + write p, state = (12 + 2 * state B/param) bytes per
parameter, divided by the median step time (CUDA events). Without ``--gpu`` nothing touches CUDA.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Callable

import torch

OPTIMIZERS = ("torch-foreach", "torch-fused", "bnb", "torchao", "ckptq", "ckptq-torch", "torchao4", "ckptq4")
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def make_optimizer(name: str, params: list[torch.Tensor], gpu: bool) -> torch.optim.Optimizer:
    """One optimizer under the same hyperparameters; imports each library only when asked for."""
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

    # "ckptq": the default (C kernel on the CPU, Triton on CUDA); the others are the PyTorch fallbacks.
    if name == "ckptq":
        return AdamW8bit(params, **HYPER)
    if name == "ckptq4":
        return AdamW4bit(params, **HYPER)
    return AdamW8bit(params, **HYPER, backend="torch")


def label(name: str, gpu: bool) -> str:
    ckptq_label = "ckptq AdamW8bit (Triton)" if gpu else "ckptq AdamW8bit (C kernel)"
    return {
        "torch-foreach": "torch AdamW foreach",
        "torch-fused": "torch AdamW fused",
        "bnb": "bitsandbytes AdamW8bit",
        "torchao": "torchao AdamW8bit",
        "ckptq": ckptq_label,
        "ckptq-torch": "ckptq AdamW8bit (PyTorch fallback)",
        "torchao4": "torchao AdamW4bit",
        "ckptq4": ckptq_label.replace("8bit", "4bit"),
    }[name]


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
    """Bytes held by the optimizer's state, each storage once."""
    seen: dict[int, int] = {}
    for state in opt.state.values():
        _storages(state, seen)
    return sum(seen.values())


def make_params(numel: int, count: int, device: str, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``count`` fp32 [numel // 1024, 1024] weights and their gradients (gradients ~ 1e-3 * N(0, 1))."""
    g = torch.Generator().manual_seed(seed)
    rows = max(1, numel // 1024)
    shape = (rows, numel // rows)
    weights = [(torch.randn(shape, generator=g) * 0.02).to(device) for _ in range(count)]
    grads = [(torch.randn(shape, generator=g) * 1e-3).to(device) for _ in range(count)]
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


def build(names, weights, grads, device: str, gpu: bool) -> dict[str, torch.optim.Optimizer]:
    """Each optimizer gets its own copy of the weights and gradients."""
    opts = {}
    for name in names:
        params = [w.clone().requires_grad_(True) for w in weights]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opts[name] = make_optimizer(name, params, gpu)
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


def table(opts, first, times, numel: int, gpu: bool) -> str:
    median = {name: statistics.median(ts) for name, ts in times.items()}
    head = "| optimizer | ms/step median | M params/s | vs torch foreach | vs bnb | state B/param | first step s |"
    if gpu:
        head += " GB/s (min traffic) |"
    rows = [head, "|" + "|".join(["---"] + ["---:"] * (head.count("|") - 2)) + "|"]
    for name, opt in opts.items():
        b_per_param = state_bytes(opt) / numel
        cells = [
            label(name, gpu),
            f"{median[name] * 1e3:.1f}",
            f"{numel / median[name] / 1e6:,.0f}",
            f"{median['torch-foreach'] / median[name]:.2f}x" if "torch-foreach" in median else "-",
            f"{median['bnb'] / median[name]:.2f}x" if "bnb" in median else "-",
            f"{b_per_param:.3f}",
            f"{first[name]:.2f}",
        ]
        if gpu:
            cells.append(f"{numel * (12 + 2 * b_per_param) / median[name] / 1e9:,.0f}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel-per-tensor", type=int, default=4096 * 1024)
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3, help="steps per optimizer before timing (>= 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--only", default=",".join(OPTIMIZERS), help=f"comma list of {', '.join(OPTIMIZERS)}")
    parser.add_argument("--gpu", action="store_true", help="run on CUDA (ckptq uses its Triton kernel)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(OPTIMIZERS))
    if unknown:
        parser.error(f"unknown optimizers {unknown}; choose from {', '.join(OPTIMIZERS)}")
    if args.gpu:
        names = [n for n in names if n != "ckptq-torch"]  # the CPU fallback only
    device = "cuda" if args.gpu else "cpu"
    weights, grads = make_params(args.numel_per_tensor, args.tensors, device, args.seed)
    numel = sum(w.numel() for w in weights)
    opts = build(names, weights, grads, device, args.gpu)
    first, times = run(opts, max(1, args.warmup), args.rounds, args.gpu)
    where = torch.cuda.get_device_name() if args.gpu else f"{platform.processor() or platform.machine()}"
    print(
        f"{numel / 1e6:.1f} M params in {args.tensors} tensors, {args.rounds} interleaved rounds after "
        f"{max(1, args.warmup)} warm-up steps; {where}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs\n"
    )
    print(table(opts, first, times, numel, args.gpu))


if __name__ == "__main__":
    main()
