"""Beyond Adam: each optimizer's state read by role (ckptq.codec.roles), trained a few steps with the real
class, converted at 8 and 4 bits, and expanded back into a state dict that the same class loads and steps
from; info names the optimizer it recognised and what it kept exact."""

import json
import warnings

import pytest
import torch
from click.testing import CliRunner

import ckptq
from ckptq.cli import main
from ckptq.codec import qstate


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _lion(params):
    return pytest.importorskip("lion_pytorch").Lion(params, lr=1e-4)


def _adafactor(params):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=1e-3, beta1=0.9, relative_step=False, scale_parameter=False, warmup_init=False)


# name -> (the optimizer on a list of params, its name in info, the keys stored low-bit, the keys kept exact)
OPTIMIZERS = {
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), "torch.optim.SGD",
            {"momentum_buffer"}, set()),
    "muon": (lambda ps: torch.optim.Muon([p for p in ps if p.ndim == 2], lr=0.02), "torch.optim.Muon",
             {"momentum_buffer"}, set()),
    "rmsprop": (lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9, centered=True), "torch.optim.RMSprop",
                {"square_avg", "momentum_buffer", "grad_avg"}, {"step"}),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=0.01), "torch.optim.Adagrad", {"sum"}, {"step"}),
    "adamax": (lambda ps: torch.optim.Adamax(ps), "torch.optim.Adamax", {"exp_avg", "exp_inf"}, {"step"}),
    "nadam": (lambda ps: torch.optim.NAdam(ps), "torch.optim.NAdam", {"exp_avg", "exp_avg_sq"},
              {"step", "mu_product"}),
    "radam": (lambda ps: torch.optim.RAdam(ps), "torch.optim.RAdam", {"exp_avg", "exp_avg_sq"}, {"step"}),
    "lion": (_lion, "Lion", {"exp_avg"}, set()),
    "adafactor": (_adafactor, "transformers Adafactor", {"exp_avg"}, {"step", "exp_avg_sq_row", "exp_avg_sq_col", "RMS"}),
    "torch_adafactor": (lambda ps: torch.optim.Adafactor(ps, lr=1e-2), "torch.optim.Adafactor", set(),
                        {"step", "row_var", "col_var"}),
}


def _train(make, shape=(96, 64), steps=3, seed=0):
    """A matrix and a small bias trained ``steps`` steps by ``make``'s optimizer on a fixed quadratic."""
    torch.manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(shape)), torch.nn.Parameter(torch.randn(shape[0]))]
    opt = make(ps)
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g) + 0.1 * p.detach()
        opt.step()
    return ps, opt


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _seen(sd, key, bits):
    """What the step sees of a state: itself, but for Adam's pair, stored as the ratio m / (sqrt(v) + eps')
    over sqrt(v) so that v's error cancels out of the update: the update direction m / (sqrt(v) + eps)."""
    st = sd["state"][0]
    if key in ("exp_avg", "exp_avg_sq") and "exp_avg_sq" in st:
        return st["exp_avg"] / (st["exp_avg_sq"].sqrt() + 1e-8)
    return st[key]


