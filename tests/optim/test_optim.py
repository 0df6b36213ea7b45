"""ckptq.optim against torch.optim on the CPU (default path: the C kernel where it builds; tests/kernels/test_step*.py
check that kernel against the PyTorch reference bit for bit).

Bounds asserted:
- one step from identical (dequantized) state: parameters within 2 ulp of torch's (fp32 rounding: op
  order, and torch.sqrt on AVX512 CPUs is not correctly rounded, ours is); new moments requantize
  to torch's new fp32 moments' codes within 1 code (an ulp can cross one threshold), block scales
  within 1e-6 relative; small fp32 states within 4 ulp (torch uses lerp).
- 100 steps on a small model (lr 1e-3): max |p - p_torch| <= 1.0e-3 (measured 7.4e-4 with exp_avg
  stored as a ratio to exp_avg_sq, 1.14e-3 before it, while the parameters moved up to 4.6e-2).
"""

import io

import pytest
import torch

from ckptq.codec import policy, qstate, quant
from ckptq.errors import StateMismatchError, UsageError
from ckptq.optim import Adam8bit, AdamW8bit

MIN = 256  # min_size for tests: tensors of >= 256 elements get 8-bit state


def _params(shapes=((40, 30), (7,)), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _dense_state(pstate: dict) -> dict:
    """torch's fp32 state for one param from ours (ratio exp_avg decoded through exp_avg_sq)."""
    return {k: v.clone() for k, v in quant.dequantize_states(pstate).items()}


def _expected_qstate(key, ref_state, block_size, eps, beta2):
    """The qstate ckptq convert writes for torch's new fp32 state ``ref_state``."""
    if key == "exp_avg":
        step = float(ref_state["step"])
        eps = policy.ratio_eps(eps, beta2, step)
        return quant.quantize_ratio(ref_state["exp_avg"], ref_state["exp_avg_sq"], eps, block_size)
    return quant.quantize_state(ref_state[key], key, block_size)


PAIRS = [
    (AdamW8bit, torch.optim.AdamW, dict(weight_decay=0.1)),
    (Adam8bit, torch.optim.Adam, dict(weight_decay=0.1)),
    (AdamW8bit, torch.optim.AdamW, dict(amsgrad=True)),
    (AdamW8bit, torch.optim.AdamW, dict(maximize=True)),
    (Adam8bit, torch.optim.Adam, dict(amsgrad=True, maximize=True, weight_decay=0.05)),
]


@pytest.mark.parametrize("ours_cls,torch_cls,kw", PAIRS)
def test_one_step_matches_torch_on_dequantized_state(ours_cls, torch_cls, kw):
    ours_p, ref_p = _params(), _params()
    ours = ours_cls(ours_p, lr=1e-2, min_size=MIN, **kw)
    for seed in range(3):  # build some state first
        _grads(ours_p, seed)
        ours.step()
    ref = torch_cls(ref_p, lr=1e-2, foreach=False, **kw)
    for po, pr in zip(ours_p, ref_p):
        pr.data.copy_(po.data)
        ref.state[pr] = _dense_state(ours.state[po])
    _grads(ours_p, 10)
    _grads(ref_p, 10)
    ours.step()
    ref.step()
    for po, pr in zip(ours_p, ref_p):
        torch.testing.assert_close(po.data, pr.data, rtol=2.4e-7, atol=1e-9)
        for key, value in ours.state[po].items():
            if qstate.is_qstate(value):
                expect = _expected_qstate(key, ref.state[pr], value["block_size"], 1e-8, 0.999)
                assert value["transform"] == expect["transform"] and value.get("eps") == expect.get("eps")
                assert (value["codes"].int() - expect["codes"].int()).abs().max() <= 1
                torch.testing.assert_close(value["absmax"], expect["absmax"], rtol=1e-6, atol=0)
            elif key != "step":
                torch.testing.assert_close(value, ref.state[pr][key], rtol=4.8e-7, atol=1e-12)


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def test_100_steps_track_torch_adamw():
    ours_m, ref_m = _tiny_model(), _tiny_model()
    ours = AdamW8bit(ours_m.parameters(), lr=1e-3, min_size=MIN)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(100):
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
        for model, opt in ((ours_m, ours), (ref_m, ref)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    assert qstate.is_qstate(ours.state[ours_m[0].weight]["exp_avg"])  # 2048 elements: 8-bit
    drift = max((a - b).abs().max().item() for a, b in zip(ours_m.parameters(), ref_m.parameters()))
    moved = max((a - b).abs().max().item() for a, b in zip(ref_m.parameters(), _tiny_model().parameters()))
    assert drift <= 1.0e-3 and moved > 10 * drift


def _run(opt, params, seeds):
    for s in seeds:
        _grads(params, s)
        opt.step()
    return [p.detach().clone() for p in params]


def test_tensor_lr_and_scheduler_match_float_lr():
    a, b = _params(), _params()
    opt_a = AdamW8bit(a, lr=torch.tensor(1e-2), min_size=MIN)
    opt_b = AdamW8bit(b, lr=1e-2, min_size=MIN)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=1, gamma=0.5)
    for s in range(3):
        for opt, ps, sched in ((opt_a, a, sched_a), (opt_b, b, sched_b)):
            _run(opt, ps, [s])
            sched.step()
    assert float(opt_a.param_groups[0]["lr"]) == pytest.approx(1e-2 / 8)
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)


