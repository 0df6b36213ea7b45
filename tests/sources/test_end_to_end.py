"""A real checkpoint from a tiny training loop: convert -> expand -> torch AdamW keeps training."""

import os

import torch

import ckptq
from tests.helpers.models import TinyLM, param_groups, train
from tests.format.test_format import assert_same


def test_convert_expand_restores_structure_and_training_continues(trained_ckpt, tmp_path):
    path, model, opt = trained_ckpt
    before = open(path, "rb").read()
    report = ckptq.convert(path)
    assert open(path, "rb").read() == before  # input untouched
    assert report.outputs == [str(tmp_path / "ckpt.q8.safetensors")] and report.quantized >= 4
    assert report.ratio > 1.3

    out = ckptq.expand(report.outputs[0], str(tmp_path / "back.pt")).output
    orig = torch.load(path, weights_only=True)
    back = torch.load(out, weights_only=True)
    # every exact tensor bit-identical, all structure the same, states dequantized to fp32
    dense = {k: v for k, v in orig.items() if k != "optimizer"}
    assert_same(dense, {k: v for k, v in back.items() if k != "optimizer"})
    assert orig["optimizer"]["param_groups"] == back["optimizer"]["param_groups"]
    assert back["model"]["wte.weight"].untyped_storage().data_ptr() == back["model"]["head.weight"].untyped_storage().data_ptr()
    for pid, st in orig["optimizer"]["state"].items():
        for k, v in st.items():
            w = back["optimizer"]["state"][pid][k]
            assert w.dtype == v.dtype and w.shape == v.shape
            if k == "step" or v.numel() < 4096:
                assert torch.equal(w, v)
            else:
                assert (w - v).norm() / v.norm() < 0.05  # 8-bit blockwise: a few % of the norm

    # training resumes from the expanded checkpoint with stock torch AdamW and the loss keeps falling
    resumed = TinyLM()
    resumed.load_state_dict(back["model"])
    opt2 = torch.optim.AdamW(param_groups(resumed), lr=1e-2, betas=(0.9, 0.95))
    opt2.load_state_dict(back["optimizer"])
    losses = train(resumed, opt2, 30, start=20)
    assert sum(losses[-5:]) < sum(losses[:5])
    assert os.path.getsize(report.outputs[0]) == report.output_bytes


def test_nonfinite_states_are_kept_exact(trained_ckpt, tmp_path):
    path, model, opt = trained_ckpt
    ck = torch.load(path, weights_only=True)
    ck["optimizer"]["state"][0]["exp_avg"][0, 0] = float("nan")
    bad = str(tmp_path / "nan.pt")
    torch.save(ck, bad)
    r = ckptq.convert(bad)
    assert r.kept_nonfinite == 1 and r.nonfinite_names == ["optimizer/state/0/exp_avg"]
    kept = ckptq.load(r.outputs[0])["optimizer"]["state"][0]["exp_avg"]
    assert isinstance(kept, torch.Tensor)  # exact, not quantized: NaN stays NaN, the rest bit-identical
    assert torch.allclose(kept, ck["optimizer"]["state"][0]["exp_avg"], rtol=0, atol=0, equal_nan=True)


def test_triton_backend_writes_the_same_bytes(trained_ckpt, tmp_path):
    """The Triton kernels (on a GPU, or through Triton's interpreter on the CPU) write the same file."""
    import pytest

    pytest.importorskip("triton")
    path, _, _ = trained_ckpt
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = ckptq.convert(path, str(tmp_path / "torch.safetensors"), backend="torch").outputs[0]
    b = ckptq.convert(path, str(tmp_path / "triton.safetensors"), backend="triton", device=device).outputs[0]
    assert open(a, "rb").read() == open(b, "rb").read()


def test_eps_zero_and_never_updated_rows_stay_finite(tmp_path):
    """With eps = 0, elements whose v is 0 (rows that never got a gradient) must not become NaN."""
    emb = torch.nn.Embedding(64, 128)
    opt = torch.optim.AdamW(emb.parameters(), lr=1e-3, eps=0.0)
    for _ in range(3):
        emb(torch.tensor([1, 2, 3])).sum().backward()  # rows other than 1..3 keep m = v = 0
        opt.step()
        opt.zero_grad()
    src = str(tmp_path / "eps0.pt")
    torch.save({"optimizer": opt.state_dict()}, src)
    dense = ckptq.load(ckptq.convert(src).outputs[0], dequantize=True)["optimizer"]["state"][0]
    assert torch.isfinite(dense["exp_avg"]).all() and torch.isfinite(dense["exp_avg_sq"]).all()
    assert (dense["exp_avg"][10] == 0).all() and (dense["exp_avg"][1] != 0).any()
