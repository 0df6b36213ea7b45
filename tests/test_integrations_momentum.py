"""ckptq's one-state optimizers (SGD8bit, Lion8bit, Muon8bit) in the frameworks' own loops: a transformers
Trainer given one through ``optimizer_cls_and_kwargs`` checkpoints and resumes it exactly (CkptqTrainer and a
stock Trainer alike: its state dict is low-bit already and it loads its own form), and a torch SGD run's
checkpoint folder, converted with --replace, resumes into SGD8bit under CkptqTrainer."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ckptq.integrations.transformers import CkptqTrainer  # noqa: E402
from ckptq.optim import Lion8bit, SGD8bit, SGD4bit  # noqa: E402
from test_integrations_transformers import SAVE, STEPS, VOCAB, SEQ, Tokens, check_continues  # noqa: E402

CLASSES = {"SGD8bit": (SGD8bit, dict(lr=0.05, momentum=0.9, nesterov=True)),
           "SGD4bit": (SGD4bit, dict(lr=0.05, momentum=0.9)),
           "Lion8bit": (Lion8bit, dict(lr=3e-4, betas=(0.9, 0.99), weight_decay=0.1))}


def make_trainer(out: str, custom, trainer=CkptqTrainer, optim: str = "adamw_torch") -> transformers.Trainer:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=STEPS, save_steps=SAVE, logging_steps=1, per_device_train_batch_size=8,
        learning_rate=0.05, warmup_steps=2, lr_scheduler_type="linear", report_to="none", use_cpu=True, seed=0,
        disable_tqdm=True, optim=optim, optim_args="momentum=0.9" if optim == "sgd" else None)
    return trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=Tokens(),
                   optimizer_cls_and_kwargs=custom)


@pytest.mark.parametrize("name", list(CLASSES))
def test_trainer_checkpoints_of_a_one_state_optimizer_resume_exactly(tmp_path, name):
    """Steps 5..8 after resuming checkpoint-4 give the uninterrupted run's losses and learning rates bit for
    bit (4 bits: the seeded stochastic rounding draws the same numbers), with CkptqTrainer and a stock Trainer;
    the optimizer file holds the low-bit codes."""
    custom = CLASSES[name]
    first = make_trainer(str(tmp_path / "a"), custom)
    first.train()
    ckpt = tmp_path / "a" / f"checkpoint-{SAVE}"
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
    key = custom[0].state_key
    assert any(isinstance(s.get(key), dict) and s[key]["codes"].dtype == torch.uint8 for s in saved["state"].values())
    for trainer in (CkptqTrainer, transformers.Trainer):
        resumed = make_trainer(str(tmp_path / trainer.__name__), custom, trainer=trainer)
        resumed.train(resume_from_checkpoint=str(ckpt))
        assert type(resumed.optimizer.optimizer) is custom[0]
        check_continues(first, resumed, exact=True)


def test_a_converted_torch_sgd_folder_resumes_into_sgd8bit(tmp_path):
    """A stock Trainer run with optim="sgd" (momentum 0.9), ``ckptq convert checkpoint-4 --replace``: CkptqTrainer
    with SGD8bit resumes it, its momentum from the converted file (not a fresh one: a lost momentum shifts
    step 5's update), within 8-bit storage's error of the uninterrupted run's losses."""
    import ckptq

    first = make_trainer(str(tmp_path / "a"), None, trainer=transformers.Trainer, optim="sgd")
    first.train()
    ckpt = tmp_path / "a" / f"checkpoint-{SAVE}"
    ckptq.convert(str(ckpt), replace=True)
    assert not (ckpt / "optimizer.pt").is_file() or (ckpt / "optimizer.pt").stat().st_size < 4096  # a signpost
    resumed = make_trainer(str(tmp_path / "b"), (SGD8bit, dict(lr=0.05, momentum=0.9)))
    resumed.train(resume_from_checkpoint=str(ckpt))
    state = resumed.optimizer.optimizer.state
    assert all(s["step"] > SAVE - 1 for s in state.values())  # every buffer came from the checkpoint
    check_continues(first, resumed, exact=False)
