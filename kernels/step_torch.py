"""The PyTorch reference of the one step (``contract.Group``, ``contract.Dense``): decode -> rule -> encode,
written once for every rule (``rules``), and the path wherever the C and Triton kernels are not.

Per member, the elements go through in tiles of whole blocks [nb, B]: where the layout is flat (rows that
are whole blocks) as views of consecutive blocks in chunks of ``STEP_CHUNK`` elements, a short last block
as a tile of its own; rows that are not whole blocks as each row's whole blocks, then each row's short last
block (``backend_torch._row_parts``). A tile's slots are decoded, transformed, stepped by the rule,
transformed back and requantized (``backend_torch.quantize_rows``, then ``stochastic_codes`` with the
slot's uniforms for seeded slots).
"""

from __future__ import annotations

import torch

from . import backend_torch as bt
from .contract import (NONE, RATIO, SQRT, Dense, Group, is_flat, layout_rows, mix32, num_blocks, pack_codes,
                       pack_rows, slot_uniforms, unpack_codes, unpack_rows)
from .rules import MAXIMIZE, RULES


def _decoded(values: list, slots: tuple, h, decode_eps: int) -> list:
    """Stored values (qmap[code] * absmax) -> true values, by each slot's transform."""
    true = list(values)
    for j, slot in enumerate(slots):
        if slot.decode == SQRT:
            true[j] = values[j] * values[j]
        elif slot.decode == RATIO:
            true[j] = values[j] * (values[slot.divisor] + h[decode_eps])  # r * (s + eps'), in this order
    return true


def _encoded(true: tuple, slots: tuple, h, encode_eps: int) -> list:
    """True values -> the values to store, by each slot's encode transform (a ratio's divisor first)."""
    stored = list(true)
    for j, slot in enumerate(slots):
        if slot.encode_as == SQRT:
            stored[j] = bt.ieee_sqrt(true[j])
    for j, slot in enumerate(slots):
        if slot.encode_as == RATIO:
            stored[j] = true[j] / (stored[slot.divisor] + h[encode_eps])
    return stored


def step_tile(rule, flags: int, p, g, codes: list, absmax: list, slots: tuple, h, seed, index):
    """One tile of whole blocks: p, g [nb, B] (any float dtype), per slot codes int64 [nb, B] and absmax
    [nb]; ``index``: the elements' indices in the parameter (int64 [nb, B], for the hashes). Returns
    (p_new fp32 [nb, B] or None, [(codes uint8 [nb, B], absmax [nb]) per slot], d or None)."""
    fields = rule.fields
    values = [s.qmap[c] * a[:, None] for s, c, a in zip(slots, codes, absmax)]
    dec = fields.index("decode_eps") if "decode_eps" in fields else -1
    enc = fields.index("encode_eps") if "encode_eps" in fields else -1
    g = g.float()
    if flags & MAXIMIZE:
        g = -g
    p_new, true, d = rule.math(p.float(), g, _decoded(values, slots, h, dec), h, flags)
    stored = _encoded(true, slots, h, enc)
    hashes = mix32((index & 0xFFFFFFFF) ^ seed) if seed is not None else None
    new = []
    for j, (x, slot) in enumerate(zip(stored, slots)):
        c, a = bt.quantize_rows(x, slot.thresholds)
        if hashes is not None and slot.seeded:
            c = bt.stochastic_codes(x, a, c, slot.encode, slot_uniforms(hashes, j).view(x.shape))
        new.append((c, a))
    return p_new, new, d


