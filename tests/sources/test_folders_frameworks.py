"""Checkpoint folders written by the real frameworks: ``ckptq convert DIR --replace``, after which the
framework's own stock resume stops with ckptq's message (a signpost, or the file converted in place, keeps
the name it loads), then ``ckptq expand DIR --replace``, after which the stock resume reads the result
(tiny models built from configs, no downloads; each test is skipped where its framework is not installed)."""

import os
import shutil

import pytest
import torch
from click.testing import CliRunner

from ckptq.cli import main

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def round_trip(folder, optimizer_names, stock_resume, message):
    """convert DIR --replace: every optimizer file's name still there, and ``stock_resume()`` (the framework's
    own) stops with ``message`` (a regex), never a fresh optimizer; expand DIR --replace: the optimizer files
    are back, every other file untouched."""
    others = {n: (folder / n).read_bytes() for n in os.listdir(folder) if n not in optimizer_names and (folder / n).is_file()}
    r = run("convert", folder, "--replace")
    assert r.exit_code == 0, r.output
    assert set(optimizer_names) <= set(os.listdir(folder))
    with pytest.raises(ValueError, match=message):
        stock_resume()
    r = run("expand", folder, "--replace")
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(folder)) == sorted([*others, *optimizer_names])
    assert all((folder / n).read_bytes() == b for n, b in others.items())


def assert_close_states(got: dict, want: dict):
    assert got["state"].keys() == want["state"].keys()
    for pid, s in want["state"].items():
        assert float(got["state"][pid]["step"]) == float(s["step"])
        for key in ("exp_avg", "exp_avg_sq"):  # 8-bit storage is lossy; torch's state dict is the judge
            scale = s[key].abs().max().item()
            torch.testing.assert_close(got["state"][pid][key], s[key], rtol=0, atol=0.05 * scale + 1e-12)


def test_hf_trainer_checkpoint_round_trip_and_stock_resume(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = (torch.arange(16) * (i % 5 + 1) + i) % 128
            return {"input_ids": ids, "labels": ids}

    def trainer(steps):
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=128, n_positions=16, n_embd=64, n_layer=1, n_head=2,
                                         bos_token_id=0, eos_token_id=0)
        args = transformers.TrainingArguments(str(tmp_path / "out"), max_steps=steps, save_steps=2, use_cpu=True,
                                              per_device_train_batch_size=4, report_to=[], disable_tqdm=True)
        return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=Tokens())

    trainer(2).train()
    ckpt = tmp_path / "out" / "checkpoint-2"
    control = tmp_path / "control"
    shutil.copytree(ckpt, control)
    round_trip(ckpt, ["optimizer.pt"], lambda: trainer(3).train(resume_from_checkpoint=str(ckpt)),
               r"b'ckptq: the optimizer state of checkpoint-2 is in optimizer\.q8\.safetensors.*CkptqTrainer.*"
               r"`ckptq expand checkpoint-2`")
    resumed = {}
    for name, folder in (("ckptq", ckpt), ("fp32", control)):
        t = trainer(3)
        t.train(resume_from_checkpoint=str(folder))
        assert t.state.global_step == 3
        resumed[name] = t.optimizer.state_dict()
    # step 3 means Trainer loaded the step-2 state from optimizer.pt (a missing file would restart Adam at 1)
    assert_close_states(resumed["ckptq"], resumed["fp32"])


def test_accelerate_save_state_with_two_optimizers_round_trip_and_load_state(tmp_path):
    accelerate = pytest.importorskip("accelerate")

    def setup():
        torch.manual_seed(0)
        models = [torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)]
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
        acc = accelerate.Accelerator(cpu=True)
        return acc, *acc.prepare(*models, *opts)

    acc, m1, m2, o1, o2 = setup()
    for _ in range(3):
        acc.backward(m2(m1(torch.randn(4, 64))).pow(2).mean())
        o1.step()
        o2.step()
        o1.zero_grad()
        o2.zero_grad()
    acc.save_state(str(tmp_path / "state"))
    want = [o1.state_dict(), o2.state_dict()]
    round_trip(tmp_path / "state", ["optimizer.bin", "optimizer_1.bin"],
               lambda: setup()[0].load_state(str(tmp_path / "state")),
               r"b'ckptq: the optimizer state of state is in optimizer\.q8\.safetensors.*`ckptq expand state --replace`")
    acc, m1b, m2b, o1b, o2b = setup()
    acc.load_state(str(tmp_path / "state"))
    assert torch.equal(m1b.weight, m1.weight)
    assert_close_states(o1b.state_dict(), want[0])
    assert_close_states(o2b.state_dict(), want[1])


def test_lightning_checkpoint_folder_round_trip_and_fit_resume(tmp_path):
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(64, 128)

        def training_step(self, batch, i):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 64)), batch_size=4)

    def fit(steps, ckpt=None):
        torch.manual_seed(0)
        trainer = L.Trainer(max_steps=steps, default_root_dir=str(tmp_path), accelerator="cpu", logger=False,
                            enable_progress_bar=False, enable_model_summary=False)
        module = Module()
        trainer.fit(module, data, ckpt_path=ckpt)
        return trainer

    fit(4)
    folder = tmp_path / "checkpoints"
    (name,) = os.listdir(folder)
    want = torch.load(folder / name, weights_only=True)["optimizer_states"][0]
    round_trip(folder, [name], lambda: fit(5, str(folder / name)),  # converted in place, under its own name
               rf"b'ckptq: the optimizer state in {name} is stored 8-bit.*CkptqCheckpointIO.*`ckptq expand {name} --replace`")
    assert_close_states(torch.load(folder / name, weights_only=True)["optimizer_states"][0], want)
    trainer = fit(5, str(folder / name))
    assert trainer.global_step == 5
    assert float(trainer.optimizers[0].state_dict()["state"][0]["step"]) == 5  # resumed from the step-4 state
