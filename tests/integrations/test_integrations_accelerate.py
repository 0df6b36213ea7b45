"""ckptq.integrations.accelerate with the real accelerate: a small MLP trains 8 steps, ``save_state`` at
step 4; a new accelerator, model and optimizer ``load_state`` it and continue as the uninterrupted run did
(the same losses with AdamW8bit and torchao's 8-bit and 4-bit AdamW, whose states are stored exactly;
within 8-bit storage's error with torch's AdamW). torchao's step runs eagerly here (see
tests/integrations/test_integrations_transformers.py)."""

from __future__ import annotations

import os

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

import ckptq  # noqa: E402
from ckptq.codec import quant  # noqa: E402
from ckptq import info  # noqa: E402
from ckptq.integrations.accelerate import low_bit_checkpoints  # noqa: E402
from ckptq.codec import signpost  # noqa: E402
from ckptq.codec.quant import count_qstates  # noqa: E402

STEPS, SAVE = 8, 4
from tests.helpers.integration_optimizers import EXACT, optimizer_class, qstate_widths  # noqa: E402


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 64, generator=g)
    return x, torch.sin(3 * x)


def run(optimizer: str, save: str | None = None, load: str | None = None, stop: int = STEPS,
        bits: int = 8) -> tuple[dict, list, object]:
    """Train to ``stop`` (from SAVE when ``load``), checkpoints at ``bits``; returns {step: loss}, each step's
    learning rate and the optimizer."""
    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = optimizer_class(optimizer)(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * (1 - s / (2 * STEPS)))
    model, opt, sched = accelerator.prepare(model, opt, sched)
    low_bit_checkpoints(opt, bits=bits)
    start = SAVE if load else 0
    if load:
        accelerator.load_state(load)
    losses, lrs = {}, []
    for step in range(start + 1, stop + 1):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        lrs.append(float(opt.param_groups[0]["lr"]))  # torchao keeps lr as a tensor, updated in place
        opt.step(), sched.step(), opt.zero_grad()
        losses[step] = loss.item()
        if step == SAVE and save:
            accelerator.save_state(save)
    return losses, lrs, opt


@pytest.mark.parametrize("optimizer", ["torch AdamW", *EXACT])
def test_accelerate_save_state_stores_8bit_and_resumes(tmp_path, optimizer, eager_torchao):
    before, lrs, live = run(optimizer, save=str(tmp_path / "ckpt"))
    stored = tmp_path / "ckpt" / "optimizer.bin"
    assert count_qstates(ckptq.load(str(stored))) == 4  # both Linear weights' exp_avg and exp_avg_sq
    assert info(str(stored)).low_bit() == 4  # what `ckptq info` reports
    expanded = ckptq.expand(str(stored), str(tmp_path / "fp32.pt")).output  # torch AdamW's fp32 state
    assert os.path.getsize(stored) < os.path.getsize(expanded) / 3

    after, resumed_lrs, opt = run(optimizer, load=str(tmp_path / "ckpt"))
    assert type(opt.optimizer) is type(live.optimizer)
    assert sorted(after) == list(range(SAVE + 1, STEPS + 1))
    assert resumed_lrs == pytest.approx(lrs[SAVE:], rel=1e-12)  # the scheduler resumed at step SAVE
    for step, loss in after.items():
        if optimizer in EXACT:
            assert loss == before[step]
        else:  # 8-bit storage of fp32 moments: measured gaps <= 1.3e-5 relative; with the moments lost
            assert loss == pytest.approx(before[step], rel=2e-4)  # (zeroed) 6e-3 at step 6, 3.5e-2 at step 8
    if optimizer.startswith("torchao"):  # torchao's own quantized state again, the codes it had saved
        saved = torch.load(stored, weights_only=True)[signpost.CARRIED]["state"][0]["exp_avg"]
        inner = run(optimizer, load=str(tmp_path / "ckpt"), stop=SAVE)[2].optimizer
        resumed = inner.state[inner.param_groups[0]["params"][0]]  # state_dict() would be 8-bit (hooks)
        assert type(resumed["exp_avg"]).__name__ == optimizer.split()[1].replace("AdamW", "OptimState")
        assert torch.equal(quant.dequantize_state(saved), resumed["exp_avg"].dequantize())


def test_plain_accelerate_stops_at_a_low_bit_folder_and_resumes_after_expand(tmp_path):
    """Without low_bit_checkpoints when loading, load_state stops with ckptq's message (it loaded the 8-bit
    dicts and failed at the first step with 'dict' object has no attribute 'lerp_'); after `ckptq expand ckpt
    --replace`, plain accelerate resumes."""
    before, _, _ = run("torch AdamW", save=str(tmp_path / "ckpt"))
    plain = accelerate.Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    plain.prepare(model, opt, sched)
    with pytest.raises(ValueError, match=r"b'ckptq: this optimizer state was saved low-bit by ckptq\.integrations"
                                         r"\.accelerate\.low_bit_checkpoints.*`ckptq expand DIR --replace`"):
        plain.load_state(str(tmp_path / "ckpt"))
    assert ckptq.expand(str(tmp_path / "ckpt"), replace=True).outputs == [str(tmp_path / "ckpt" / "optimizer.bin")]
    plain.load_state(str(tmp_path / "ckpt"))
    assert float(opt.state_dict()["state"][0]["step"]) == SAVE


def test_bits_4_stores_4bit_moments_and_resumes_at_either_width(tmp_path):
    """``low_bit_checkpoints(opt, bits=4)``: optimizer.bin holds 4-bit moments (a 6-bit ratio over a 2-bit
    second moment), under a fifth of the fp32 file; an optimizer set up for 8 bits loads it, within 4-bit
    storage's error (measured <= 4e-3 relative; moments lost: 6e-3 at step 6, 3.5e-2 at step 8)."""
    before, _, _ = run("torch AdamW", save=str(tmp_path / "ckpt"), bits=4)
    stored = tmp_path / "ckpt" / "optimizer.bin"
    assert qstate_widths(ckptq.load(str(stored))) == {6, 2}
    expanded = ckptq.expand(str(stored), str(tmp_path / "fp32.pt")).output
    assert os.path.getsize(stored) < os.path.getsize(expanded) / 5
    after, _, _ = run("torch AdamW", load=str(tmp_path / "ckpt"))
    for step, loss in after.items():
        assert loss == pytest.approx(before[step], rel=5e-3)
