"""What ``convert`` stores 8-bit and what it keeps exact, decided once: ``convert`` applies the plan,
``info`` reports it.

ckptq quantizes the moments of the Adam family (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) of
optimizers whose param groups carry Adam's ``betas``: torch's Adam, AdamW, NAdam, RAdam, and the like.
Anything else (SGD's momentum, Adafactor's factored moments, steps, weights) is kept bit-exact. A state is
also kept exact when quantizing it would lose more than 8 bits' worth: below ``min_size`` elements,
sharing storage with another tensor, holding NaN/Inf or values beyond fp32, or a second moment with
negative values (its sqrt would be NaN). A first moment is stored as the ratio to its second moment
(``ckptq.qstate``) unless that ratio would overflow fp32 or the step's eps' is not a positive number; then
it is quantized on its own. Param groups that cannot be Adam's (``betas`` outside [0, 1), a non-numeric
``eps``, no ``params``) are errors, before anything is written.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from . import checkpoint, policy
from ..errors import InputError

DEFAULT_MIN_SIZE = 4096  # smaller states stay exact: their codebooks and scales would not pay for themselves
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")
_FP32_MAX = torch.finfo(torch.float32).max
# Why a state is kept exact although it is an Adam moment; the first ones are ordinary, the rest are
# reported as warnings (the data would have been damaged).
ORDINARY = ("not an Adam moment", "below min_size", "shares storage")
_RATIO_CHUNK = 1 << 22


@dataclass
class Decision:
    path: tuple  # keys from the root to the param's state dict
    key: str  # the state key
    tensor: torch.Tensor
    exact: str | None = None  # why it is kept exact; None: stored 8-bit
    divisor: tuple | None = None  # first moments stored as a ratio: (divisor key, its tensor, eps')
    divides: bool = False  # a second moment that a first moment is stored relative to
    note: str | None = None  # why a first moment is not stored as a ratio

    @property
    def name(self) -> str:
        return "/".join(map(str, self.path + (self.key,)))


@dataclass
class Plan:
    optimizers: list = field(default_factory=list)  # checkpoint.Found
    decisions: list[Decision] = field(default_factory=list)

    @property
    def quantized(self) -> list[Decision]:
        return [d for d in self.decisions if d.exact is None]

    def kept(self, *reasons: str) -> list[Decision]:
        return [d for d in self.decisions if d.exact in reasons]

    def counts(self) -> dict:
        """What a convert report counts: optimizers, states stored low-bit, and those kept exact by reason."""
        return {"optimizers": len(self.optimizers), "quantized": len(self.quantized),
                "kept_small": len(self.kept("below min_size")), "kept_shared": len(self.kept("shares storage")),
                "kept_nonfinite": len(self.kept("holds NaN/Inf"))}

    def nothing_to_quantize(self, min_size: int) -> str:
        """Why the plan stores nothing low-bit, and what to do."""
        reasons = Counter(d.exact for d in self.decisions)
        if set(reasons) <= {"not an Adam moment"}:
            keys = sorted({d.key for d in self.decisions})
            return (f"the optimizer state holds no Adam moments to store low-bit (found: {', '.join(keys) or 'no tensors'}); "
                    "ckptq converts Adam/AdamW state (exp_avg, exp_avg_sq), nothing else")
        why = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()) if r != "not an Adam moment")
        hint = f"; lower --min-size (now {min_size})" if reasons.get("below min_size") else ""
        return f"none of the Adam moments can be stored low-bit ({why}){hint}"

    def warnings(self) -> list[str]:
        """One line per state kept exact because quantizing it would have damaged it, and per first moment
        stored on its own because its ratio would not fit."""
        lines = [f"{d.name}: {d.exact}, kept exact" for d in self.decisions if d.exact and d.exact not in ORDINARY]
        lines += [f"{d.name}: {d.note}" for d in self.decisions if d.note]
        return lines


def _number(x: Any) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_meta:
        x = x.item()
    return float(x) if isinstance(x, (int, float)) else None


def _check_groups(found: checkpoint.Found) -> bool:
    """Whether the optimizer is of the Adam family; InputError for a group no optimizer could have saved."""
    where = "/".join(map(str, found.path)) or "<root>"
    groups = found.state_dict["param_groups"]
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or not isinstance(g.get("params"), (list, tuple)):
            raise InputError(f"optimizer at {where}: param group {i} has no 'params' list; the state dict is damaged")
    if not groups or not all("betas" in g for g in groups):
        return False
    for i, g in enumerate(groups):
        betas, eps = g["betas"], _number(g.get("eps", 1e-8))
        b = [_number(x) for x in betas] if isinstance(betas, (list, tuple)) else []
        if len(b) != 2 or any(x is None or not 0.0 <= x < 1.0 for x in b):
            raise InputError(f"optimizer at {where}: param group {i} has betas {betas!r}; Adam's are two numbers "
                             "in [0, 1). Fix the checkpoint's param_groups or pass --key to pick another optimizer")
        if eps is None or not math.isfinite(eps) or eps < 0:
            raise InputError(f"optimizer at {where}: param group {i} has eps {g.get('eps')!r}; Adam's is a finite "
                             "number >= 0. Fix the checkpoint's param_groups")
    return True


def exact_reason(key: str, t: torch.Tensor, adam: bool, min_size: int, shared: set) -> str | None:
    if t.is_meta:
        raise InputError(f"state {key!r} is a meta tensor (shape only, no data); the checkpoint cannot be converted")
    if not adam or key not in ADAM_MOMENTS:
        return "not an Adam moment"
    if t.layout != torch.strided:
        return f"a {str(t.layout).removeprefix('torch.')} tensor, not a dense one"
    if not checkpoint.is_quantizable(t, min_size):
        return "below min_size"
    if checkpoint.repeats_bytes(t):  # quantizing it would write more than the input holds
        return "a view that repeats its bytes (stride 0 or overlapping)"
    if checkpoint.storage_key(t) in shared:
        return "shares storage"
    lo, hi = (float(v) for v in torch.aminmax(t.detach().reshape(-1)))  # one pass; NaN propagates
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "holds NaN/Inf"
    if max(-lo, hi) > _FP32_MAX:
        return "holds values beyond float32"
    if key in SECOND_MOMENTS and lo < 0:
        return "negative second moment (an Adam second moment is >= 0)"
    return None


def unsafe_moments(dense: dict) -> str | None:
    """Why fp32 Adam moments {key: tensor or DTensor} cannot be stored 8-bit without damage (this rank's
    shard of a DTensor), or None: NaN/Inf, values beyond fp32, a negative second moment."""
    for key, t in dense.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.numel() and key in ADAM_MOMENTS:
            reason = exact_reason(key, local, True, 1, set())
            if reason:
                return f"{key} {reason}"
    return None


def ratio_fits(m: torch.Tensor, v: torch.Tensor, eps: float) -> bool:
    """Whether every |m| / (sqrt(v) + eps) is finite in fp32 (sqrt(v) + eps >= eps bounds it at once)."""
    if m.numel() == 0:
        return True
    absmax = float(m.detach().abs().amax())
    if absmax / eps <= _FP32_MAX / 2:
        return True
    mf, vf = m.detach().reshape(-1), v.detach().reshape(-1)
    for s in range(0, mf.numel(), _RATIO_CHUNK):
        r = mf[s : s + _RATIO_CHUNK].double().abs() / (vf[s : s + _RATIO_CHUNK].double().sqrt() + eps)
        if bool((r > _FP32_MAX / 2).any()):
            return False
    return True


def _pair_ratio(decisions: dict, group: dict, step: Any) -> None:
    for m_key, v_key in policy.RATIO_PAIRS.items():
        m, v = decisions.get(m_key), decisions.get(v_key)
        if m is None or v is None or m.exact or v.exact or m.tensor.shape != v.tensor.shape:
            continue
        n = _number(step) if step is not None else 0.0
        eps = policy.ratio_eps_for(group, n) if n is not None and math.isfinite(n) and n >= 0 else float("nan")
        if math.isfinite(eps) and eps > 0 and ratio_fits(m.tensor, v.tensor, eps):
            m.divisor, v.divides = (v_key, v.tensor, eps), True
        else:
            m.note = f"its ratio to {v_key} would not fit float32 (step {step!r}); stored 8-bit on its own"


def make_plan(obj: Any, key: str | None, min_size: int) -> Plan:
    """The plan for ``obj`` (a loaded checkpoint): which optimizer state tensors are stored 8-bit."""
    shared = checkpoint.shared_storages(obj)
    plan = Plan(checkpoint.find_optimizers(obj, key))
    for f in plan.optimizers:
        adam = _check_groups(f)
        groups = {pid: g for g in f.state_dict["param_groups"] for pid in g["params"]}
        for pid, pstate in f.state_dict["state"].items():
            if isinstance(pstate, dict):
                plan.decisions += decide(f.path + ("state", pid), pstate, groups.get(pid, {}), min_size, adam, shared)
    return plan


def decide(path: tuple, pstate: dict, group: dict, min_size: int, adam: bool = True, shared: set = frozenset()) \
        -> list[Decision]:
    """One parameter's decisions: each float state tensor in ``pstate`` (its state dict, or the moments a DCP
    folder holds for it) stored low-bit or kept exact and why, the first moment stored as a ratio where it
    fits; ``group``: its param group (eps, betas), ``path``: where the state dict sits."""
    decisions = {}
    for name, t in pstate.items():
        if isinstance(t, torch.Tensor) and name != "step" and t.is_floating_point():
            decisions[name] = Decision(path, name, t, exact_reason(name, t, adam, min_size, shared))
    _pair_ratio(decisions, group, pstate.get("step", 0))
    return list(decisions.values())


def convert_width(d: Decision, bits: int) -> int:
    """The code width convert gives a quantized state under a budget of ``bits`` per value
    (``policy.convert_width``)."""
    return policy.convert_width(bits, d.key, ratio=d.divisor is not None, divisor=d.divides)
