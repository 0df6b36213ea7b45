"""Beyond Adam: how well 8- and 4-bit state keeps each optimizer's *update*, on checkpoints it trains.

For every optimizer ckptq reads by role (docs/FORMAT.md, "Roles") it trains the tiny GPT of
``tools/scripts/make_checkpoint.py`` for ``--steps`` steps (Muon as real runs use it: Muon for the hidden matrices,
AdamW for embeddings, head and 1-D parameters, both state dicts saved side by side), then measures the
update of one more real step of the real optimizer class, from the fp32 state and from the decoded state,
with the same gradient: per parameter tensor the relative L2 error ``||dp_q - dp|| / ||dp||`` (weight decay
set to 0 for that step, so that it does not dilute the error), over the tensors that are stored low-bit.

- default: after the real ``ckptq.convert`` (8 and 4 bits) and ``ckptq.load(dequantize=True)``: bytes per
  parameter of the optimizer state as written, worst and median update error; beside them bitsandbytes'
  own 8-bit state for Lion and SGD (``quantize_blockwise`` with its optimizers' signed dynamic map,
  blocks of 256: what its ``Lion8bit`` / ``SGD8bit`` hold).
- ``--sweep``: the candidates each role's codec was chosen from (codebook, transform, width, block),
  one role at a time, the other states exact.

    PYTHONPATH=. python tools/bench/optimizer_fidelity.py [--steps 300] [--sweep] [--only sgd,lion] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import warnings


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sweep", action="store_true", help="the codec candidates per role, not the real convert")
    ap.add_argument("--only", default="", help="comma-separated optimizer names (default: all)")
    ap.add_argument("--codecs", default="", help="--sweep: only the candidates whose label holds one of these comma-separated texts")
    ap.add_argument("--json", help="also write the rows here")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from make_checkpoint import GPT, SIZES, _transition_table, make_batch  # noqa: E402

from ckptq.codec import codebooks, ops  # noqa: E402
from ckptq.codec.qstate import row_len_of  # noqa: E402

MIN_NUMEL = 4096  # ckptq's (and bitsandbytes') min size: smaller states stay fp32


def _hidden(model):
    """Muon's parameters: the 2-D matrices inside the blocks (not the embeddings, head or 1-D ones)."""
    return [p for n, p in model.named_parameters() if p.ndim == 2 and ".h." in f".{n}"]


def _rest(model):
    hidden = {id(p) for p in _hidden(model)}
    return [p for p in model.parameters() if id(p) not in hidden]


def _lion(params):
    from lion_pytorch import Lion

    return Lion(params, lr=1e-4, betas=(0.9, 0.99))


def _adafactor(params):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=1e-3, beta1=0.9, relative_step=False, scale_parameter=False, warmup_init=False)


# name -> a function of the model giving its optimizers (one, or Muon's pair)
OPTIMIZERS = {
    "adamw": lambda m: [torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95))],
    "nadam": lambda m: [torch.optim.NAdam(m.parameters(), lr=2e-3)],
    "radam": lambda m: [torch.optim.RAdam(m.parameters(), lr=2e-3)],
    "adamax": lambda m: [torch.optim.Adamax(m.parameters(), lr=2e-3)],
    "sgd": lambda m: [torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9, nesterov=True)],
    "rmsprop": lambda m: [torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.9)],
    "rmsprop_centered": lambda m: [torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.9, centered=True)],
    "adagrad": lambda m: [torch.optim.Adagrad(m.parameters(), lr=3e-2)],
    "muon": lambda m: [torch.optim.Muon(_hidden(m), lr=2e-2, weight_decay=0.0),
                       torch.optim.AdamW(_rest(m), lr=3e-3, betas=(0.9, 0.95))],
    "lion": lambda m: [_lion(m.parameters())],
    "adafactor": lambda m: [_adafactor(m.parameters())],
}
BNB_OWN = {"lion": "exp_avg", "sgd": "momentum_buffer"}  # bitsandbytes' Lion8bit / SGD8bit: their one state


