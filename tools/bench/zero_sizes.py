"""Sizes of real DeepSpeed ZeRO checkpoints before and after ``ckptq convert`` (needs deepspeed; CPU, 2
ranks over gloo):

    python tools/bench/zero_sizes.py [--width 1024 --depth 6 --stages 1,2,3]

Trains an MLP (16 -> width, depth x width*width, -> 8; 6.3 M parameters, 25 MB of fp32 weights by
default) 2 AdamW steps with ZeRO stage 1, 2 and 3, saves, converts the global_step folder and prints per
stage: the fp32 optimizer partition files (all ranks), the converted files, the model states files
(untouched), and the whole folder before and after with the fp32 optimizer files replaced by the 8-bit
ones. ``zero_to_fp32.py`` would keep only the weights (the model column) and lose the optimizer state.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--stages", default="1,2,3")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from zero_worker import launch  # noqa: E402

import ckptq  # noqa: E402
from ckptq import info as ckptq_info  # noqa: E402


def _bytes(folder: str, pick) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if pick(n))


def measure(stage: int, width: int, depth: int, tmp: str) -> dict:
    save = os.path.join(tmp, f"zero{stage}")
    launch("--stage", str(stage), "--steps", "2", "--save-at", "2", "--save-dir", save,
           "--losses", os.path.join(tmp, "losses.json"), "--width", str(width), "--depth", str(depth))
    t0 = time.perf_counter()
    report = ckptq.convert(save)
    seconds = time.perf_counter() - t0
    folder = os.path.join(save, "global_step2")
    info = ckptq_info(folder)
    fp32 = _bytes(folder, lambda n: n.endswith("_optim_states.pt"))
    q8 = _bytes(folder, lambda n: n.endswith("_optim_states.q8.safetensors"))
    model = _bytes(folder, lambda n: n.endswith("_model_states.pt"))
    assert q8 == report.output_bytes
    return {"stage": stage, "params": info["params"], "fp32": fp32, "q8": q8, "model": model,
            "moments": info["moment_bytes"], "seconds": seconds}


def main() -> None:
    args = build_parser().parse_args()
    mb = lambda n: f"{n / 1e6:,.1f}"  # noqa: E731
    print("| ZeRO stage | parameters | optimizer files fp32 MB | converted MB | ratio | model states MB "
          "| global_step folder MB: fp32 -> 8-bit optimizer | convert s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for stage in map(int, args.stages.split(",")):
            r = measure(stage, args.width, args.depth, tmp)
            print(f"| {stage} | {r['params']:,} | {mb(r['fp32'])} | {mb(r['q8'])} | {r['fp32'] / r['q8']:.2f}x "
                  f"| {mb(r['model'])} | {mb(r['fp32'] + r['model'])} -> {mb(r['q8'] + r['model'])} "
                  f"({(r['fp32'] + r['model']) / (r['q8'] + r['model']):.2f}x) | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
