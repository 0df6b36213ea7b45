"""ckptq's 8-bit state must preserve the Adam update at least as well as bitsandbytes, tensor by tensor.

Trains a tiny GPT for a few steps (tools/scripts/make_checkpoint.py), then measures with tools/bench/fidelity.py.
"""

import math

import pytest
import torch

from tests.helpers.tools import load_tool

pytest.importorskip("bitsandbytes")

FOLDER = {"make_checkpoint": "scripts", "fidelity": "bench"}


def _load_tool(name: str):
    return load_tool(FOLDER[name], name)


@pytest.fixture(scope="module")
def rows():
    make_checkpoint, fidelity = _load_tool("make_checkpoint"), _load_tool("fidelity")
    ckpt = make_checkpoint.train(steps=60, size="tiny", seed=1)
    opt = fidelity.find_optimizer_state(ckpt)
    return fidelity, fidelity.measure(opt), ckpt


def test_update_error_never_worse_than_bitsandbytes(rows):
    fidelity, measured, _ = rows
    assert len(measured) >= 5
    worse = [(r.param, r.u_ckptq, r.u_bnb) for r in measured if r.u_ckptq > r.u_bnb]
    assert not worse, f"ckptq's update error exceeds bitsandbytes' on (param, ckptq, bnb): {worse}"


def test_bytes_per_param_are_the_row_layouts(rows):
    """Two code bytes per parameter plus one fp32 scale per block of each row (docs/FORMAT.md: blocks never
    cross a row, so a row shorter than 256 has one short block): counted from the shapes, not the files;
    bitsandbytes' flat blocks of 256 are the floor, reached when rows are whole blocks."""
    fidelity, measured, _ = rows
    summary = fidelity.summarize(measured)
    numel = sum(r.numel for r in measured)
    scales = sum(2 * 4 * r.shape[0] * math.ceil(math.prod(r.shape[1:]) / 256) for r in measured)
    assert summary["bytes_per_param_ckptq"] == pytest.approx(2 + scales / numel, rel=1e-12)
    assert summary["bytes_per_param_bnb"] == pytest.approx(2 + sum(8 * math.ceil(r.numel / 256) for r in measured)
                                                           / numel, rel=1e-12)
    assert summary["bytes_per_param_ckptq"] >= summary["bytes_per_param_bnb"]


def test_adam_update_matches_torch_adamw():
    fidelity = _load_tool("fidelity")
    p = torch.nn.Parameter(torch.randn(300))
    opt = torch.optim.AdamW([p], lr=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for _ in range(3):
        p.grad = torch.randn(300)
        before = p.detach().clone()
        opt.step()
    st = opt.state[p]
    u = fidelity.adam_update(st["exp_avg"], st["exp_avg_sq"], float(st["step"]), (0.9, 0.95), 1e-8)
    torch.testing.assert_close((before - p.detach()).double(), u, rtol=1e-5, atol=1e-6)

