"""ckptq.integrations.lightning with the real Lightning: a small MLP trains 2 epochs of 4 steps with a
checkpoint per epoch through ``CkptqCheckpointIO``; a new Trainer resumes from the first and must continue as
the uninterrupted run did (the same losses with AdamW8bit and torchao's 8-bit and 4-bit AdamW, stored
exactly; within 8-bit storage's error with torch's AdamW). Stock Lightning given such a checkpoint stops
with ckptq's message before it restores anything. torchao's step runs eagerly here (see
tests/integrations/test_integrations_transformers.py)."""

from __future__ import annotations

import math
import os
import sys
import types

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

import ckptq  # noqa: E402
from ckptq.codec.quant import count_qstates, dequantize_state  # noqa: E402
from ckptq.codec import signpost  # noqa: E402
from ckptq.integrations.lightning import CkptqCheckpointIO  # noqa: E402
from ckptq import info  # noqa: E402
from ckptq.errors import UsageError  # noqa: E402

BATCHES = 4  # steps per epoch; 2 epochs
from tests.helpers.integration_optimizers import EXACT, optimizer_class, qstate_widths  # noqa: E402


class Net(L.LightningModule):
    def __init__(self, optimizer: str):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        self.optimizer, self.seen = optimizer, {}  # step -> (loss, learning rate)

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.seen[self.global_step + 1] = (loss.item(), float(self.optimizers().param_groups[0]["lr"]))
        return loss

    def configure_optimizers(self):
        opt = optimizer_class(self.optimizer)(self.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * (1 - s / 16))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data() -> torch.utils.data.DataLoader:
    x = torch.randn(16 * BATCHES, 64, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.sin(3 * x)), batch_size=16)


def fit(optimizer: str, out: str, ckpt_path: str | None = None, plugins: tuple = (CkptqCheckpointIO(),)) -> Net:
    net = Net(optimizer)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=list(plugins), default_root_dir=out,
                        callbacks=[L.callbacks.ModelCheckpoint(dirpath=out, save_top_k=-1, every_n_epochs=1)])
    trainer.fit(net, data(), ckpt_path=ckpt_path)
    return net


@pytest.mark.parametrize("optimizer", ["torch AdamW", *EXACT])
def test_lightning_ckpt_holds_8bit_state_and_resumes(tmp_path, optimizer, eager_torchao):
    first = fit(optimizer, str(tmp_path / "a"))
    ckpt = str(tmp_path / "a" / f"epoch=0-step={BATCHES}.ckpt")
    saved = torch.load(ckpt, weights_only=True)  # no torchao classes inside: no torchao needed to read it
    assert count_qstates(saved) == 4  # both Linear weights' exp_avg and exp_avg_sq
    if optimizer == "AdamW8bit":  # 8-bit already: left in optimizer_states, as stock Lightning keeps it
        assert signpost.LIGHTNING_STATES not in saved and not signpost.is_signpost(saved["optimizer_states"][0])
    else:  # stored by ckptq: a signpost in optimizer_states, the state beside it
        assert signpost.is_signpost(saved["optimizer_states"][0])
        assert count_qstates(saved[signpost.LIGHTNING_STATES][0]) == 4
    state = (saved.get(signpost.LIGHTNING_STATES) or saved["optimizer_states"])[0]["state"][0]
    if optimizer == "torchao AdamW4bit":  # torchao's codes as they were (block 128 here)
        assert state["exp_avg"]["bits"] == 4 and state["exp_avg"]["block_size"] == 128
    elif optimizer == "torch AdamW":  # ckptq's own 8-bit form of fp32 moments
        assert state["exp_avg"]["transform"] == "ratio" and state["exp_avg_sq"]["codes"].dtype == torch.uint8

    resumed = fit(optimizer, str(tmp_path / "b"), ckpt_path=ckpt)
    opt = resumed.trainer.optimizers[0]
    assert type(opt) is optimizer_class(optimizer)
    kinds = {type(v).__name__ for s in opt.state.values() for k, v in s.items() if k != "step"}
    assert kinds == {"torch AdamW": {"Tensor"}, "AdamW8bit": {"dict", "Tensor"}, "torchao AdamW8bit": {"OptimState8bit", "Tensor"},
                     "torchao AdamW4bit": {"OptimState4bit", "Tensor"}}[optimizer]
    check_continues(first.seen, resumed.seen, rel=0.0 if optimizer in EXACT else 2e-4)


