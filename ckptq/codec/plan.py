"""What ``convert`` stores low-bit and what it keeps exact, decided once: ``convert`` applies the plan,
``info`` reports it.

Each optimizer state dict is read by role (``ckptq.codec.roles``): the optimizer is recognised from its state
keys and its param groups' hyperparameters (torch's Adam, AdamW, NAdam, RAdam, Adamax, SGD, RMSprop, Adagrad,
Muon, Adafactor; lion-pytorch's Lion; transformers' Adafactor; bitsandbytes' optimizers, read into torch's
form first by ``ckptq.codec.foreign``), and each state key it keeps has a role whose codec ``ckptq.codec.policy``
gives. Anything else (steps, factored statistics, unknown keys, every state of an optimizer not recognised,
weights) is kept bit-exact. A state is also kept exact when quantizing it would lose more than its width's
worth: below ``min_size`` elements, sharing storage with another tensor, holding NaN/Inf or values beyond
fp32, or a second moment or max-norm with negative values (its sqrt would be NaN). Adam's first moment is
stored as the ratio to its second moment (``ckptq.codec.qstate``) unless that ratio would overflow fp32 or the
step's eps' is not a positive number; then it is quantized on its own. Param groups that cannot be what
they say (``betas`` outside [0, 1), a non-numeric ``eps``, no ``params``) are errors, before anything is
written.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from . import checkpoint, foreign, policy, qstate, quant, roles
from .exactness import FACTORED, NOT_A_MOMENT, ORDINARY, exact_reason, ratio_fits
from ..errors import InputError

DEFAULT_MIN_SIZE = 4096  # smaller states stay exact: their codebooks and scales would not pay for themselves


@dataclass
class Decision:
    path: tuple  # keys from the root to the param's state dict
    key: str  # the state key
    tensor: torch.Tensor
    exact: str | None = None  # why it is kept exact; None: stored 8-bit
    role: str | None = roles.ADAM  # its role (``ckptq.codec.roles``); None: not a moment
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
    kinds: list = field(default_factory=list)  # roles.Kind of each optimizer, in order

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
        if set(reasons) <= {NOT_A_MOMENT, FACTORED}:
            return (f"the optimizer state holds no moments to store low-bit ({'; '.join(self.recognised())}); "
                    f"ckptq stores the moments of {policy.KNOWN_OPTIMIZERS}, and keeps anything else exact")
        why = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()) if r not in (NOT_A_MOMENT, FACTORED))
        hint = f"; lower --min-size (now {min_size})" if reasons.get("below min_size") else ""
        return f"none of the moments can be stored low-bit ({why}){hint}; {'; '.join(self.recognised())}"

    def recognised(self) -> list[str]:
        """Per optimizer: where it is, what it was recognised as, and the float states it keeps exact by role
        (moments kept exact for their size or damage are the warnings' and counts' business)."""
        lines = []
        for found, kind in zip(self.optimizers, self.kinds):
            mine = [d for d in self.decisions if d.path[: len(found.path)] == found.path]
            kept = {reason: sorted({d.key for d in mine if d.exact == reason}) for reason in (FACTORED, NOT_A_MOMENT)}
            words = [f"{', '.join(keys)} {reason}" for reason, keys in kept.items() if keys]
            where = "/".join(map(str, found.path)) or "<root>"
            lines.append(f"{where}: {kind.name}" + (f" (kept exact: {'; '.join(words)})" if words else ""))
        return lines

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


def _check_groups(found: checkpoint.Found) -> roles.Kind:
    """The optimizer ``found`` holds (``roles.recognise``); InputError for a group no optimizer could have saved."""
    where = "/".join(map(str, found.path)) or "<root>"
    groups = found.state_dict["param_groups"]
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or not isinstance(g.get("params"), (list, tuple)):
            raise InputError(f"optimizer at {where}: param group {i} has no 'params' list; the state dict is damaged")
    kind = roles.recognise(found.state_dict, where)
    if groups and all("betas" in g for g in groups):
        count = 3 if "exp_avg_slow" in kind.roles else 2  # AdEMAMix: (beta1, beta2, beta3)
        for i, g in enumerate(groups):
            _check_betas(g, i, where, count)
    return kind


def _check_betas(g: dict, i: int, where: str, count: int = 2) -> None:
    betas, eps = g["betas"], _number(g.get("eps", 1e-8))
    b = [_number(x) for x in betas] if isinstance(betas, (list, tuple)) else []
    if len(b) != count or any(x is None or not 0.0 <= x < 1.0 for x in b):
        raise InputError(f"optimizer at {where}: param group {i} has betas {betas!r}; they are {count} numbers "
                         "in [0, 1). Fix the checkpoint's param_groups or pass --key to pick another optimizer")
    if eps is None or not math.isfinite(eps) or eps < 0:
        raise InputError(f"optimizer at {where}: param group {i} has eps {g.get('eps')!r}; it is a finite "
                         "number >= 0. Fix the checkpoint's param_groups")


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


def make_plan(obj: Any, key: str | None, min_size: int, block_size: int | None = None, bits: int = 8) -> Plan:
    """The plan for ``obj`` (a loaded checkpoint): which optimizer state tensors are stored low-bit (under the
    budget ``bits`` in blocks of ``block_size``, which only centered RMSprop's check needs)."""
    shared = checkpoint.shared_storages(obj)
    plan = Plan(checkpoint.find_optimizers(obj, key))
    for f in plan.optimizers:
        kind = _check_groups(f)
        plan.kinds.append(kind)
        where = "/".join(map(str, f.path)) or "<root>"
        groups = checkpoint.groups_by_param(f.state_dict, where)
        for pid, pstate in f.state_dict["state"].items():
            if not isinstance(pstate, dict):
                continue
            decisions = decide(f.path + ("state", pid), pstate, groups.get(pid, {}), min_size, kind, shared)
            if kind.role("grad_avg") and roles.flag(groups.get(pid, {}), "centered", where):
                _keep_centered(decisions, block_size or policy.default_block_size(bits), bits)
            plan.decisions += decisions
    return plan


def recognise_all(obj: Any, key: str | None = None) -> list[roles.Kind]:
    """What each optimizer state dict in ``obj`` was saved by (``roles.recognise``); InputError for state
    ckptq cannot read."""
    return [_check_groups(f) for f in checkpoint.find_optimizers(obj, key)]


ADAM = roles.Kind("Adam", {"exp_avg": roles.ADAM, "exp_avg_sq": roles.ADAM, "max_exp_avg_sq": roles.ADAM})


def decide(path: tuple, pstate: dict, group: dict, min_size: int, kind: roles.Kind = ADAM,
           shared: set = frozenset()) -> list[Decision]:
    """One parameter's decisions: each float state tensor in ``pstate`` (its state dict, or the moments a DCP
    folder holds for it) stored low-bit by its role in ``kind`` or kept exact and why, Adam's first moment
    stored as a ratio where it fits; ``group``: its param group (eps, betas), ``path``: where it sits."""
    decisions = {}
    for name, t in pstate.items():
        if isinstance(t, torch.Tensor) and name != "step" and t.is_floating_point():
            role = kind.role(name)
            why = exact_reason(name, t, role, min_size, shared, name in kind.factored)
            decisions[name] = Decision(path, name, t, why, role if why is None else None)
    if kind.ratio:
        _pair_ratio(decisions, group, pstate.get("step", 0))
    return list(decisions.values())


CENTERED = "centered RMSprop: square_avg - grad_avg^2 would turn negative once rounded"


def _keep_centered(decisions: list[Decision], block_size: int, bits: int) -> None:
    """Centered RMSprop divides by sqrt(square_avg - grad_avg^2): where rounding made that negative, its step
    would be NaN. Where the decoded pair keeps square_avg >= grad_avg^2 everywhere, every later step does too
    (alpha * s + (1 - alpha) * g^2 >= (alpha * a + (1 - alpha) * g)^2 whenever s >= a^2, by convexity);
    else both stay exact. Checked at the width and block size convert gives them."""
    pair = {d.key: d for d in decisions if d.exact is None and d.key in ("square_avg", "grad_avg")}
    if len(pair) < 2:
        return
    s, a = pair["square_avg"].tensor, pair["grad_avg"].tensor
    if s.shape != a.shape:  # both have the parameter's shape in torch's RMSprop
        raise InputError(f"{pair['grad_avg'].name} has shape {tuple(a.shape)} where square_avg has {tuple(s.shape)}; "
                         "centered RMSprop keeps both in the parameter's shape, the state dict is damaged")
    s, a = (quant.dequantize_state(quant.quantize_state(d.tensor, d.key, block_size, bits=convert_width(d, bits),
                                                        role=d.role)).double() for d in pair.values())
    if bool((s < a.square()).any()):
        for d in pair.values():
            d.exact, d.role = CENTERED, None


def input_budget(obj: Any) -> int | None:
    """The narrowest budget (``policy.BUDGETS``) of the low-bit optimizer state ``obj`` holds as loaded, before
    ``foreign.to_torch`` decodes it: 4 for torchao's 4-bit states or ckptq states narrower than 8 bits, 8 for
    8-bit ones (torchao's, bitsandbytes', ckptq's); None when it holds none. The hook behind "without --bits,
    never write a wider state than the input's": a source resolves the default width as
    ``default_budget(obj)`` (a torchao AdamW4bit checkpoint converted at 8 bits grew 1.19x)."""
    widths = set()
    for found in checkpoint.find_optimizers(obj):
        for pstate in found.state_dict["state"].values():
            if not isinstance(pstate, dict):
                continue
            if foreign.kind(pstate) == "bitsandbytes":
                q = pstate.get(foreign.BNB_NESTED, pstate)
                widths |= {8} if isinstance(q, dict) and getattr(q.get("state1"), "dtype", None) == torch.uint8 else set()
            for v in pstate.values():
                if qstate.is_qstate(v) and isinstance(v.get("bits"), int):
                    widths.add(v["bits"])
                elif foreign.is_torchao(v):
                    widths.add(foreign.torchao_bits(v))
    widths.discard(None)
    return (4 if min(widths) < 8 else 8) if widths else None


def default_budget(obj: Any) -> int:
    """The budget ``convert`` uses when none is asked for: 8, or the input's own when it is narrower."""
    return min(8, input_budget(obj) or 8)


def convert_width(d: Decision, bits: int) -> int:
    """The code width convert gives a quantized state under a budget of ``bits`` per value
    (``policy.convert_width``)."""
    return policy.convert_width(bits, d.key, ratio=d.divisor is not None, divisor=d.divides, role=d.role)