def _step_from(make, ps, sd):
    """A fresh optimizer of the class on copies of ``ps`` loads ``sd`` and steps; the new parameters."""
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt = make(qs)
    opt.load_state_dict(sd)
    for q in qs:
        q.grad = torch.ones_like(q)
    opt.step()
    assert all(bool(q.isfinite().all()) for q in qs)
    return qs


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizer_converts_by_role_and_expands_into_its_own_class(tmp_path, name):
    make, words, low, exact = OPTIMIZERS[name]
    ps, opt = _train(make)
    sd = opt.state_dict()
    src = tmp_path / "ckpt.pt"
    torch.save({"optimizer": sd}, src)
    info = json.loads(run("info", src, "--json").output)
    assert words in info["details"]["recognised"]
    assert {r["role"] for r in info["would_store"]} == low
    if not low:  # factored statistics only: nothing to store low-bit, said as such
        r = run("convert", src)
        assert r.exit_code == 3 and "can be stored low-bit" in r.output and "row_var factored" in r.output
        return
    for bits, bound in ((8, 0.02), (4, 0.2)):
        out = tmp_path / f"ckpt.q{bits}.safetensors"
        ckptq.convert(str(src), str(out), bits=bits)
        held = ckptq.load(str(out))["optimizer"]["state"][0]
        assert {k for k, v in held.items() if qstate.is_qstate(v)} == low
        assert exact <= {k for k, v in held.items() if not qstate.is_qstate(v)}
        assert run("expand", out, "-o", tmp_path / f"fp32.{bits}.pt").exit_code == 0
        back = torch.load(tmp_path / f"fp32.{bits}.pt", weights_only=True)["optimizer"]
        for key in low:  # each moment within its width's error, and the class steps from them
            assert _rel(_seen(back, key, bits), _seen(sd, key, bits)) < bound, (key, bits)
        for key in exact:
            assert torch.equal(torch.as_tensor(back["state"][0][key]), torch.as_tensor(sd["state"][0][key]))
        _step_from(make, ps, back)
    # --replace reads every state back against what convert meant to store, by its role's codebook (SGD's
    # momentum, Lion's exp_avg, RMSprop's square_avg... failed it, read back under Adam's key policies)
    again = tmp_path / "again.pt"
    torch.save({"optimizer": sd}, again)
    report = ckptq.convert(str(again), replace=True)
    assert not again.exists() and ckptq.load(report.outputs[0])["optimizer"]["state"][0].keys() == sd["state"][0].keys()


def test_muon_with_adamw_side_by_side_converts_each(tmp_path):
    """A hybrid run's two optimizers, as a list and as a dict by name: both halves are stored 8-bit."""
    torch.manual_seed(0)
    hidden, emb = torch.nn.Parameter(torch.randn(96, 64)), torch.nn.Parameter(torch.randn(128, 64))
    muon, adamw = torch.optim.Muon([hidden], lr=0.02), torch.optim.AdamW([emb], lr=1e-3)
    for _ in range(3):
        hidden.grad, emb.grad = torch.randn_like(hidden), torch.randn_like(emb)
        muon.step()
        adamw.step()
    for layout in ([muon.state_dict(), adamw.state_dict()], {"muon": muon.state_dict(), "adamw": adamw.state_dict()}):
        src, out = tmp_path / "hybrid.pt", tmp_path / "hybrid.q8.safetensors"
        torch.save({"optimizer": layout}, src)
        report = ckptq.convert(str(src), str(out), force=True)
        assert report.optimizers == 2 and report.quantized == 3
        info = ckptq.info(str(src)).details["recognised"]
        assert "torch.optim.Muon" in info and "torch.optim.AdamW" in info
        ckptq.expand(str(out), str(tmp_path / "back.pt"), force=True)
        back = torch.load(tmp_path / "back.pt", weights_only=True)["optimizer"]
        halves = back if isinstance(back, list) else [back["muon"], back["adamw"]]
        _step_from(lambda ps: torch.optim.Muon(ps, lr=0.02), [hidden], halves[0])
        _step_from(lambda ps: torch.optim.AdamW(ps, lr=1e-3), [emb], halves[1])