def _flat_span(group, i: int, h, seed, lo: int, hi: int, width: int) -> None:
    """Elements [lo, hi) of member i as tiles of ``width`` (whole blocks, or one short last block), in place."""
    m, rule = group.members[i], RULES[group.rule]
    rows, b0 = (hi - lo) // width, lo // group.block_size
    stored = [c[s.bits * lo // 8 : (s.bits * hi + 7) // 8] for c, s in zip(m.codes, group.slots)]
    codes = [unpack_codes(c, hi - lo, s.bits).view(rows, width).to(torch.int64) for c, s in zip(stored, group.slots)]
    absmax = [a[b0 : b0 + rows] for a in m.absmax]
    index = torch.arange(lo, hi, dtype=torch.int64, device=m.p.device).view(rows, width)
    p_new, new, d = step_tile(rule, group.flags, m.p[lo:hi].view(rows, width), group.grads[i][lo:hi].view(rows, width),
                              codes, absmax, group.slots, h, seed, index)
    if p_new is not None:
        m.p[lo:hi].view(rows, width).copy_(p_new)
    if d is not None:
        group.outs[i][lo:hi].copy_(d.reshape(-1))
    for out, a, s, (c, scale) in zip(stored, absmax, group.slots, new):
        pack_codes(c.reshape(-1), out, s.bits)
        a.copy_(scale)


def _rows_member(group, i: int, h, seed) -> None:
    """Member i in the row layout with short blocks: each row's whole blocks, then its short last block."""
    m, rule, block = group.members[i], RULES[group.rule], group.block_size
    n_rows, length = layout_rows(m.p.numel(), m.row_len)
    p2, g2 = m.p.view(n_rows, length), group.grads[i].view(n_rows, length)
    codes = [unpack_rows(c.view(n_rows, -1), length, s.bits).to(torch.int64) for c, s in zip(m.codes, group.slots)]
    absmax = [a.view(n_rows, -1) for a in m.absmax]
    index = torch.arange(m.p.numel(), dtype=torch.int64, device=m.p.device).view(n_rows, length)
    for cols, width in bt._row_parts(length, block):
        b0, b1 = cols.start // block, num_blocks(cols.stop, block)
        part = [bt._row_blocks(c, cols, width) for c in codes]
        scales = [a[:, b0:b1].reshape(-1) for a in absmax]
        p_new, new, d = step_tile(rule, group.flags, bt._row_blocks(p2, cols, width), bt._row_blocks(g2, cols, width),
                                  part, scales, group.slots, h, seed, bt._row_blocks(index, cols, width))
        if p_new is not None:
            p2[:, cols] = p_new.view(n_rows, -1).to(m.p.dtype)
        if d is not None:
            group.outs[i].view(n_rows, length)[:, cols] = d.view(n_rows, -1)
        for c, a, (new_codes, new_absmax) in zip(codes, absmax, new):
            c[:, cols] = new_codes.view(n_rows, -1).to(torch.int64)
            a[:, b0:b1] = new_absmax.view(n_rows, -1)
    for dst, c, s in zip(m.codes, codes, group.slots):
        dst.view(n_rows, -1).copy_(pack_rows(c.to(torch.uint8), s.bits))


def step_member(group: Group, i: int) -> None:
    """Member i of the group stepped in place (its param or out, its slots' codes and scales)."""
    m = group.members[i]
    h = bt.on_device(group.hyper[i], m.p.device)
    seed = None if group.seeds is None else int(group.seeds[i])
    n, block = m.p.numel(), group.block_size
    with torch.no_grad():
        if not is_flat(n, m.row_len, block):
            _rows_member(group, i, h, seed)
            return
        full = n - n % block
        chunk = max(block, bt.STEP_CHUNK // block * block)
        for lo in range(0, full, chunk):
            _flat_span(group, i, h, seed, lo, min(full, lo + chunk), block)
        if full < n:
            _flat_span(group, i, h, seed, full, n, n - full)


def step_group(group: Group) -> None:
    """Every member stepped in turn: what every backend's step of a group must equal, bit for bit."""
    for i in range(len(group.members)):
        step_member(group, i)


def dense_group(group: Dense) -> None:
    """The rule on plain fp32 states (no codec), each member in turn, in place."""
    rule = RULES[group.rule]
    with torch.no_grad():
        for i, (p, g, states) in enumerate(zip(group.params, group.grads, group.states)):
            h = bt.on_device(group.hyper[i], p.device)
            g = g.float()
            if group.flags & MAXIMIZE:
                g = -g
            p_new, new, d = rule.math(p.float(), g, list(states), h, group.flags)
            for state, value in zip(states, new):
                state.copy_(value)
            if p_new is not None:
                p.copy_(p_new)
            if d is not None:
                group.outs[i].copy_(d.reshape(-1))


__all__ = ["step_group", "dense_group", "step_member", "step_tile", "NONE"]
