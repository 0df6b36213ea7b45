"""``ckptq.codec.ops``' older per-parameter steps (``contract``'s adam_step and momentum_step) as groups of one of
the one step (``contract.Group``), which every backend that has them runs with its own ``step``."""

from __future__ import annotations

import torch

from . import rules
from .contract import (NONE, RATIO, SQRT, UPDATE_LINEAR, UPDATE_SIGN, Group, GroupMember, MomentumFlags, Slot, StepFlags,
                       StepState)


def _group(rule: rules.Rule, flags: int, p, g, states: tuple, slots: tuple, h, seed, out, block_size: int,
           row_len) -> Group:
    member = GroupMember(p, tuple(s.codes for s in states), tuple(s.absmax for s in states), row_len)
    seeds = None if seed is None else torch.tensor([seed], dtype=torch.int64)
    return Group(rule.name, flags, (member,), (g,), () if out is None else (out,), h.reshape(1, -1), seeds, slots,
                 block_size, {})


def _slot(state: StepState, decode: int, encode: int, divisor: int = -1, seeded: bool = True) -> Slot:
    return Slot(state.qmap, state.thresholds, state.encode, state.bits, decode, encode, divisor, seeded)


def adam_group(p, g, states: tuple[StepState, ...], h, flags: StepFlags) -> Group:
    """``contract``'s adam_step: the rule ``adam`` on exp_avg (a ratio to exp_avg_sq, or plain where its codes
    are not yet ratios), exp_avg_sq and max_exp_avg_sq (square roots; the last to nearest)."""
    m, v, *x = states
    slots = (_slot(m, RATIO if flags.ratio else NONE, RATIO, 1), _slot(v, SQRT, SQRT))
    slots += tuple(_slot(s, SQRT, SQRT, seeded=False) for s in x)
    rule_flags = (rules.MAXIMIZE if flags.maximize else 0) | (rules.ADAM.flag("amsgrad") if x else 0)
    return _group(rules.ADAM, rule_flags, p, g, states, slots, h, flags.seed, None, flags.block_size, flags.row_len)


def momentum_group(p, g, state: StepState, h, out, flags: MomentumFlags) -> Group:
    """``contract``'s momentum_step: the rule ``momentum``, its update as the rule's switch."""
    update = {UPDATE_LINEAR: rules.MOMENTUM.flag("linear"), UPDATE_SIGN: rules.MOMENTUM.flag("sign")}.get(flags.update, 0)
    if not update and out is None:  # the direction goes nowhere, but the rule writes it
        out = torch.empty(p.shape, dtype=torch.float32, device=p.device)
    return _group(rules.MOMENTUM, (rules.MAXIMIZE if flags.maximize else 0) | update, p, g, (state,),
                  (_slot(state, NONE, NONE),), h, flags.seed, out if not update else None, flags.block_size,
                  flags.row_len)