def test_centered_rmsprop_keeps_its_pair_exact_where_rounding_would_make_its_variance_negative(tmp_path):
    """A gradient that hardly varies leaves square_avg - grad_avg^2 far below either's rounding: stored
    8-bit it would turn negative and RMSprop's step NaN, so both stay exact (a warning says why); the
    momentum buffer is still stored 8-bit."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(96, 64))
    opt = torch.optim.RMSprop([p], lr=1e-3, alpha=0.5, momentum=0.9, centered=True)
    base = torch.randn_like(p)
    for _ in range(30):  # grad_avg^2 reaches all but ~1e-4 of square_avg
        p.grad = base + 1e-2 * torch.randn_like(p)
        opt.step()
    src = tmp_path / "ckpt.pt"
    torch.save({"optimizer": opt.state_dict()}, src)
    report = ckptq.convert(str(src), str(tmp_path / "o.q8.safetensors"))
    held = ckptq.load(str(tmp_path / "o.q8.safetensors"))["optimizer"]["state"][0]
    assert qstate.is_qstate(held["momentum_buffer"])
    assert torch.equal(held["square_avg"], opt.state_dict()["state"][0]["square_avg"])
    assert torch.equal(held["grad_avg"], opt.state_dict()["state"][0]["grad_avg"])
    assert any("centered RMSprop" in w and "square_avg" in w for w in report.warnings)


def test_heavyball_state_is_refused_in_one_line(tmp_path):
    heavyball = pytest.importorskip("heavyball")
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(96, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = heavyball.AdamW([p], lr=1e-3)
        for _ in range(2):
            p.grad = torch.randn_like(p)
            opt.step()
    src = tmp_path / "hb.pt"
    torch.save({"optimizer": opt.state_dict()}, src)
    for cmd in ("info", "convert"):
        r = run(cmd, src)
        assert r.exit_code == 3 and "heavyball" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hb.pt"]


BNB_ONE_STATE = {  # bitsandbytes class, its arguments, the torch state key and the class that resumes it
    "Lion8bit": ({"lr": 1e-4}, "exp_avg", _lion),
    "PagedLion8bit": ({"lr": 1e-4}, "exp_avg", _lion),
    "Lion32bit": ({"lr": 1e-4}, "exp_avg", _lion),
    "SGD8bit": ({"lr": 0.1, "momentum": 0.9}, "momentum_buffer", lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "RMSprop8bit": ({"lr": 1e-3}, "square_avg", lambda ps: torch.optim.RMSprop(ps, lr=1e-3)),
    "Adagrad8bit": ({"lr": 0.01}, "sum", lambda ps: torch.optim.Adagrad(ps, lr=0.01)),
}


@pytest.mark.parametrize("cls", sorted(BNB_ONE_STATE))
def test_bitsandbytes_one_state_optimizers_read_into_their_torch_counterparts(tmp_path, cls):
    """state1 alone (no state2): info and convert read it (they refused it as damaged), expand gives the
    values bitsandbytes decodes to under the torch counterpart's key, and that class loads and steps."""
    bnb = pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as F

    kwargs, key, counterpart = BNB_ONE_STATE[cls]
    ps, opt = _train(lambda ps: getattr(bnb.optim, cls)(ps, **kwargs))
    sd = opt.state_dict()
    q = sd["state"][0]["__bnb_optimizer_quant_state__"]
    want = q["state1"] if q["state1"].dtype == torch.float32 else \
        F.dequantize_blockwise(q["state1"], absmax=q["absmax1"], code=q["qmap1"], blocksize=256)
    src = tmp_path / "optimizer.pt"
    torch.save(sd, src)
    info = json.loads(run("info", src, "--json").output)
    assert info["details"]["foreign_8bit_params"] == 2 and [r["role"] for r in info["would_store"]] == [key]
    assert run("expand", src, "-o", tmp_path / "fp32.pt").exit_code == 0
    back = torch.load(tmp_path / "fp32.pt", weights_only=True)
    assert torch.equal(back["state"][0][key], want) and "__bnb_optimizer_quant_state__" not in back["state"][0]
    _step_from(counterpart, ps, back)
    report = ckptq.convert(str(src), str(tmp_path / "o.q8.safetensors"))
    assert report.foreign_states == 2 and report.quantized == 1
    dense = ckptq.load(str(tmp_path / "o.q8.safetensors"), dequantize=True)["state"][0][key]
    assert _rel(dense, want) < 0.01


def test_the_input_width_caps_the_default_budget(eager_torchao):
    """The planner's hook for "without --bits, never write a wider state than the input's": torchao's
    AdamW4bit state caps the default at 4 bits, 8-bit state (torchao's, bitsandbytes') and fp32 leave 8."""
    from ckptq.codec import plan

    ao = pytest.importorskip("torchao.optim")
    bnb = pytest.importorskip("bitsandbytes")
    for make, budget in ((ao.AdamW4bit, 4), (ao.AdamW8bit, 8), (bnb.optim.AdamW8bit, 8), (torch.optim.AdamW, None)):
        _, opt = _train(lambda ps: make(ps, lr=1e-3), shape=(128, 64))
        obj = {"optimizer": opt.state_dict()}
        assert plan.input_budget(obj) == budget, make
        assert plan.default_budget(obj) == (budget or 8)
    from ckptq.codec import quant

    _, opt = _train(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    sd = opt.state_dict()  # ckptq's own 4-bit state, as a resumed run saves it
    sd["state"][0]["momentum_buffer"] = quant.quantize_state(sd["state"][0]["momentum_buffer"], "momentum_buffer",
                                                             128, bits=4, role="first")
    assert plan.input_budget({"optimizer": sd}) == 4