def test_closure_and_zero_grad():
    (p,) = _params(((20, 20),))
    opt = AdamW8bit([p], min_size=MIN)

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    before = p.detach().clone()
    loss = opt.step(closure)
    assert loss.item() == pytest.approx((before**2).sum().item())
    assert not torch.equal(p, before)
    opt.zero_grad()
    assert p.grad is None


def test_add_param_group_uses_its_own_lr():
    a, b = _params(((20, 20),)), _params(((20, 20),), seed=1)
    opt = AdamW8bit(a, lr=1e-2, min_size=MIN)
    opt.add_param_group({"params": b, "lr": 0.0, "weight_decay": 0.0})
    before = b[0].detach().clone()
    _run(opt, a + b, [0])
    assert torch.equal(b[0], before)  # lr 0, no decay: unchanged
    assert qstate.is_qstate(opt.state[b[0]]["exp_avg"])


def test_bf16_params_update_in_fp32():
    (p16,) = _params(((30, 30),), dtype=torch.bfloat16)
    (p32,) = _params(((30, 30),), dtype=torch.bfloat16)
    p32.data = p32.data.float()
    o16 = AdamW8bit([p16], lr=1e-2, min_size=MIN)
    o32 = AdamW8bit([p32], lr=1e-2, min_size=MIN)
    p16.grad = torch.ones_like(p16)
    p32.grad = torch.ones_like(p32)
    o16.step()
    o32.step()
    assert p16.dtype == torch.bfloat16
    assert torch.equal(p16, p32.to(torch.bfloat16))  # one rounding of the fp32 result


def test_state_layout_and_bytes_per_param():
    (big,) = _params(((1024, 1024),))
    (small,) = _params(((10, 10),))
    opt = AdamW8bit([big, small])
    big.grad, small.grad = torch.zeros_like(big), torch.zeros_like(small)
    opt.step()
    st = opt.state[big]
    assert st["step"].dtype == torch.float32 and st["step"].dim() == 0 and st["step"].item() == 1
    assert st["exp_avg"]["codes"].dtype == torch.uint8 and st["exp_avg_sq"]["transform"] == "sqrt"
    assert opt.state[small]["exp_avg"].dtype == torch.float32
    nbytes = sum(qstate.state_nbytes(st[k]) + 4 * st[k]["qmap"].numel() for k in ("exp_avg", "exp_avg_sq"))
    assert nbytes / big.numel() <= 2.04