def train(name: str, steps: int, seed: int = 0):
    """(model, optimizers, a batch for the measured step) after ``steps`` steps of ``name``."""
    cfg = dict(SIZES["tiny"])
    batch = cfg.pop("batch_size")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = GPT(**cfg)
    opts = OPTIMIZERS[name](model)
    perm = _transition_table(cfg["vocab_size"], gen)
    for _ in range(steps):
        x, y = make_batch(cfg["vocab_size"], batch, cfg["block_size"], perm, gen)
        for o in opts:
            o.zero_grad(set_to_none=True)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in opts:
            o.step()
    return model, opts, make_batch(cfg["vocab_size"], batch, cfg["block_size"], perm, gen)


def step_deltas(name: str, model, state_dicts: list, batch) -> list[torch.Tensor]:
    """The parameter change of one more step from ``state_dicts`` (one per optimizer), weight decay 0."""
    m = copy.deepcopy(model)
    opts = OPTIMIZERS[name](m)
    for o, sd in zip(opts, state_dicts):
        o.load_state_dict(copy.deepcopy(sd))
        for g in o.param_groups:
            g["weight_decay"] = 0.0
    m(*batch).backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    before = [p.detach().clone() for p in m.parameters()]
    for o in opts:
        o.step()
    return [p.detach() - b for p, b in zip(m.parameters(), before)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    d = b.double().norm().item()
    return (a.double() - b.double()).norm().item() / d if d else 0.0


def errors(name, model, exact_sds, test_sds, batch, which: list[int]) -> list[float]:
    """Update errors of the parameters at positions ``which`` (of ``model.parameters()``)."""
    want, got = step_deltas(name, model, exact_sds, batch), step_deltas(name, model, test_sds, batch)
    return [_rel(got[i], want[i]) for i in which]


def _param_positions(model, opts) -> dict:
    """(optimizer index, param id in its state dict) -> position in ``model.parameters()``."""
    pos = {id(p): i for i, p in enumerate(model.parameters())}
    return {(k, pid): pos[id(p)] for k, o in enumerate(opts)
            for pid, p in enumerate(p for g in o.param_groups for p in g["params"])}


def roundtrip(t: torch.Tensor, qmap: torch.Tensor, transform: str, bits: int, block: int) -> torch.Tensor:
    """``t`` quantized and decoded in the row layout (what a file holds), fp32."""
    row = row_len_of(t.shape)
    codes, absmax = ops.quantize_blockwise(t.float(), qmap, block, transform, "torch", bits, row_len=row)
    out = ops.dequantize_blockwise(codes, absmax, qmap, block, transform, "torch", bits=bits, numel=t.numel(), row_len=row)
    return out.view(t.shape).to(t.dtype)


def _with(sds: list, key: str, change) -> tuple[list, list]:
    """Copies of ``sds`` with each state ``key`` of >= MIN_NUMEL elements replaced by ``change(tensor)``;
    and the (optimizer index, param id) pairs changed."""
    out, changed = copy.deepcopy(sds), []
    for k, sd in enumerate(out):
        for pid, st in sd["state"].items():
            t = st.get(key)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() >= MIN_NUMEL:
                st[key] = change(t)
                changed.append((k, pid))
    return out, changed


def _bnb_signed(t: torch.Tensor) -> torch.Tensor:
    import bitsandbytes.functional as F

    code = F.create_dynamic_map(signed=True)
    q, state = F.quantize_blockwise(t.float().contiguous(), code=code, blocksize=256)
    return F.dequantize_blockwise(q, state).view(t.shape)


def _summary(errs: list[float]) -> dict:
    return {"worst": max(errs), "median": statistics.median(errs), "tensors": len(errs)} if errs else {}


# The candidates each role was chosen from: (label, bits, codebook, transform[, block]); block 256 at 8 bits,
# 128 at 4 unless given.
CANDIDATES = {
    "first": [("power-signed-2.5", 8, lambda: codebooks.power_map(True, 2.5), "none"),
              ("power-signed-2", 8, lambda: codebooks.power_map(True, 2.0), "none"),
              ("power-signed-1.5", 8, lambda: codebooks.power_map(True, 1.5), "none"),
              ("linear-signed", 8, lambda: codebooks.power_map(True, 1.0), "none"),
              ("dynamic-signed (bnb)", 8, lambda: codebooks.dynamic_map(True), "none"),
              ("4bit-power-signed-1.5", 4, lambda: codebooks.power_map(True, 1.5, 4), "none"),
              ("4bit-power-signed-2", 4, lambda: codebooks.power_map(True, 2.0, 4), "none"),
              ("4bit-linear-signed", 4, lambda: codebooks.power_map(True, 1.0, 4), "none"),
              ("4bit-lloyd-gaussian", 4, codebooks.lloyd_gaussian_map, "none"),
              ("power-signed-1.5, block 128", 8, lambda: codebooks.power_map(True, 1.5), "none", 128),
              ("power-signed-1.5, block 512", 8, lambda: codebooks.power_map(True, 1.5), "none", 512),
              ("4bit-lloyd-gaussian, block 64", 4, codebooks.lloyd_gaussian_map, "none", 64),
              ("4bit-lloyd-gaussian, block 256", 4, codebooks.lloyd_gaussian_map, "none", 256)],
    "second": [("sqrt, power-unsigned-3", 8, lambda: codebooks.power_map(False, 3.0), "sqrt"),
               ("sqrt, power-unsigned-2", 8, lambda: codebooks.power_map(False, 2.0), "sqrt"),
               ("none, power-unsigned-3", 8, lambda: codebooks.power_map(False, 3.0), "none"),
               ("none, dynamic-unsigned (bnb)", 8, lambda: codebooks.dynamic_map(False), "none"),
               ("4bit sqrt, geometric-1.3", 4, lambda: codebooks.geometric_map(4, 1.3), "sqrt"),
               ("4bit sqrt, power-unsigned-3", 4, lambda: codebooks.power_map(False, 3.0, 4), "sqrt"),
               ("4bit sqrt, geometric-1.2", 4, lambda: codebooks.geometric_map(4, 1.2), "sqrt"),
               ("4bit sqrt, geometric-1.15", 4, lambda: codebooks.geometric_map(4, 1.15), "sqrt"),
               ("4bit sqrt, geometric-1.25", 4, lambda: codebooks.geometric_map(4, 1.25), "sqrt"),
               ("sqrt, power-unsigned-3, block 128", 8, lambda: codebooks.power_map(False, 3.0), "sqrt", 128),
               ("sqrt, power-unsigned-3, block 512", 8, lambda: codebooks.power_map(False, 3.0), "sqrt", 512),
               ("4bit sqrt, geometric-1.2, block 64", 4, lambda: codebooks.geometric_map(4, 1.2), "sqrt", 64)],
    "max-norm": [("none, power-unsigned-3", 8, lambda: codebooks.power_map(False, 3.0), "none"),
                 ("none, power-unsigned-2", 8, lambda: codebooks.power_map(False, 2.0), "none"),
                 ("none, power-unsigned-1.5", 8, lambda: codebooks.power_map(False, 1.5), "none"),
                 ("4bit none, geometric-1.3", 4, lambda: codebooks.geometric_map(4, 1.3), "none"),
                 ("4bit none, geometric-1.2", 4, lambda: codebooks.geometric_map(4, 1.2), "none"),
                 ("4bit none, power-unsigned-2", 4, lambda: codebooks.power_map(False, 2.0, 4), "none"),
                 ("4bit none, geometric-1.15", 4, lambda: codebooks.geometric_map(4, 1.15), "none")],
}
ROLE_KEYS = {"exp_avg": "first", "momentum_buffer": "first", "grad_avg": "first", "exp_avg_sq": "second",
             "square_avg": "second", "sum": "second", "exp_inf": "max-norm"}
SKIP = {"adamw", "nadam", "radam"}  # Adam's pair is stored as the ratio (tools/bench/fidelity.py measures it)


def sweep(name: str, steps: int, codecs: str = "") -> list[dict]:
    """One row per (state key, candidate): worst/median update error with that key's states on it."""
    model, opts, batch = train(name, steps)
    sds = [o.state_dict() for o in opts]
    where = _param_positions(model, opts)
    keys = sorted({k for sd in sds for st in sd["state"].values() for k in st if k in ROLE_KEYS})
    if name == "muon":  # its AdamW half is Adam's pair: measure Muon's own state
        keys = ["momentum_buffer"]
    rows = []
    for key in keys:
        for label, bits, make, transform, *block in CANDIDATES[ROLE_KEYS[key]]:
            if codecs and not any(c in label for c in codecs.split(",")):
                continue
            qmap, block = make(), block[0] if block else 256 if bits == 8 else 128
            test, changed = _with(sds, key, lambda t: roundtrip(t, qmap, transform, bits, block))
            if changed:
                errs = errors(name, model, sds, test, batch, [where[c] for c in changed])
                rows.append({"optimizer": name, "key": key, "codec": label, "bits": bits, **_summary(errs)})
    return rows


def after_convert(name: str, steps: int) -> list[dict]:
    """Rows for ckptq 8-bit, ckptq 4-bit and (Lion, SGD) bitsandbytes' own 8-bit state."""
    import ckptq

    model, opts, batch = train(name, steps)
    sds = [o.state_dict() for o in opts]
    where = _param_positions(model, opts)
    nparams = sum(p.numel() for p in model.parameters())
    rows = []
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "ckpt.pt")
        torch.save({"optimizer": sds}, src)
        fp32 = os.path.getsize(src)
        for bits in (8, 4):
            out = os.path.join(d, f"ckpt.q{bits}.safetensors")
            report = ckptq.convert(src, out, bits=bits)
            back = ckptq.load(out, dequantize=True)["optimizer"]
            low = ckptq.load(out)["optimizer"]
            changed = [(k, pid) for k, sd in enumerate(low) for pid, st in sd["state"].items()
                       if any(isinstance(v, dict) and "codes" in v for v in st.values())]
            errs = errors(name, model, sds, back, batch, [where[c] for c in changed])
            rows.append({"optimizer": name, "state": f"ckptq {bits}-bit", "bytes_per_param": report.output_bytes / nparams,
                         "fp32_bytes_per_param": fp32 / nparams, **_summary(errs)})
    if name in BNB_OWN:
        test, changed = _with(sds, BNB_OWN[name], _bnb_signed)
        errs = errors(name, model, sds, test, batch, [where[c] for c in changed])
        own = sum(t.numel() + 4 * -(-t.numel() // 256) if t.numel() >= MIN_NUMEL else 4 * t.numel()
                  for sd in sds for st in sd["state"].values() for t in st.values()
                  if isinstance(t, torch.Tensor) and t.is_floating_point() and t.ndim)
        rows.append({"optimizer": name, "state": "bitsandbytes 8-bit", "bytes_per_param": own / nparams, **_summary(errs)})
    return rows


def _table(rows: list[dict], cols: list[str]) -> str:
    def cell(v):
        return f"{100 * v:.2f}%" if isinstance(v, float) and v < 10 and cols else str(v)

    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        lines.append(" | ".join(f"{r[c]:.2f}" if c.endswith("per_param") else cell(r.get(c, "")) for c in cols))
    return "\n".join(lines)


def main() -> None:
    args = build_parser().parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    names = [n for n in (args.only.split(",") if args.only else OPTIMIZERS) if not (args.sweep and n in SKIP)]
    rows = []
    cols = ["optimizer", "key", "codec", "worst", "median", "tensors"] if args.sweep else \
        ["optimizer", "state", "bytes_per_param", "worst", "median", "tensors"]
    print("\n".join(_table([], cols).splitlines()[:2]), flush=True)
    for name in names:  # each optimizer's rows as soon as they are measured
        new = sweep(name, args.steps, args.codecs) if args.sweep else after_convert(name, args.steps)
        print("\n".join(_table(new, cols).splitlines()[2:]), flush=True)
        rows += new
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
