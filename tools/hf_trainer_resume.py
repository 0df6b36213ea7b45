"""Prove the README's Hugging Face Trainer recipe: train, ``ckptq convert`` optimizer.pt, resume in 8 bits.

1. A tiny GPT-2 (built from its config: no download) trains ``--steps`` steps with ``Trainer``'s default
   torch AdamW on synthetic token sequences, saving ``checkpoint-N`` folders.
2. ``python -m ckptq convert checkpoint-N/optimizer.pt`` (the CLI, as a user would run it) writes
   ``optimizer.q8.safetensors``; optimizer.pt is then removed, as a user keeping the small file would.
3. A new Trainer gets ``optimizers=(AdamW8bit over Trainer's own two param groups, loaded from
   ckptq.load(...)), its LR scheduler loaded from scheduler.pt)`` and resumes from checkpoint-N.

A control resumes the same way with torch AdamW from the fp32 optimizer.pt and must reproduce the
uninterrupted run (so any gap left is the 8-bit state's). Checks: the 8-bit run continues at step N+1, its
learning rate equals the uninterrupted run's at every step, its losses are finite and within 1% of the
uninterrupted run's. Exits non-zero otherwise.

    python tools/hf_trainer_resume.py [--steps 40 --save-steps 20]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, get_scheduler  # noqa: E402

import ckptq  # noqa: E402
from ckptq.optim import AdamW8bit  # noqa: E402

VOCAB, SEQ = 256, 32


class Tokens(torch.utils.data.Dataset):
    """Deterministic sequences where token t+1 = (a * token t + b) mod 256: learnable in a few steps."""

    def __init__(self, count: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (count, 1), generator=g)
        step = torch.randint(1, 8, (count, 1), generator=g)
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB  # [count, SEQ]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    # No dropout: the only difference between the runs compared below is then the optimizer state.
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def make_args(out: str, steps: int, save_steps: int) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out, max_steps=steps, save_steps=save_steps, logging_steps=1, per_device_train_batch_size=8,
        learning_rate=3e-3, warmup_steps=5, weight_decay=0.1, lr_scheduler_type="linear", report_to="none",
        use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, save_only_model=False,
    )


def logged(trainer: Trainer, after: int = 0) -> dict[int, tuple[float, float]]:
    """step -> (loss, learning rate) for steps > ``after`` (a resumed log starts with the checkpoint's)."""
    history = trainer.state.log_history
    return {h["step"]: (h["loss"], h["learning_rate"]) for h in history if "loss" in h and h["step"] > after}


def resume(ckpt: str, out: str, steps: int, save_steps: int, fp32_state: str | None = None) -> Trainer:
    """The README recipe: AdamW8bit from the converted file, scheduler from scheduler.pt, then train.
    With ``fp32_state`` (a control): torch AdamW loaded from that optimizer.pt, the same way."""
    model, args = make_model(), make_args(out, steps, save_steps)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(4096))
    decay = set(trainer.get_decay_parameter_names(model))  # Trainer's groups: the saved state has two
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    hyper = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    opt = torch.optim.AdamW(groups, **hyper) if fp32_state else AdamW8bit(groups, **hyper)
    # Order matters (as in Trainer): creating the scheduler sets each group's lr to its step-0 value
    # (0 during warm-up) and scheduler.load_state_dict does not restore it; optimizer.load_state_dict does.
    sched = get_scheduler(args.lr_scheduler_type, opt, args.get_warmup_steps(steps), steps)
    if fp32_state:
        opt.load_state_dict(torch.load(fp32_state, weights_only=True))
    else:
        opt.load_state_dict(ckptq.load(os.path.join(ckpt, "optimizer.q8.safetensors")))
    sched.load_state_dict(torch.load(os.path.join(ckpt, "scheduler.pt"), weights_only=True))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(4096), optimizers=(opt, sched))
    trainer.train(resume_from_checkpoint=ckpt)
    return trainer


def check(reference: dict, control: dict, resumed: dict, start: int, steps: int) -> list[str]:
    """Problems found comparing the resumed runs' logs with the uninterrupted one (empty: all good)."""
    problems = [f"step {s}: fp32 control resume {control[s][0]:.6f} != uninterrupted {reference[s][0]:.6f}"
                for s in control if not math.isclose(control[s][0], reference[s][0], rel_tol=1e-4)]
    if sorted(resumed) != list(range(start + 1, steps + 1)):
        problems.append(f"resumed run logged steps {sorted(resumed)}, expected {start + 1}..{steps}")
    for step, (loss, lr) in resumed.items():
        ref_loss, ref_lr = reference[step]
        if not math.isfinite(loss):
            problems.append(f"step {step}: loss {loss}")
        if not math.isclose(lr, ref_lr, rel_tol=1e-6, abs_tol=1e-12):
            problems.append(f"step {step}: learning rate {lr:g}, uninterrupted run {ref_lr:g}")
        if abs(loss - ref_loss) > 0.01 * ref_loss:
            problems.append(f"step {step}: loss {loss:.4f} vs uninterrupted {ref_loss:.4f} (> 1% apart)")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-steps", type=int, default=20, help="resume from checkpoint-<save-steps>")
    parser.add_argument("--workdir", help="keep the run folders here (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or tmp
        first = Trainer(model=make_model(), args=make_args(os.path.join(root, "fp32"), args.steps, args.save_steps),
                        train_dataset=Tokens(4096))
        first.train()
        ckpt = os.path.join(root, "resume", f"checkpoint-{args.save_steps}")
        shutil.copytree(os.path.join(root, "fp32", f"checkpoint-{args.save_steps}"), ckpt, dirs_exist_ok=True)
        cmd = [sys.executable, "-m", "ckptq", "convert", os.path.join(ckpt, "optimizer.pt")]
        print("$", " ".join(cmd[1:]), "\n" + subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        fp32_bytes = os.path.getsize(os.path.join(ckpt, "optimizer.pt"))
        q8_bytes = os.path.getsize(os.path.join(ckpt, "optimizer.q8.safetensors"))
        os.remove(os.path.join(ckpt, "optimizer.pt"))
        fp32_opt = os.path.join(root, "fp32", f"checkpoint-{args.save_steps}", "optimizer.pt")
        control = resume(ckpt, os.path.join(root, "control"), args.steps, args.save_steps, fp32_opt)
        resumed = resume(ckpt, os.path.join(root, "resume"), args.steps, args.save_steps)
        reference = logged(first)
        control, after = logged(control, args.save_steps), logged(resumed, args.save_steps)
    print(f"optimizer.pt {fp32_bytes:,} B -> optimizer.q8.safetensors {q8_bytes:,} B ({fp32_bytes / q8_bytes:.2f}x)")
    print("| step | loss uninterrupted | loss fp32 resume | loss 8-bit resume | lr uninterrupted | lr 8-bit |")
    print("|---:|---:|---:|---:|---:|---:|")
    for s in sorted(after):
        ref, ctl, ours = reference[s], control.get(s, (math.nan,)), after[s]
        print(f"| {s} | {ref[0]:.4f} | {ctl[0]:.4f} | {ours[0]:.4f} | {ref[1]:.3g} | {ours[1]:.3g} |")
    problems = check(reference, control, after, args.save_steps, args.steps)
    print("\n".join(problems) if problems else f"OK: resumed at step {args.save_steps} and trained to {args.steps}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
