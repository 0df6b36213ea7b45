"""Every hyperparameter of every bundled optimizer, given every kind of bad value, at construction and in a
loaded state dict's param group (the one-state optimizers refuse what AdamW8bit refuses; the engine
checks them once for every optimizer). Each trial is refused in one typed error naming the value
(``ArgumentError`` at construction, ``StateMismatchError`` at load, both ``ValueError``s) with the optimizer
unchanged, or is accepted and then steps to finite parameters. Anything else (a raw exception, a traceback
from deep inside, NaN/Inf parameters) is a failure, with one allowance: a huge but finite value (1e30, 3e38)
whose step scalars fit in fp32 (what AdamW8bit has always checked: lr * weight_decay, lr / (1 - beta1) and
each optimizer's like) is accepted as torch accepts it, and may then diverge as torch's optimizer does."""

import inspect
import math

import pytest
import torch

import ckptq.optim as optim
from ckptq.errors import ArgumentError, StateMismatchError

HUGE = (1e30, 3e38)
BAD = [math.nan, math.inf, -math.inf, 3e38, 1e30, -1.0, "abc", None, torch.ones(2), torch.tensor(math.nan), [1, 2]]
CLASSES = [getattr(optim, name) for name in optim.__all__ if name.endswith("8bit")]


def _params():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(16, 24, generator=gen)), torch.nn.Parameter(torch.randn(16, generator=gen))]


def _steps(opt, params, n=2) -> bool:
    """n steps of a least-squares problem; whether the parameters stay finite."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 24, generator=gen), torch.randn(8, 16, generator=gen)
    for _ in range(n):
        opt.zero_grad()
        ((x @ params[0].T + params[1] - y) ** 2).mean().backward()
        opt.step()
    return all(bool(torch.isfinite(p).all()) for p in params)


def _make(cls, params, **kw):
    return cls(params[:1] if cls.__name__.startswith("Muon") else params, min_size=16, **kw)


def _hyper_keys(cls) -> list[str]:
    opt = _make(cls, _params())
    return [k for k, v in opt.defaults.items() if k not in ("foreach", "fused", "differentiable", "capturable")]


def _outcome(fn) -> str:
    try:
        fn()
    except (ArgumentError, StateMismatchError) as e:
        return "refused" if "\n" not in str(e) else f"multi-line: {e}"
    except Exception as e:  # noqa: BLE001 (the point: anything else is a finding)
        return f"raw {type(e).__name__}: {str(e)[:120]}"
    return "accepted"


@pytest.mark.parametrize("cls", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_every_hyperparameter_is_refused_by_name_or_steps_finitely(cls):
    bad, counts = [], {"refused": 0, "accepted": 0}
    for key in _hyper_keys(cls):
        for value in BAD:
            if key in inspect.signature(cls).parameters:  # (AdamW8bit's groups hold decoupled_weight_decay, as
                params = _params()                          # torch's AdamW's, but its constructor takes none)
                built = {}
                outcome = _outcome(lambda: built.setdefault("opt", _make(cls, params, **{key: value})))
                if outcome == "accepted" and not _steps(built["opt"], params) and value not in HUGE:
                    outcome = "accepted, then non-finite parameters"
                if outcome not in counts:
                    bad.append(("construct", key, repr(value)[:30], outcome))
                else:
                    counts[outcome] += 1
            params = _params()
            opt = _make(cls, params)
            _steps(opt, params, 1)
            sd = opt.state_dict()
            before = {k: v.clone() for k, v in opt.state[params[0]].items() if isinstance(v, torch.Tensor)}
            sd["param_groups"][0][key] = value
            outcome = _outcome(lambda: opt.load_state_dict(sd))
            if outcome == "refused":
                after = {k: v for k, v in opt.state[params[0]].items() if isinstance(v, torch.Tensor)}
                if any(not torch.equal(before[k], after[k]) for k in before):
                    outcome = "refused, but the optimizer changed"
            elif outcome == "accepted" and not _steps(opt, params) and value not in HUGE:
                outcome = "accepted, then non-finite parameters"
            if outcome not in counts:
                bad.append(("load", key, repr(value)[:30], outcome))
            else:
                counts[outcome] += 1
    assert not bad, bad[:10]
    assert counts["refused"] > 0


@pytest.mark.parametrize("cls", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_unhashable_parameter_ids_are_refused_in_one_line(cls):
    params = _params()
    opt = _make(cls, params)
    _steps(opt, params, 1)
    sd = opt.state_dict()
    sd["param_groups"][0]["params"] = [[0]] + sd["param_groups"][0]["params"][1:]
    with pytest.raises(StateMismatchError, match="lists a list"):
        opt.load_state_dict(sd)


def test_huge_or_non_finite_step_scalars_of_the_one_state_optimizers_are_refused():
    """Named cases: an lr, weight decay or momentum of 1e30..3e38 whose step scalars overflow fp32, and
    Muon's Newton-Schulz coefficients NaN, inf, huge or not numbers."""
    p = [torch.nn.Parameter(torch.randn(64, 96))]
    cases = [(optim.SGD8bit, dict(lr=3e38, momentum=0.9)), (optim.SGD8bit, dict(lr=0.1, weight_decay=3e38)),
             (optim.SGD8bit, dict(lr=1e10, weight_decay=1e30)), (optim.SGD8bit, dict(lr=0.1, momentum=1e30)),
             (optim.Lion8bit, dict(lr=1.0, weight_decay=3e38)), (optim.Muon8bit, dict(ns_coefficients=(math.nan, 1, 1))),
             (optim.Muon8bit, dict(ns_coefficients=(math.inf, 1, 1))), (optim.Muon8bit, dict(ns_coefficients=(1e30, 1, 1))),
             (optim.Muon8bit, dict(ns_coefficients="abc")), (optim.Muon8bit, dict(lr=3e38, adjust_lr_fn="match_rms_adamw"))]
    for cls, kw in cases:
        with pytest.raises(ArgumentError):
            cls(p, **kw)
