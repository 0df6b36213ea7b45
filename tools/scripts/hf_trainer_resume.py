"""Check the README's Hugging Face Trainer line end to end, for each optimizer Trainer offers that ckptq
handles: ``CkptqTrainer`` checkpoints, ``train(resume_from_checkpoint=...)`` continuing as the
uninterrupted run did, and what a stock ``Trainer`` does with such a checkpoint.

A tiny GPT-2 (built from its config: no download) trains ``--steps`` steps on synthetic token sequences,
saving ``checkpoint-N`` folders every ``--save-steps``:

1. stock ``Trainer`` with torch AdamW: the uninterrupted reference, and a control resumed from its fp32
   ``checkpoint-<save-steps>/optimizer.pt`` (it must reproduce the reference, so a gap left below is 8-bit's);
2. ``CkptqTrainer`` with torch AdamW: trains exactly as the reference (saving changes nothing), and a run
   resumed from its 8-bit checkpoint (moments decoded to fp32) stays within ``--tolerance`` of it;
3. ``CkptqTrainer`` with ckptq's AdamW8bit (``optimizer_cls_and_kwargs``), torchao's 8-bit and 4-bit AdamW
   (``optim="adamw_torch_8bit"``/``"adamw_torch_4bit"``) and bitsandbytes' (``optim="adamw_bnb_8bit"``): a
   resume reproduces the uninterrupted run exactly (their states are stored without a bit changed);
4. a stock ``Trainer`` resuming ``CkptqTrainer``'s torch AdamW checkpoint must stop with ckptq's message,
   where without ``optimizer.pt`` it would start a fresh optimizer and scheduler (shown for scale).

Every resumed run must log steps save+1..steps with the uninterrupted run's learning rates. Prints the
file sizes, each run's loss right after the resume and its largest gap; exits non-zero on any problem.

    python tools/scripts/hf_trainer_resume.py [--steps 40 --save-steps 20] [--eager-torchao]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-steps", type=int, default=20, help="resume from checkpoint-<save-steps>")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="relative loss gap allowed after an 8-bit resume")
    parser.add_argument("--eager-torchao", action="store_true",
                        help="run torchao's step without torch.compile (a CPU without time for its C++ builds)")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch and ckptq load

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from ckptq.integrations.transformers import OPTIMIZER_8BIT_NAME, CkptqTrainer  # noqa: E402
from ckptq.optim import AdamW8bit  # noqa: E402

VOCAB, SEQ = 256, 32
# name -> (Trainer's optim, ckptq's AdamW8bit through optimizer_cls_and_kwargs, the package it needs)
OPTIMIZERS = {"AdamW8bit (ckptq)": ("adamw_torch", True, None),
              "torchao 8-bit": ("adamw_torch_8bit", False, "torchao"),
              "torchao 4-bit": ("adamw_torch_4bit", False, "torchao"),
              "bitsandbytes 8-bit": ("adamw_bnb_8bit", False, "bitsandbytes")}


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


def make_trainer(cls, out: str, steps: int, save_steps: int, optim: str = "adamw_torch", adamw8bit: bool = False) -> Trainer:
    torch.manual_seed(0)
    # No dropout: the only difference between the runs compared below is then the optimizer state.
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    args = TrainingArguments(
        output_dir=out, max_steps=steps, save_steps=save_steps, logging_steps=1, per_device_train_batch_size=8,
        learning_rate=3e-3, warmup_steps=5, weight_decay=0.1, lr_scheduler_type="linear", report_to="none",
        use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, optim=optim)
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


def train(cls, out: str, a: argparse.Namespace, resume: str | None = None, **kwargs) -> dict:
    trainer = make_trainer(cls, out, a.steps, a.save_steps, **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return logged(trainer, a.save_steps if resume else 0)


def stock_on_ckptq_checkpoint(root: str, ckpt: str, a: argparse.Namespace) -> str | None:
    """The error a stock Trainer stops with at CkptqTrainer's checkpoint, or None if it trained on."""
    try:
        train(Trainer, os.path.join(root, "stock-on-ckptq"), a, ckpt)
    except ValueError as e:
        return str(e)
    return None


