"""The optimizers' elementwise rules: what one step does to one element, declared once here and written in
torch ops (the reference every backend equals bit for bit; the C kernels and the Triton template implement
each rule under the same name).

A rule sees true values, not stored codes: the step skeleton (``step_torch``, ``cpu_kernels.c``,
``triton_step``) decodes each low-bit state (codebook entry times its block's scale, then the state's
transform: a square for ``sqrt`` states, times its divisor for ``ratio`` states), hands the rule the
parameter p (fp32), the gradient g (fp32, negated for ``MAXIMIZE``), the states and the step's scalars h
(one fp32 row, ``Rule.fields``), and encodes what the rule returns. States kept in fp32 (small parameters)
go through the same rule without the codec. Each rule computes in fp32, each product, quotient, sum and
square root rounded once, in the order written here: no FMA, IEEE division and square root.

A rule returns (p_new, states_new, d): p_new None for rules that leave the parameter to the caller (Muon:
Newton-Schulz needs the whole matrix), d (the direction, written to ``out``) only for those.

Flags: bit 0 is ``MAXIMIZE`` for every rule; a rule's own switches (``Rule.flags``) take bits 1, 2, ...
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .ieee import ieee_sqrt

MAXIMIZE = 1


class Rule(NamedTuple):
    name: str
    fields: tuple[str, ...]  # the step's scalars, fp32 [len(fields)] per member, in this order
    flags: tuple[str, ...]  # the rule's switches: flags[k] is bit 1 << (k + 1)
    states: Callable[[int], tuple[str, ...]]  # the state slots a flag word gives, in kernel order
    math: Callable  # math(p, g, states, h, flags) -> (p_new or None, states_new, d or None), torch ops

    def flag(self, name: str) -> int:
        return 1 << (self.flags.index(name) + 1)

    def has(self, flags: int, name: str) -> bool:
        return bool(flags & self.flag(name))


def _adam_moments(p, g, m, v, h):
    """Adam's moments: gi = g + l2 * p; m += omb1 * (gi - m) (torch's lerp); v = v * beta2 + omb2 * gi^2."""
    gi = g + h[1] * p
    return gi, m + h[2] * (gi - m), v * h[3] + h[4] * (gi * gi)


def adam(p, g, s, h, flags):
    """Adam(W) (``HYPER_FIELDS``): p = p * decay + neg_step * (m / (sqrt(v) / bc2_sqrt + eps)), with
    AMSGRAD the running max of v in the denominator. decay = 1 - lr * wd (AdamW) or l2 = wd (Adam)."""
    m, v, *x = s
    _, m, v = _adam_moments(p, g, m, v, h)
    if x:
        x = [torch.maximum(x[0], v)]  # NaN where either is, as torch.maximum
    denom = ieee_sqrt(x[0] if x else v) / h[7] + h[5]
    return p * h[0] + h[6] * (m / denom), (m, v, *x), None


def nadam(p, g, s, h, flags):
    """NAdam (torch.optim.NAdam): Adam's moments and denominator, then
    p = (p * decay + c_grad * (gi / denom)) + c_m * (m / denom), c_grad = -lr (1 - mu_t) / (1 - mu_prod_t),
    c_m = -lr mu_{t+1} / (1 - mu_prod_t mu_{t+1})."""
    m, v = s
    gi, m, v = _adam_moments(p, g, m, v, h)
    denom = ieee_sqrt(v) / h[7] + h[5]
    return (p * h[0] + h[10] * (gi / denom)) + h[6] * (m / denom), (m, v), None


def radam(p, g, s, h, flags):
    """RAdam (torch.optim.RAdam): Adam's moments; where the variance is tractable (``rectify`` = 1)
    p = p * decay + neg_step * (m / (sqrt(v) / bc2_sqrt + eps)) with neg_step = -lr r_t sqrt(1 - beta2^t) /
    (1 - beta1^t) and bc2_sqrt = 1, else p = p * decay + neg_step * m with neg_step = -lr / (1 - beta1^t)."""
    m, v = s
    _, m, v = _adam_moments(p, g, m, v, h)
    denom = ieee_sqrt(v) / h[7] + h[5]
    return p * h[0] + h[6] * torch.where(h[10] != 0, m / denom, m), (m, v), None


def ademamix(p, g, s, h, flags):
    """AdEMAMix (Pagliardini et al. 2024; bitsandbytes' AdEMAMix): m1 += omb1 (g - m1), m2 += omb3 (g - m2),
    nu = nu * beta2 + omb2 g^2, p = p * decay + neg_lr * ((m1 / bc1 + alpha * m2) / (sqrt(nu) / bc2_sqrt + eps))."""
    m1, m2, nu = s
    m1 = m1 + h[1] * (g - m1)
    m2 = m2 + h[2] * (g - m2)
    nu = nu * h[3] + h[4] * (g * g)
    denom = ieee_sqrt(nu) / h[7] + h[5]
    return p * h[0] + h[6] * ((m1 / h[8] + h[9] * m2) / denom), (m1, m2, nu), None


def momentum(p, g, s, h, flags):
    """SGD, Lion and Muon (``MOMENTUM_FIELDS``): gi = g + l2 * p; m_new = m * keep + take * gi;
    d = (m * c_old + m_new * c_new) + gi * c_grad; p = p * decay + neg_lr * d (LINEAR), * sign(d) (SIGN:
    sign(NaN) = NaN), or d to out (neither: Muon)."""
    (m,) = s
    gi = g + h[0] * p
    m_new = m * h[1] + h[2] * gi
    d = (m * h[3] + m_new * h[4]) + gi * h[5]
    if flags & MOMENTUM.flag("linear"):
        return p * h[6] + h[7] * d, (m_new,), None
    if flags & MOMENTUM.flag("sign"):
        return p * h[6] + h[7] * torch.where(torch.isnan(d), d, torch.sign(d)), (m_new,), None
    return None, (m_new,), d


def rmsprop(p, g, s, h, flags):
    """RMSprop (torch.optim.RMSprop): gi = g + l2 * p; v = v * alpha + oma * gi^2; CENTERED: ga += oma (gi - ga),
    avg = sqrt(v - ga^2) (a negative v - ga^2 taken as 0: where(var < 0, 0, var), NaN kept), else sqrt(v);
    avg += eps; HEAVY (momentum > 0): buf = buf * momentum + gi / avg,
    p += neg_lr * buf; else p += neg_lr * (gi / avg). States: v[, buf][, ga]."""
    v, *rest = s
    heavy, centered = RMSPROP.has(flags, "heavy"), RMSPROP.has(flags, "centered")
    gi = g + h[0] * p
    v = v * h[1] + h[2] * (gi * gi)
    out = [v]
    if centered:
        ga = rest[-1]
        ga = ga + h[2] * (gi - ga)
        var = v - ga * ga
        avg = ieee_sqrt(torch.where(var < 0, 0.0, var)) + h[3]  # >= 0 in exact math; low-bit v and ga can cross
    else:
        avg = ieee_sqrt(v) + h[3]
    if heavy:
        buf = rest[0] * h[5] + gi / avg
        out.append(buf)
        p = p + h[4] * buf
    else:
        p = p + h[4] * (gi / avg)
    if centered:
        out.append(ga)
    return p, tuple(out), None


def adagrad(p, g, s, h, flags):
    """Adagrad (torch.optim.Adagrad): gi = g + l2 * p; sum += gi^2; p += neg_clr * (gi / (sqrt(sum) + eps))."""
    (acc,) = s
    gi = g + h[0] * p
    acc = acc + gi * gi
    return p + h[1] * (gi / (ieee_sqrt(acc) + h[2])), (acc,), None


# The scalars of Adam (and of NAdam and RAdam, which add one): host-computed in float64, rounded once to fp32.
# decode_eps / encode_eps: eps' of the ratio transform the first moment's codes were / are written with.
ADAM_FIELDS = ("decay", "l2", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "neg_step_size", "bc2_sqrt",
               "decode_eps", "encode_eps")

ADAM = Rule("adam", ADAM_FIELDS, ("amsgrad",),
            lambda f: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")[: 3 if f & 2 else 2], adam)
NADAM = Rule("nadam", (*ADAM_FIELDS, "neg_grad_step"), (), lambda f: ("exp_avg", "exp_avg_sq"), nadam)
RADAM = Rule("radam", (*ADAM_FIELDS, "rectify"), (), lambda f: ("exp_avg", "exp_avg_sq"), radam)
ADEMAMIX = Rule("ademamix", ("decay", "one_minus_beta1", "one_minus_beta3", "beta2", "one_minus_beta2", "eps",
                             "neg_lr", "bc2_sqrt", "bc1", "alpha"), (),
                lambda f: ("exp_avg", "exp_avg_slow", "exp_avg_sq"), ademamix)
MOMENTUM = Rule("momentum", ("l2", "keep", "take", "c_old", "c_new", "c_grad", "decay", "neg_lr"), ("linear", "sign"),
                lambda f: ("momentum_buffer",), momentum)
RMSPROP = Rule("rmsprop", ("l2", "alpha", "one_minus_alpha", "eps", "neg_lr", "momentum"), ("heavy", "centered"),
               lambda f: ("square_avg",) + (("momentum_buffer",) if f & 2 else ()) + (("grad_avg",) if f & 4 else ()),
               rmsprop)
ADAGRAD = Rule("adagrad", ("l2", "neg_clr", "eps"), (), lambda f: ("sum",), adagrad)

RULES = {r.name: r for r in (ADAM, NADAM, RADAM, ADEMAMIX, MOMENTUM, RMSPROP, ADAGRAD)}


def writes_direction(rule: Rule, flags: int) -> bool:
    """Whether a step of ``rule`` with ``flags`` writes the direction d to out and leaves p alone."""
    return rule is MOMENTUM and not flags & (MOMENTUM.flag("linear") | MOMENTUM.flag("sign"))
