"""ckptq's one-state optimizers (SGD8bit, Lion8bit, Muon8bit) in the frameworks' own loops: a transformers
Trainer given one through ``optimizer_cls_and_kwargs``, Lightning's ``configure_optimizers`` and accelerate's
``save_state`` checkpoint and resume them exactly (with ckptq's integration and without: the state dict is
low-bit already and the optimizer loads its own form), and a torch SGD run's checkpoint folder, converted
with --replace, resumes into SGD8bit under CkptqTrainer."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ckptq.integrations.transformers import CkptqTrainer  # noqa: E402
from ckptq.optim import Lion8bit, SGD8bit, SGD4bit  # noqa: E402
from tests.integrations.test_integrations_transformers import SAVE, STEPS, VOCAB, SEQ, Tokens, check_continues  # noqa: E402

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


@pytest.mark.parametrize("name", ["SGD4bit", "Lion8bit"])  # SGD8bit (Nesterov): the Lightning test below
def test_trainer_checkpoints_of_a_one_state_optimizer_resume_exactly(tmp_path, name):
    """Steps 5..8 after resuming checkpoint-4 give the uninterrupted run's losses and learning rates bit for
    bit (4 bits: the seeded stochastic rounding draws the same numbers), with CkptqTrainer and a stock Trainer;
    the optimizer file holds the low-bit codes."""
    custom = CLASSES[name]
    first = make_trainer(str(tmp_path / "a"), custom)
    first.train()
    ckpt = tmp_path / "a" / f"checkpoint-{SAVE}"
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
    key = custom[0].STATES[0].key
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


@pytest.mark.parametrize("name", ["Lion8bit", "SGD8bit"])
def test_lightning_checkpoints_of_a_one_state_optimizer_resume_exactly(tmp_path, name):
    """Lightning, 2 epochs of 4 steps with a checkpoint per epoch, resumed from the first: the second epoch's
    losses bit for bit, with ckptq's CheckpointIO plugin and without it (the state is low-bit already)."""
    L = pytest.importorskip("lightning.pytorch")
    from ckptq.integrations.lightning import CkptqCheckpointIO

    cls, kw = CLASSES[name]

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
            self.seen = {}

        def training_step(self, batch, _):
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.seen[self.global_step + 1] = loss.item()
            return loss

        def configure_optimizers(self):
            return cls(self.parameters(), **{**kw, "lr": kw["lr"] / 5})

    def fit(out, ckpt_path=None, plugins=()):
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.sin(3 * x)), batch_size=16)
        net = Net()
        trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, plugins=list(plugins), default_root_dir=out,
                            callbacks=[L.callbacks.ModelCheckpoint(dirpath=out, save_top_k=-1, every_n_epochs=1)])
        trainer.fit(net, loader, ckpt_path=ckpt_path)
        return net

    first = fit(str(tmp_path / "a"), plugins=(CkptqCheckpointIO(),))
    ckpt = str(tmp_path / "a" / "epoch=0-step=4.ckpt")
    for i, plugins in enumerate(((CkptqCheckpointIO(),), ())):
        resumed = fit(str(tmp_path / f"r{i}"), ckpt_path=ckpt, plugins=plugins)
        assert type(resumed.trainer.optimizers[0]) is cls
        assert resumed.seen == {s: v for s, v in first.seen.items() if s > 4}


def test_accelerate_save_state_of_muon8bit_resumes_exactly(tmp_path):
    """accelerate: low_bit_checkpoints leaves ckptq's optimizers as they are; a Muon8bit (hidden matrices) +
    AdamW8bit (the rest) run saved at step 4 and loaded by a new accelerator continues with the same losses, bit
    for bit, and optimizer.bin holds the momentum's codes."""
    accelerate = pytest.importorskip("accelerate")
    from ckptq.integrations.accelerate import low_bit_checkpoints
    from ckptq.optim import AdamW8bit, Muon8bit

    def run(save=None, load=None):
        accelerator = accelerate.Accelerator(cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        hidden = [p for p in model.parameters() if p.ndim == 2]
        opts = [Muon8bit(hidden, lr=0.02), AdamW8bit([p for p in model.parameters() if p.ndim < 2], lr=1e-2)]
        model, *opts = accelerator.prepare(model, *opts)
        for opt in opts:
            low_bit_checkpoints(opt)
        if load:
            accelerator.load_state(load)
        losses = {}
        for step in range(5 if load else 1, 9):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(16, 64, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), torch.sin(3 * x))
            accelerator.backward(loss)
            for opt in opts:
                opt.step(), opt.zero_grad()
            losses[step] = loss.item()
            if step == 4 and save:
                accelerator.save_state(save)
        return losses

    before = run(save=str(tmp_path / "ckpt"))
    saved = torch.load(tmp_path / "ckpt" / "optimizer.bin", weights_only=True)
    assert all(s["momentum_buffer"]["codes"].dtype == torch.uint8 for s in saved["state"].values())
    after = run(load=str(tmp_path / "ckpt"))
    assert after == {s: v for s, v in before.items() if s > 4}