def test_sparse_gradient_is_rejected():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = AdamW8bit(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(UsageError, match="sparse"):
        opt.step()


def test_state_dict_round_trip_resumes_identically():
    a, b = _params(), _params()
    opt_a = AdamW8bit(a, lr=1e-2, min_size=MIN)
    _run(opt_a, a, [0, 1])
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded["state"][0]["exp_avg"]["transform"] == "ratio"
    for key, value in quant.dequantize_states(loaded["state"][0]).items():
        assert torch.equal(value, quant.dequantize_states(opt_a.state[a[0]])[key])
    for pa, pb in zip(a, b):
        pb.data.copy_(pa.data)
    opt_b = AdamW8bit(b, lr=1e-2, min_size=MIN)
    opt_b.load_state_dict(loaded)
    for pa, pb in zip(_run(opt_a, a, [2, 3]), _run(opt_b, b, [2, 3])):
        assert torch.equal(pa, pb)
    assert torch.equal(opt_a.state[a[0]]["exp_avg"]["codes"], opt_b.state[b[0]]["exp_avg"]["codes"])


def test_loads_torch_adamw_state_dict_quantizing_like_convert():
    a, b = _params(), _params()
    ref = torch.optim.AdamW(a, lr=1e-2)
    _run(ref, a, [0, 1])
    sd = ref.state_dict()
    opt = AdamW8bit(b, lr=1e-2, min_size=MIN)
    opt.load_state_dict(sd)
    big = opt.state[b[0]]
    for key in ("exp_avg", "exp_avg_sq"):
        expect = _expected_qstate(key, sd["state"][0], 256, 1e-8, 0.999)
        assert torch.equal(big[key]["codes"], expect["codes"]) and torch.equal(big[key]["absmax"], expect["absmax"])
    assert big["exp_avg"]["transform"] == "ratio" and big["exp_avg"]["eps"] == policy.ratio_eps(1e-8, 0.999, 2)
    assert torch.equal(opt.state[b[1]]["exp_avg"], sd["state"][1]["exp_avg"])
    assert big["step"].item() == 2 and opt.param_groups[0]["params"] == b


def test_converted_state_is_used_as_stored():
    a, b = _params(), _params()
    ref = torch.optim.AdamW(a, lr=1e-2)
    _run(ref, a, [0])
    sd = ref.state_dict()
    converted = {k: _expected_qstate(k, sd["state"][0], 256, 1e-8, 0.999) for k in ("exp_avg", "exp_avg_sq")}
    sd["state"][0].update(converted)  # what ckptq.load(path)["optimizer"] returns
    opt = AdamW8bit(b, min_size=MIN)
    opt.load_state_dict(sd)
    for key, q in converted.items():
        assert torch.equal(opt.state[b[0]][key]["codes"], q["codes"])
        assert opt.state[b[0]][key]["codes"] is not q["codes"]  # our steps write in place: a copy


def test_plain_first_moment_loads_and_becomes_a_ratio():
    """Pre-ratio files store exp_avg on its own ("none" transform): decoded as is, re-encoded as a ratio."""
    a, b = _params(), _params()
    ref = torch.optim.AdamW(a, lr=1e-2, foreach=False)
    _run(ref, a, [0, 1])
    sd = ref.state_dict()
    sd["state"][0].update({k: quant.quantize_state(sd["state"][0][k], k) for k in ("exp_avg", "exp_avg_sq")})
    for pa, pb in zip(a, b):
        pb.data.copy_(pa.data)
    opt = AdamW8bit(b, lr=1e-2, min_size=MIN)
    opt.load_state_dict(sd)
    assert opt.state[b[0]]["exp_avg"]["transform"] == "none"
    ref.state[a[0]].update(_dense_state(sd["state"][0]))  # both continue from the decoded state
    for pa, pb in zip(_run(ref, a, [2]), _run(opt, b, [2])):
        torch.testing.assert_close(pb, pa, rtol=2.4e-7, atol=1e-9)
    m = opt.state[b[0]]["exp_avg"]
    expect = _expected_qstate("exp_avg", ref.state[a[0]], 256, 1e-8, 0.999)
    assert m["transform"] == "ratio" and torch.equal(m["qmap"], policy.RATIO_POLICY.qmap())
    assert (m["codes"].int() - expect["codes"].int()).abs().max() <= 1


def test_mismatched_state_dict_raises_before_changing_state():
    a = _params()
    opt = AdamW8bit(a, min_size=MIN)
    _run(opt, a, [0])
    before = opt.state_dict()
    wrong_shape = AdamW8bit(_params(((30, 40), (7,))), min_size=MIN)
    _run(wrong_shape, wrong_shape.param_groups[0]["params"], [0])
    with pytest.raises(StateMismatchError, match=r"shape \(30, 40\)"):
        opt.load_state_dict(wrong_shape.state_dict())
    fewer = AdamW8bit(_params(((40, 30),)), min_size=MIN)
    with pytest.raises(StateMismatchError, match="has 1; pass"):
        opt.load_state_dict(fewer.state_dict())
    after = opt.state_dict()
    assert torch.equal(after["state"][0]["exp_avg"]["codes"], before["state"][0]["exp_avg"]["codes"])


def test_chunks_on_the_pool_match_one_thread(monkeypatch):
    from ckptq.kernels import backend_torch, cpu_runtime

    n = 3 * backend_torch.STEP_CHUNK + 100
    a, b = _params(((n,),)), _params(((n,),))
    pooled, serial = AdamW8bit(a, backend="torch"), AdamW8bit(b, backend="torch")
    pa = _run(pooled, a, [0, 1])
    monkeypatch.setattr(cpu_runtime, "_pool", lambda: None)
    pb = _run(serial, b, [0, 1])
    assert torch.equal(pa[0], pb[0])
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(pooled.state[a[0]][key]["codes"], serial.state[b[0]][key]["codes"])


def test_resumes_from_a_converted_file(trained_ckpt):
    """ckptq convert -> ckptq.load -> load_state_dict: ratio codes used as stored, and the next 10
    steps track torch AdamW resumed from the fp32 file (drift measured 7.9e-4, 1/76 of the distance moved)."""
    import copy

    import ckptq
    from tests.helpers.models import param_groups, train

    path, model, _ = trained_ckpt
    loaded = ckptq.load(ckptq.convert(path).outputs[0])["optimizer"]
    ref_model = copy.deepcopy(model)
    start = [p.detach().clone() for p in ref_model.parameters()]
    opt = AdamW8bit(param_groups(model), lr=1e-2, betas=(0.9, 0.95), min_size=4096)
    opt.load_state_dict(loaded)
    q = opt.state[opt.param_groups[0]["params"][0]]["exp_avg"]
    stored = loaded["state"][0]["exp_avg"]
    assert q["transform"] == "ratio" and q["eps"] == stored["eps"]
    assert torch.equal(q["codes"], stored["codes"])
    ref = torch.optim.AdamW(param_groups(ref_model), lr=1e-2, betas=(0.9, 0.95))
    ref.load_state_dict(torch.load(path, weights_only=True)["optimizer"])
    train(model, opt, 10, start=20)
    train(ref_model, ref, 10, start=20)
    pairs = list(zip(model.parameters(), ref_model.parameters(), start))
    drift = max((a - b).abs().max().item() for a, b, _ in pairs)
    moved = max((b - s).abs().max().item() for _, b, s in pairs)
    assert drift < moved / 20
