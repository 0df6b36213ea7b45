"""Anchor ``ckptq estimate``: its figures against a real training step on this machine and DeepSpeed's estimators.

1. Measured: GPT-2- and Llama-style models built from configs with transformers (no download), trained in
   fp32 with torch AdamW on the CPU, two steps. Per component: weights, gradients and optimizer state are the
   bytes of the live tensors (AdamW fp32, and ckptq AdamW8bit's real 8-bit state); activations are the
   distinct storages the forward hands to autograd (``torch.autograd.graph.saved_tensors_hooks``) plus the
   logits the model returns; the peak of the second step comes from torch's ``MemTracker``
   (``torch.distributed._tools.mem_tracker``), with and without activation checkpointing, against the
   estimate's ``peak`` (gradients freed after each step, as ``zero_grad(set_to_none=True)`` does).
2. Model states under bf16 mixed precision against DeepSpeed's ``estimate_zero2_model_states_mem_needs`` /
   ``estimate_zero3_model_states_mem_needs`` (what the ``*_all_cold`` printers call), without offload,
   for the same parameter counts. DeepSpeed also counts an fp32 copy of each rank's gradient partition
   (4 bytes/param / world); ZeRO's paper and ckptq's estimate do not, so the table shows ours with it too.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python tools/bench/estimate_check.py

Needs transformers (and deepspeed for part 2; without it part 2 is skipped).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--worlds", default="1,8,64")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

import torch  # noqa: E402

from ckptq import estimate  # noqa: E402
from ckptq.footprint.params import model_from_config  # noqa: E402

CONFIGS = {  # dropout off, as in current fine-tuning recipes (CPU kernels keep dropout masks at 4 bytes)
    "gpt2-30M": ("GPT2Config", dict(n_layer=6, n_embd=384, n_head=6, vocab_size=50257, n_positions=1024,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "llama-50M": ("LlamaConfig", dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
                                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)),
}


def _config(name: str):
    import transformers

    cls, kwargs = CONFIGS[name]
    return getattr(transformers, cls)(**kwargs)


def _bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def saved_activation_bytes(model, ids) -> int:
    """Distinct storages the forward saves for the backward (parameters excluded), plus the logits."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    logits = out.logits.untyped_storage()
    return sum(saved.values()) + (0 if logits.data_ptr() in saved else logits.nbytes())


def peak_of_step(model, opt, ids) -> int:
    """MemTracker's peak over the second of two training steps (the first creates the optimizer state)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, opt)
    for step in range(2):
        with tracker:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if step == 0:
            tracker.reset_mod_stats()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def measure(name: str, batch: int, seq: int) -> dict:
    from transformers import AutoModelForCausalLM

    from ckptq.optim import AdamW8bit

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(name), attn_implementation="sdpa").train()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    m = {"weights": _bytes(model.parameters()), "activations": saved_activation_bytes(model, ids)}
    model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(model.parameters())
    m["peak"] = peak_of_step(model, opt, ids)
    model(input_ids=ids, labels=ids).loss.backward()
    m["gradients"] = _bytes(p.grad for p in model.parameters())
    m["optimizer_adamw_fp32"] = _bytes(t for s in opt.state.values() for t in s.values() if t.dim())
    opt8 = AdamW8bit(model.parameters())
    opt8.step()
    m["optimizer_ckptq_8bit"] = _bytes(_state_tensors(opt8.state_dict()["state"]))
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m["peak_checkpointed"] = peak_of_step(model, torch.optim.AdamW(model.parameters()), ids)
    return m


def _state_tensors(obj):
    """Every non-scalar tensor in an optimizer state; 8-bit states are dicts of codes, absmax and a codebook
    (1 KiB, shared; left out as in the estimate)."""
    if isinstance(obj, torch.Tensor) and obj.dim():
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if k != "qmap":
                yield from _state_tensors(v)


def estimated(name: str, batch: int, seq: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        _config(name).to_json_file(os.path.join(d, "config.json"))
        r = estimate(d, batch_size=batch, seq_len=seq, precision="fp32", attention="sdpa")
    e = {k: r.per_device[k] for k in ("weights", "gradients", "optimizer_adamw_fp32", "optimizer_ckptq_8bit", "activations")}
    return e | {k: r.totals["adamw_fp32"][k] for k in ("peak", "peak_checkpointed")}


def _mb(n) -> str:
    return f"{n / 2**20:10.2f}"


def measured_table(batch: int, seq: int) -> None:
    print(f"\nfp32 training step on the CPU, batch {batch} x {seq} tokens, SDPA attention (MiB)\n")
    print("| model | quantity | estimate | measured | estimate / measured |\n|---|---|---:|---:|---:|")
    for name in CONFIGS:
        m, e = measure(name, batch, seq), estimated(name, batch, seq)
        for key in ("weights", "gradients", "optimizer_adamw_fp32", "optimizer_ckptq_8bit", "activations", "peak",
                    "peak_checkpointed"):
            print(f"| {name} | {key} | {_mb(e[key])} | {_mb(m[key])} | {e[key] / m[key]:.3f} |")


def deepspeed_table(worlds: list[int]) -> None:
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError as e:
        print(f"\nDeepSpeed comparison skipped: {e}")
        return
    print("\nModel states per device, bf16 mixed precision, AdamW fp32, no offload (GiB)\n")
    print("| model | world | stage | ckptq estimate | + fp32 grad partition | DeepSpeed | estimate / DeepSpeed | "
          "(+ partition) / DeepSpeed |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in CONFIGS:
        model = model_from_config(_config(name).to_dict())
        largest = _largest_module(model.tensors)
        for world in worlds:
            for stage in (2, 3):
                with tempfile.TemporaryDirectory() as d:
                    _config(name).to_json_file(os.path.join(d, "config.json"))
                    ours = estimate(d, world_size=world, zero_stage=stage).totals["adamw_fp32"]["model_states"]
                if stage == 2:
                    ds = estimate_zero2_model_states_mem_needs(model.count, world, 1, cpu_offload=False)[1]
                else:
                    ds = estimate_zero3_model_states_mem_needs(model.count, largest, world, 1, cpu_offload=False,
                                                               cpu_offload_params=False)[1]
                plus = ours + 4 * model.count // world
                print(f"| {name} | {world} | {stage} | {ours / 2**30:.4f} | {plus / 2**30:.4f} | {ds / 2**30:.4f} | "
                      f"{ours / ds:.3f} | {plus / ds:.3f} |")


def _largest_module(tensors) -> int:
    """DeepSpeed's ``model_to_params``: the most parameters one module holds directly."""
    modules: dict[str, int] = {}
    for name, shape in tensors:
        owner = name.rsplit(".", 1)[0]
        modules[owner] = modules.get(owner, 0) + math.prod(shape)
    return max(modules.values())


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    measured_table(args.batch, args.seq)
    deepspeed_table([int(w) for w in args.worlds.split(",")])


if __name__ == "__main__":
    main()
