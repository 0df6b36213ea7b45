"""RMSprop8bit, Adagrad8bit, NAdam8bit, RAdam8bit and AdEMAMix8bit (and their 4-bit variants), the optimizers
built on the one engine from their rule alone, where they differ from the other families: centered RMSprop's
refusal of 4 bits, a converted checkpoint of the counterpart resumed as stored, bitsandbytes' states (8-bit
RMSprop and Adagrad, AdEMAMix's stacked EMAs) loaded and converted. What every family shares (fp32 tracking,
low-bit training, resume bit for bit, the counterpart's state and back): tests/optim/test_families.py."""

import pytest
import torch

import ckptq
from ckptq.errors import ArgumentError
from ckptq.optim import AdEMAMix8bit, Adagrad8bit, RMSprop4bit, RMSprop8bit, to_torch_state_dict
from tests.helpers.least_squares import train
from tests.optim.test_families import PAIRS


def test_centered_rmsprop_refuses_4_bits():
    with pytest.raises(ArgumentError, match="centered=True needs 8-bit state"):
        RMSprop4bit([torch.nn.Parameter(torch.randn(64, 96))], centered=True)


@pytest.mark.parametrize("name", ["rmsprop-heavy-centered-wd", "adagrad", "nadam", "radam"])
def test_a_converted_checkpoint_of_the_counterpart_resumes_as_stored(name, tmp_path):
    """torch's optimizer trained, its checkpoint converted by ``ckptq convert``: the 8-bit class loads
    the converted state as stored (every code and scale the file's) and steps on."""
    ref, ours, kw = PAIRS[name]
    w, _, torch_opt = train(lambda ps: ref(ps, **kw), steps=10)
    torch.save({"model": {"w": w}, "optimizer": torch_opt.state_dict()}, tmp_path / "ckpt.pt")
    ckptq.convert(str(tmp_path / "ckpt.pt"), min_size=1024)
    stored = ckptq.load(str(tmp_path / "ckpt.q8.safetensors"))["optimizer"]
    p = torch.nn.Parameter(w.clone())
    opt = ours([p], **kw)
    opt.load_state_dict(stored)
    for s in opt._declared(opt.param_groups[0]):
        q = opt.state[p][s.key]
        assert isinstance(q, dict) and torch.equal(q["codes"], stored["state"][0][s.key]["codes"]), s.key
    train(None, steps=3, w=p, opt=opt)
    assert torch.isfinite(p).all()


def _bnb_trained(cls_name: str, steps: int = 3, **kw):
    bnb = pytest.importorskip("bitsandbytes")
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 300, generator=gen))
    opt = getattr(bnb.optim, cls_name)([w], lr=1e-3, **kw)
    for _ in range(steps):
        w.grad = torch.randn(w.shape, generator=gen)
        opt.step()
    return w, opt


@pytest.mark.parametrize("cls_name,ours", [("AdEMAMix", AdEMAMix8bit), ("AdEMAMix8bit", AdEMAMix8bit),
                                           ("RMSprop8bit", RMSprop8bit), ("Adagrad8bit", Adagrad8bit)])
def test_bitsandbytes_state_loads_as_its_fp32_values(cls_name, ours):
    """bitsandbytes' own state dicts load as they are: decoded (its 8-bit codes, or AdEMAMix's [2, ...] stacked
    EMAs, each half with its own scales), then quantized as ckptq's. Against the same run's fp32 states
    (bitsandbytes' 32-bit class on the same gradients) within the two codecs' error."""
    w, opt = _bnb_trained(cls_name)
    base = cls_name.removesuffix("8bit")
    _, fp32 = _bnb_trained(base, optim_bits=32) if base != cls_name else (w, opt)
    q = fp32.state_dict()["state"][0]
    q = q.get("__bnb_optimizer_quant_state__", q)
    if base == "AdEMAMix":
        want = {"exp_avg": q["state1"][0], "exp_avg_slow": q["state1"][1], "exp_avg_sq": q["state2"]}
    else:
        want = {{"RMSprop": "square_avg", "Adagrad": "sum"}[base]: q["state1"]}
    mine = ours([torch.nn.Parameter(w.detach().clone())], lr=1e-3)
    mine.load_state_dict(opt.state_dict())
    got = to_torch_state_dict(mine.state_dict())["state"][0]
    for key, ref in want.items():
        assert ((got[key] - ref).norm() / ref.norm()).item() < (0.01 if base == cls_name else 0.05), key


def test_a_converted_bitsandbytes_ademamix_checkpoint_resumes_as_stored(tmp_path):
    """``ckptq convert`` stores bitsandbytes' 32-bit AdEMAMix state by role (two signed EMAs, a second moment as
    sqrt), and AdEMAMix8bit resumes the file as stored."""
    w, opt = _bnb_trained("AdEMAMix")
    torch.save({"model": {"w": w.detach()}, "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    ckptq.convert(str(tmp_path / "ckpt.pt"))
    stored = ckptq.load(str(tmp_path / "ckpt.q8.safetensors"))["optimizer"]
    assert {k for k, v in stored["state"][0].items() if isinstance(v, dict)} == {"exp_avg", "exp_avg_slow", "exp_avg_sq"}
    p = torch.nn.Parameter(w.detach().clone())
    mine = AdEMAMix8bit([p], lr=1e-3)
    mine.load_state_dict(stored)
    for key in ("exp_avg", "exp_avg_slow", "exp_avg_sq"):
        assert torch.equal(mine.state[p][key]["codes"], stored["state"][0][key]["codes"]), key
