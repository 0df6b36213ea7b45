"""ckptq.integrations.transformers with the real Trainer: a 2-layer GPT-2 built from its config (no
download) trains 8 steps with checkpoints every 4; a new trainer resumes from checkpoint-4 and must
continue as the uninterrupted run did (same steps, same learning rates; the same losses with AdamW8bit,
whose state is stored as is; within 8-bit storage's error with torch's AdamW). ~6 s of CPU per case."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import ckptq  # noqa: E402
from ckptq.integrations.transformers import OPTIMIZER_8BIT_NAME, CkptqTrainer  # noqa: E402
from ckptq.optim import AdamW8bit  # noqa: E402

VOCAB, SEQ, STEPS, SAVE = 256, 32, 8, 4


class Tokens(torch.utils.data.Dataset):
    """Sequences where token t+1 = (token t + a) mod 256: learnable within a few steps."""

    def __init__(self, count: int = 256):
        g = torch.Generator().manual_seed(0)
        start, step = torch.randint(0, VOCAB, (count, 1), generator=g), torch.randint(1, 8, (count, 1), generator=g)
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_trainer(out: str, optimizer: str, trainer=CkptqTrainer) -> transformers.Trainer:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=STEPS, save_steps=SAVE, logging_steps=1, per_device_train_batch_size=8,
        learning_rate=3e-3, warmup_steps=2, weight_decay=0.1, lr_scheduler_type="linear", report_to="none",
        use_cpu=True, seed=0, disable_tqdm=True)
    # Trainer's own AdamW arguments (lr, betas, eps, fused) and param groups, with ckptq's 8-bit class
    adamw_args = transformers.Trainer.get_optimizer_cls_and_kwargs(args)[1]
    custom = (AdamW8bit, adamw_args) if optimizer == "AdamW8bit" else None
    return trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=Tokens(),
                   optimizer_cls_and_kwargs=custom)


def logged(trainer, after: int = 0) -> dict[int, tuple[float, float]]:
    """step -> (loss, learning rate) for steps > ``after`` (a resumed log starts with the checkpoint's)."""
    return {h["step"]: (h["loss"], h["learning_rate"]) for h in trainer.state.log_history
            if "loss" in h and h["step"] > after}


def check_continues(first, resumed, exact: bool) -> None:
    """``resumed`` ran steps SAVE+1..STEPS with ``first``'s learning rates and losses: equal when ``exact``;
    else within 8-bit storage's error of fp32 moments (measured gaps <= 6e-7 relative, while a resume
    whose moments were lost (zeroed) is 2e-4 apart at step 6 and 4.5e-3 at step 7)."""
    assert resumed.state.global_step == STEPS
    before, after = logged(first), logged(resumed, SAVE)
    assert sorted(after) == list(range(SAVE + 1, STEPS + 1))
    for step, (loss, lr) in after.items():
        assert lr == pytest.approx(before[step][1], rel=1e-9)  # the scheduler resumed at step SAVE
        assert loss == before[step][0] if exact else loss == pytest.approx(before[step][0], rel=1e-4)


@pytest.mark.parametrize("optimizer", ["torch AdamW", "AdamW8bit"])
def test_trainer_checkpoints_hold_8bit_state_and_resume(tmp_path, optimizer):
    first = make_trainer(str(tmp_path / "a"), optimizer)
    first.train()
    ckpt = tmp_path / "a" / f"checkpoint-{SAVE}"
    assert (ckpt / OPTIMIZER_8BIT_NAME).is_file() and not (ckpt / "optimizer.pt").exists()
    expanded = ckptq.expand(str(ckpt / OPTIMIZER_8BIT_NAME), str(tmp_path / "fp32.pt")).output
    fp32 = torch.load(expanded, weights_only=True)  # what torch AdamW would have saved: fp32 moments
    assert fp32["state"][0]["exp_avg"].dtype == torch.float32
    assert os.path.getsize(ckpt / OPTIMIZER_8BIT_NAME) < os.path.getsize(expanded) / 3  # biases, norms stay fp32

    resumed = make_trainer(str(tmp_path / "b"), optimizer)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert isinstance(resumed.optimizer.optimizer, AdamW8bit if optimizer == "AdamW8bit" else torch.optim.AdamW)
    check_continues(first, resumed, exact=optimizer == "AdamW8bit")  # AdamW8bit's state is stored as it is
    if optimizer == "torch AdamW":  # the way back to a stock Trainer: the expanded file as optimizer.pt
        os.replace(expanded, ckpt / "optimizer.pt")
        os.remove(ckpt / OPTIMIZER_8BIT_NAME)
        stock = make_trainer(str(tmp_path / "c"), optimizer, trainer=transformers.Trainer)
        stock.train(resume_from_checkpoint=str(ckpt))
        check_continues(first, stock, exact=False)
        # and a stock Trainer's checkpoint (optimizer.pt) resumes under CkptqTrainer, whose next ones are 8-bit
        switched = make_trainer(str(tmp_path / "d"), optimizer)
        switched.train(resume_from_checkpoint=str(ckpt))
        check_continues(first, switched, exact=False)
        last = tmp_path / "d" / f"checkpoint-{STEPS}"
        assert (last / OPTIMIZER_8BIT_NAME).is_file() and not (last / "optimizer.pt").exists()
