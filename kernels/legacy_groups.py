"""The one step's groups (``contract.Group`` / ``Dense``) as the two grouped kernels the C backend had before
it (``StepGroup``: Adam(W); ``MomentumGroup``: SGD, Lion, Muon), for the rules and slot shapes those kernels
implement; None for anything else (the reference takes it). Triton runs every rule on its template
(``triton_step``) and needs none of this."""

from __future__ import annotations

from .contract import (NONE, RATIO, SQRT, UPDATE_LINEAR, UPDATE_NONE, UPDATE_SIGN, Dense, DenseGroup, Group,
                       MomentumGroup, StepCodebooks, StepGroup)
from .rules import ADAM, MAXIMIZE, MOMENTUM


def _books(slot) -> StepCodebooks:
    return StepCodebooks(slot.qmap, slot.thresholds, slot.encode)


def adam_group(group: Group) -> StepGroup | None:
    """Adam(W) with exp_avg (plain or ratio, written as a ratio to slot 1), exp_avg_sq and max_exp_avg_sq
    (sqrt, the last never seeded)."""
    slots = group.slots
    if group.rule != ADAM.name or len(slots) not in (2, 3) or group.flags & ~(MAXIMIZE | ADAM.flag("amsgrad")):
        return None
    m, *rest = slots
    if m.decode not in (NONE, RATIO) or m.encode_as != RATIO or m.divisor != 1 or not m.seeded:
        return None
    if any(s.decode != SQRT or s.encode_as != SQRT for s in rest) or not rest[0].seeded:
        return None
    if len(rest) == 2 and rest[1].seeded:
        return None
    return StepGroup(group.members, group.grads, group.hyper, group.seeds, tuple(_books(s) for s in slots),
                     tuple(s.bits for s in slots), group.block_size, m.decode == RATIO, bool(group.flags & MAXIMIZE),
                     group.cache)


def momentum_group(group: Group) -> MomentumGroup | None:
    """SGD, Lion, Muon: one plain, seeded state."""
    if group.rule != MOMENTUM.name or len(group.slots) != 1:
        return None
    (s,) = group.slots
    if s.decode != NONE or s.encode_as != NONE or not s.seeded:
        return None
    linear, sign = group.flags & MOMENTUM.flag("linear"), group.flags & MOMENTUM.flag("sign")
    update = UPDATE_LINEAR if linear else UPDATE_SIGN if sign else UPDATE_NONE
    return MomentumGroup(group.members, group.grads, group.outs, group.hyper, group.seeds, _books(s), s.bits,
                         group.block_size, bool(group.flags & MAXIMIZE), update, group.cache)


def adam_dense(group: Dense) -> DenseGroup | None:
    if group.rule != ADAM.name or group.flags & ~(MAXIMIZE | ADAM.flag("amsgrad")):
        return None
    return DenseGroup(group.params, group.grads, group.states, group.hyper, bool(group.flags & MAXIMIZE), group.cache)
