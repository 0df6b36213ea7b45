"""Check the README's Hugging Face Trainer line end to end: ``CkptqTrainer`` checkpoints hold
``optimizer.q8.safetensors`` (no ``optimizer.pt``), and ``train(resume_from_checkpoint=...)`` continues.

A tiny GPT-2 (built from its config: no download) trains ``--steps`` steps on synthetic token sequences,
saving ``checkpoint-N`` folders every ``--save-steps``:

1. stock ``Trainer`` with torch AdamW: the uninterrupted reference, and a control resumed from its fp32
   ``checkpoint-<save-steps>/optimizer.pt`` (it must reproduce the reference, so a gap left below is 8-bit's);
2. ``CkptqTrainer`` with torch AdamW: trains exactly as the reference (saving changes nothing), and a run
   resumed from its 8-bit checkpoint (moments decoded to fp32) stays within ``--tolerance`` of it;
3. ``CkptqTrainer`` with ckptq's AdamW8bit (``optimizer_cls_and_kwargs``, Trainer's AdamW arguments): a
   resume from its checkpoint reproduces its uninterrupted run exactly.

Every resumed run must log steps save+1..steps with the uninterrupted run's learning rates. Prints the
file sizes and the losses; exits non-zero on any problem.

    python tools/hf_trainer_resume.py [--steps 40 --save-steps 20]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from ckptq.integrations.transformers import CkptqTrainer  # noqa: E402
from ckptq.optim import AdamW8bit  # noqa: E402

VOCAB, SEQ = 256, 32


class Tokens(torch.utils.data.Dataset):
    """Deterministic sequences where token t+1 = (token t + a) mod 256: learnable in a few steps."""

    def __init__(self, count: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (count, 1), generator=g)
        step = torch.randint(1, 8, (count, 1), generator=g)
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB  # [count, SEQ]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_trainer(cls, out: str, steps: int, save_steps: int, adamw8bit: bool = False) -> Trainer:
    torch.manual_seed(0)
    # No dropout: the only difference between the runs compared below is then the optimizer state.
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    args = TrainingArguments(
        output_dir=out, max_steps=steps, save_steps=save_steps, logging_steps=1, per_device_train_batch_size=8,
        learning_rate=3e-3, warmup_steps=5, weight_decay=0.1, lr_scheduler_type="linear", report_to="none",
        use_cpu=True, seed=0, data_seed=0, disable_tqdm=True)
    # AdamW8bit with Trainer's own AdamW arguments (lr, betas, eps, fused) and param groups
    custom = (AdamW8bit, Trainer.get_optimizer_cls_and_kwargs(args)[1]) if adamw8bit else None
    return cls(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(4096), optimizer_cls_and_kwargs=custom)


def logged(trainer: Trainer, after: int = 0) -> dict[int, tuple[float, float]]:
    """step -> (loss, learning rate) for steps > ``after`` (a resumed log starts with the checkpoint's)."""
    return {h["step"]: (h["loss"], h["learning_rate"]) for h in trainer.state.log_history
            if "loss" in h and h["step"] > after}


def compare(name: str, reference: dict, run: dict, rel: float, start: int, steps: int) -> list[str]:
    """Problems of ``run`` (steps start+1..steps) against ``reference``: steps, learning rates, losses within ``rel``."""
    if sorted(run) != list(range(start + 1, steps + 1)):
        return [f"{name}: logged steps {sorted(run)}, expected {start + 1}..{steps}"]
    problems = []
    for step, (loss, lr) in run.items():
        ref_loss, ref_lr = reference[step]
        if not math.isclose(lr, ref_lr, rel_tol=1e-9, abs_tol=1e-15):
            problems.append(f"{name}: step {step}: learning rate {lr:g}, uninterrupted {ref_lr:g}")
        if not math.isfinite(loss) or abs(loss - ref_loss) > rel * abs(ref_loss):
            problems.append(f"{name}: step {step}: loss {loss:.6f} vs uninterrupted {ref_loss:.6f} (> {rel:g} apart)")
    return problems


def train(cls, out: str, a: argparse.Namespace, resume: str | None = None, adamw8bit: bool = False) -> dict:
    trainer = make_trainer(cls, out, a.steps, a.save_steps, adamw8bit)
    trainer.train(resume_from_checkpoint=resume)
    return logged(trainer, a.save_steps if resume else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-steps", type=int, default=20, help="resume from checkpoint-<save-steps>")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="relative loss gap allowed after an 8-bit resume")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        ckpt = lambda run: os.path.join(root, run, f"checkpoint-{a.save_steps}")  # noqa: E731
        reference = train(Trainer, os.path.join(root, "stock"), a)
        control = train(Trainer, os.path.join(root, "stock-resumed"), a, ckpt("stock"))
        ours = train(CkptqTrainer, os.path.join(root, "ckptq"), a)
        resumed = train(CkptqTrainer, os.path.join(root, "ckptq-resumed"), a, ckpt("ckptq"))
        ours8 = train(CkptqTrainer, os.path.join(root, "adamw8bit"), a, adamw8bit=True)
        resumed8 = train(CkptqTrainer, os.path.join(root, "adamw8bit-resumed"), a, ckpt("adamw8bit"), adamw8bit=True)
        leftover = os.path.exists(os.path.join(ckpt("ckptq"), "optimizer.pt"))
        fp32, q8 = os.path.getsize(os.path.join(ckpt("stock"), "optimizer.pt")), \
            os.path.getsize(os.path.join(ckpt("ckptq"), "optimizer.q8.safetensors"))
    problems = compare("stock resume (control)", reference, control, 1e-4, a.save_steps, a.steps)
    problems += compare("CkptqTrainer uninterrupted", reference, ours, 0.0, 0, a.steps)
    problems += compare("CkptqTrainer resume, torch AdamW", reference, resumed, a.tolerance, a.save_steps, a.steps)
    problems += compare("CkptqTrainer resume, AdamW8bit", ours8, resumed8, 0.0, a.save_steps, a.steps)
    problems += ["CkptqTrainer's checkpoint holds an optimizer.pt"] if leftover else []
    print(f"checkpoint-{a.save_steps}: stock optimizer.pt {fp32:,} B, CkptqTrainer optimizer.q8.safetensors "
          f"{q8:,} B ({fp32 / q8:.2f}x smaller)")
    print("| step | stock, uninterrupted | stock, resumed | CkptqTrainer resumed (torch AdamW) | rel. gap | "
          "AdamW8bit uninterrupted | AdamW8bit resumed |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for s in sorted(resumed):
        ref = reference[s][0]
        print(f"| {s} | {ref:.5f} | {control.get(s, (math.nan,))[0]:.5f} | {resumed[s][0]:.5f} | "
              f"{(resumed[s][0] - ref) / ref:+.1e} | {ours8[s][0]:.5f} | {resumed8.get(s, (math.nan,))[0]:.5f} |")
    print("\n".join(problems) if problems else f"OK: every run resumed at step {a.save_steps} and trained to {a.steps}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