def check_continues(before: dict, after: dict, rel: float | None) -> None:
    """``after`` ran steps BATCHES+1.. with ``before``'s learning rates and losses within ``rel`` (None: any
    finite loss, another optimizer resumed). 8-bit storage of fp32 moments: measured gaps <= 1e-5 relative;
    a resume whose moments were lost (zeroed) is 0.19 apart at step 6."""
    assert sorted(after) == list(range(BATCHES + 1, 2 * BATCHES + 1))
    for step, (loss, lr) in after.items():
        assert lr == pytest.approx(before[step][1], rel=1e-12)  # the scheduler resumed at step BATCHES
        assert loss == pytest.approx(before[step][0], rel=rel) if rel is not None else math.isfinite(loss)


def test_stock_lightning_stops_before_restoring_a_ckptq_checkpoint(tmp_path):
    fit("torch AdamW", str(tmp_path / "a"))
    ckpt = str(tmp_path / "a" / f"epoch=0-step={BATCHES}.ckpt")
    with pytest.raises(ValueError, match=r"could not convert string to float: b'ckptq: the state of optimizer 0 is "
                                         r"stored under ckptq_optimizer_states in epoch=0-step=4\.ckpt.*CkptqCheckpointIO.*"
                                         r"`ckptq expand epoch=0-step=4\.ckpt -o OUT\.ckpt`"):
        fit("torch AdamW", str(tmp_path / "b"), ckpt_path=ckpt, plugins=())


@pytest.mark.parametrize("optimizer", ["torch AdamW", "AdamW8bit"])
def test_stock_lightning_resumes_after_ckptq_expand(tmp_path, optimizer):
    """The way back to Lightning's default TorchCheckpointIO, and from AdamW8bit to torch's AdamW."""
    first = fit(optimizer, str(tmp_path / "a"))
    ckpt = str(tmp_path / "a" / f"epoch=0-step={BATCHES}.ckpt")
    assert info(ckpt).low_bit() == 4  # `ckptq info` describes the stored states
    expanded = ckptq.expand(ckpt, str(tmp_path / "fp32.ckpt")).output  # Lightning's own file, fp32 moments
    # weights 4 bytes per parameter, moments 2 instead of 8: half the fp32 checkpoint
    assert os.path.getsize(ckpt) < 0.55 * os.path.getsize(expanded)
    stock = fit("torch AdamW", str(tmp_path / "c"), ckpt_path=expanded, plugins=())
    check_continues(first.seen, stock.seen, rel=2e-4 if optimizer == "torch AdamW" else None)


def test_checkpoints_of_ckptq_0_1_still_resume(tmp_path):
    """Files written before the signposts: 8-bit states in optimizer_states, those to decode listed."""
    first = fit("torch AdamW", str(tmp_path / "a"))
    ckpt = tmp_path / "a" / f"epoch=0-step={BATCHES}.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    saved["optimizer_states"] = saved.pop(signpost.LIGHTNING_STATES)
    saved["ckptq_fp32_optimizer_states"] = [0]
    saved.pop(signpost.LIGHTNING_TORCHAO)
    torch.save(saved, ckpt)
    resumed = fit("torch AdamW", str(tmp_path / "b"), ckpt_path=str(ckpt))
    check_continues(first.seen, resumed.seen, rel=2e-4)


def test_torchao_state_round_trips_through_the_ckpt_exactly(tmp_path, eager_torchao):
    first = fit("torchao AdamW8bit", str(tmp_path / "a"))
    live = first.trainer.optimizers[0].state[first.net[0].weight]
    ckpt = str(tmp_path / "a" / f"epoch=1-step={2 * BATCHES}.ckpt")
    stored = torch.load(ckpt, weights_only=True)[signpost.LIGHTNING_STATES][0]["state"][0]
    assert torch.equal(stored["exp_avg"]["codes"].view(live["exp_avg"].codes.shape), live["exp_avg"].codes)
    restored = CkptqCheckpointIO().load_checkpoint(ckpt)["optimizer_states"][0]["state"][0]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(restored[key].codes, live[key].codes) and torch.equal(restored[key].scale, live[key].scale)
        assert torch.equal(dequantize_state(stored[key]), live[key].dequantize())


def fabric_run(out: str, save: bool = False, load: bool = False, plugins: tuple = (CkptqCheckpointIO(),),
               made=None) -> dict:
    """Fabric (what litgpt runs on), made as litgpt makes it (``lightning.Fabric(...)``, then ``made(fabric)``
    where given): 8 steps of the MLP, ``fabric.save`` of {"model", "optimizer", "step"} at step 4 or
    ``fabric.load`` of it; {step: loss}."""
    import lightning

    fabric = lightning.Fabric(accelerator="cpu", devices=1, plugins=list(plugins) or None)
    if made is not None:
        made(fabric)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = fabric.setup(model, opt)
    state, path, losses = {"model": model, "optimizer": opt, "step": 0}, os.path.join(out, "fabric.ckpt"), {}
    if load:
        fabric.load(path, state)
    for step in range(state["step"] + 1, 2 * BATCHES + 1):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.mse_loss(model(x), torch.sin(3 * x))
        fabric.backward(loss)
        opt.step(), opt.zero_grad()
        losses[step], state["step"] = loss.item(), step
        if step == BATCHES and save:
            fabric.save(path, state)
    return losses