def row(name: str, reference: dict, resumed: dict, start: int) -> str:
    """name | the loss at the first step the restored optimizer state moved (start + 2: the loss at start + 1
    comes from the restored weights alone), uninterrupted and resumed | their gap | the largest gap."""
    gaps = [abs(resumed[s][0] - reference[s][0]) / abs(reference[s][0]) for s in resumed]
    s = start + 2
    return (f"| {name} | {reference[s][0]:.5f} | {resumed[s][0]:.5f} | "
            f"{(resumed[s][0] - reference[s][0]) / reference[s][0]:+.1e} | {max(gaps):.1e} |")


def main() -> None:
    a = build_parser().parse_args()
    if a.eager_torchao:
        torch.compile = lambda fn, **kwargs: fn
    rows, problems = [], []
    with tempfile.TemporaryDirectory() as root:
        ckpt = lambda run: os.path.join(root, run, f"checkpoint-{a.save_steps}")  # noqa: E731
        reference = train(Trainer, os.path.join(root, "stock"), a)
        control = train(Trainer, os.path.join(root, "stock-resumed"), a, ckpt("stock"))
        ours = train(CkptqTrainer, os.path.join(root, "ckptq"), a)
        resumed = train(CkptqTrainer, os.path.join(root, "ckptq-resumed"), a, ckpt("ckptq"))
        fp32, q8 = os.path.getsize(os.path.join(ckpt("stock"), "optimizer.pt")), \
            os.path.getsize(os.path.join(ckpt("ckptq"), OPTIMIZER_8BIT_NAME))
        stopped = stock_on_ckptq_checkpoint(root, ckpt("ckptq"), a)
        os.remove(os.path.join(ckpt("stock"), "optimizer.pt"))  # what a stock Trainer did here before the signposts:
        lost = train(Trainer, os.path.join(root, "stock-lost"), a, ckpt("stock"))  # fresh optimizer and scheduler
        problems += compare("stock resume (control)", reference, control, 1e-4, a.save_steps, a.steps)
        problems += compare("CkptqTrainer uninterrupted", reference, ours, 0.0, 0, a.steps)
        problems += compare("CkptqTrainer resume, torch AdamW", reference, resumed, a.tolerance, a.save_steps, a.steps)
        problems += [] if stopped and "ckptq expand" in stopped else ["a stock Trainer trained on from a ckptq checkpoint"]
        rows += [row("stock Trainer, torch AdamW (control)", reference, control, a.save_steps),
                 row("stock Trainer, optimizer.pt missing: fresh optimizer", reference, lost, a.save_steps),
                 row("CkptqTrainer, torch AdamW", reference, resumed, a.save_steps)]
        for name, (optim, adamw8bit, package) in OPTIMIZERS.items():
            if package and importlib.util.find_spec(package) is None:
                rows.append(f"| {name} | not installed | | | |")
                continue
            run = name.split()[0]
            first = train(CkptqTrainer, os.path.join(root, run), a, optim=optim, adamw8bit=adamw8bit)
            again = train(CkptqTrainer, os.path.join(root, run + "-resumed"), a, ckpt(run), optim=optim, adamw8bit=adamw8bit)
            problems += compare(f"CkptqTrainer resume, {name}", first, again, 0.0, a.save_steps, a.steps)
            rows.append(row(f"CkptqTrainer, {name}", first, again, a.save_steps))
    print(f"checkpoint-{a.save_steps}: stock optimizer.pt {fp32:,} B, CkptqTrainer {OPTIMIZER_8BIT_NAME} "
          f"{q8:,} B ({fp32 / q8:.2f}x smaller)")
    print(f"| optimizer | uninterrupted, step {a.save_steps + 2} | resumed, step {a.save_steps + 2} | gap | "
          f"largest gap, steps {a.save_steps + 1}..{a.steps} |")
    print("|---|---:|---:|---:|---:|")
    print("\n".join(rows))
    print(f"a stock Trainer resuming CkptqTrainer's checkpoint: {'ValueError: ' + stopped if stopped else 'trained on'}")
    print("\n".join(problems) if problems else f"OK: every run resumed at step {a.save_steps} and trained to {a.steps}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