@pytest.mark.parametrize("bits", [8, 4])
def test_fabric_saves_low_bit_state_through_the_plugin_and_resumes(tmp_path, bits):
    """``lightning.fabric.Fabric(plugins=[CkptqCheckpointIO(bits=...)])``: Fabric keeps the optimizer under its own
    key ("optimizer"), stored as a signpost carrying the low-bit state; the plugin (at its default 8 bits)
    resumes either width, within storage's error (8 bits: measured <= 5e-5 relative; 4 bits <= 6e-3, where
    losing the moments moves this MLP's loss by 0.19), stock Fabric stops at the signpost with ckptq's message."""
    first = fabric_run(str(tmp_path), save=True, plugins=(CkptqCheckpointIO(bits=bits),))
    saved = torch.load(tmp_path / "fabric.ckpt", weights_only=True)
    assert signpost.carries(saved["optimizer"]) and count_qstates(saved["optimizer"]) == 4
    assert qstate_widths(saved["optimizer"]) == ({8} if bits == 8 else {6, 2})
    rel = 2e-4 if bits == 8 else 1e-2
    resumed = fabric_run(str(tmp_path), load=True)
    assert sorted(resumed) == list(range(BATCHES + 1, 2 * BATCHES + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(first[step], rel=rel)
    with pytest.raises(ValueError, match=rf"b'ckptq: the optimizer state under optimizer in fabric\.ckpt is stored "
                                         rf"{bits}-bit.*CkptqCheckpointIO.*`ckptq expand fabric\.ckpt --replace`"):
        fabric_run(str(tmp_path), load=True, plugins=())
    r = ckptq.expand(str(tmp_path / "fabric.ckpt"), replace=True)  # back in place: stock Fabric resumes it
    assert r.outputs == [str(tmp_path / "fabric.ckpt")] and not signpost.carries(
        torch.load(tmp_path / "fabric.ckpt", weights_only=True)["optimizer"])
    for step, loss in fabric_run(str(tmp_path), load=True, plugins=()).items():
        assert loss == pytest.approx(first[step], rel=rel)


def test_lightning_bits_4_stores_4bit_state_and_resumes_at_either_width(tmp_path):
    """``lightning.Trainer(plugins=[CkptqCheckpointIO(bits=4)])``: the .ckpt holds 4-bit moments (a 6-bit ratio
    over a 2-bit second moment); the plugin at 8 bits resumes it, within 4-bit storage's error (measured
    <= 1.5e-2 relative; moments lost: 0.19 at step 6). A width other than 8 or 4 stops at once."""
    first = fit("torch AdamW", str(tmp_path / "a"), plugins=(CkptqCheckpointIO(bits=4),))
    ckpt = str(tmp_path / "a" / f"epoch=0-step={BATCHES}.ckpt")
    assert qstate_widths(torch.load(ckpt, weights_only=True)[signpost.LIGHTNING_STATES]) == {6, 2}
    resumed = fit("torch AdamW", str(tmp_path / "b"), ckpt_path=ckpt)
    check_continues(first.seen, resumed.seen, rel=3e-2)
    with pytest.raises(UsageError, match="6-bit state is not supported"):
        CkptqCheckpointIO(bits=6)


def test_low_bit_checkpoints_gives_a_fabric_already_made_the_plugin_and_that_fabric_only(tmp_path):
    """``low_bit_checkpoints(fabric, bits=4)`` on a Fabric made without plugins (as a library makes it): its
    ``fabric.save`` writes 4-bit state and a plain Fabric given the plugin resumes it; a Fabric made next is
    stock; Fabric's class is untouched. Refused in one line: a strategy that writes its own files (FSDP), a
    CheckpointIO of the user's own; a second call returns the plugin it gave."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.fabric.strategies import FSDPStrategy

    from ckptq.integrations.lightning import low_bit_checkpoints

    init, given = Fabric.__init__, []
    first = fabric_run(str(tmp_path), save=True, plugins=(),
                       made=lambda fabric: given.append(low_bit_checkpoints(fabric, bits=4)))
    assert given[0].bits == 4 and Fabric.__init__ is init
    assert qstate_widths(torch.load(tmp_path / "fabric.ckpt", weights_only=True)["optimizer"]) == {6, 2}
    resumed = fabric_run(str(tmp_path), load=True)
    for step, loss in resumed.items():
        assert loss == pytest.approx(first[step], rel=1e-2)
    plain = Fabric(accelerator="cpu", devices=1)
    assert type(plain.strategy.checkpoint_io) is TorchCheckpointIO
    plugin = low_bit_checkpoints(plain)
    assert low_bit_checkpoints(plain) is plugin and plain.strategy.checkpoint_io is plugin
    with pytest.raises(UsageError, match=r"FSDPStrategy\) writes its own checkpoint files.*ckptq convert"):
        low_bit_checkpoints(types.SimpleNamespace(strategy=FSDPStrategy()))  # FSDP's Fabric needs a GPU

    class Mine(TorchCheckpointIO):
        pass

    with pytest.raises(UsageError, match=r"already saves through Mine.*Keep one"):
        low_bit_checkpoints(Fabric(accelerator="cpu", devices=1, plugins=[Mine()]))


def test_litgpt_launcher_gives_litgpt_fabric_the_plugin_only_while_litgpt_runs(tmp_path, monkeypatch):
    """``python -m ckptq.integrations.litgpt --bits 4 ...``: the Fabric that litgpt's command builds
    (``L.Fabric(...)``, no plugins) saves 4-bit state, and the next command resumes it; litgpt sees its own
    arguments; ``lightning.Fabric`` is a subclass while litgpt runs and Fabric again after, and Fabric's own
    class is never changed. A sharded strategy takes no CheckpointIO (``takes_checkpoint_io``). (The real litgpt, not
    installed here: tools/scripts/make_framework_fixtures.py litgpt-resume.)"""
    import lightning
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.fabric.strategies import FSDPStrategy

    from ckptq.integrations import litgpt
    from ckptq.integrations.lightning import takes_checkpoint_io

    seen = {}

    def litgpt_main():  # what a litgpt command does: builds its Fabric (no plugins), saves or resumes
        seen[sys.argv[1]] = list(sys.argv), lightning.Fabric is not Fabric and issubclass(lightning.Fabric, Fabric)
        seen[sys.argv[1] + " losses"] = fabric_run(str(tmp_path), save=sys.argv[1] == "pretrain",
                                                   load=sys.argv[1] == "resume", plugins=())

    fake = types.ModuleType("litgpt.__main__")
    fake.main = litgpt_main
    monkeypatch.setitem(sys.modules, "litgpt", types.ModuleType("litgpt"))
    monkeypatch.setitem(sys.modules, "litgpt.__main__", fake)
    init = Fabric.__init__
    litgpt.main(["--bits", "4", "pretrain", "--out_dir", "out"])
    assert lightning.Fabric is Fabric and Fabric.__init__ is init
    assert seen["pretrain"] == (["litgpt", "pretrain", "--out_dir", "out"], True)
    assert qstate_widths(torch.load(tmp_path / "fabric.ckpt", weights_only=True)["optimizer"]) == {6, 2}
    litgpt.main(["resume"])
    for step, loss in seen["resume losses"].items():
        assert loss == pytest.approx(seen["pretrain losses"][step], rel=1e-2)
    assert type(Fabric(accelerator="cpu", devices=1).strategy.checkpoint_io) is TorchCheckpointIO
    assert takes_checkpoint_io("auto") and takes_checkpoint_io("ddp")
    assert not takes_checkpoint_io("fsdp") and not takes_checkpoint_io(FSDPStrategy())
    assert not takes_checkpoint_io("deepspeed")


def test_last_ckpt_converted_in_place_stops_stock_lightning_and_resumes_with_the_plugin(tmp_path):
    """`ckptq convert last.ckpt --replace` keeps the name `fit(ckpt_path="last")` looks for (it found none
    and trained from step 0): stock Lightning stops with ckptq's message, the plugin resumes the same run."""
    first = fit("torch AdamW", str(tmp_path / "a"), plugins=())
    last = str(tmp_path / "a" / f"epoch=0-step={BATCHES}.ckpt")
    r = ckptq.convert(last, replace=True)
    assert r.outputs == [last] and r.removed == [last] and os.path.exists(last)
    with pytest.raises(ValueError, match=rf"b'ckptq: the optimizer state in epoch=0-step={BATCHES}\.ckpt is stored "
                                         r"8-bit.*CkptqCheckpointIO.*`ckptq expand"):
        fit("torch AdamW", str(tmp_path / "b"), ckpt_path=last, plugins=())
    resumed = fit("torch AdamW", str(tmp_path / "c"), ckpt_path=last)
    check_continues(first.seen, resumed.seen, rel=2e-4)
