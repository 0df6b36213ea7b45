"""The one step in Triton (``contract.Group``: decode -> rule -> encode; ``contract.Dense``: the rule on fp32
states): one kernel template each, compiled per rule, flag word and slot shape, bit for bit as
``step_torch.step_group`` / ``dense_group``. The host side (tables, cache, launches) is ``triton_group``.

A rule is a ``@triton.jit`` function below, op for op the torch function of the same name in ``rules``::

    rule(p, g, s, h, FLAGS) -> (p_new, s_new, d)
        p, g    fp32 [ROWS, BLOCK] (or [TILE]): the parameter and the gradient (already negated for MAXIMIZE)
        s       a tuple of fp32 tiles: the states' true values (decoded and transformed), in slot order
        h       pointer to the member's fp32 scalars, ``rules.Rule.fields`` in order (field k at h + k)
        FLAGS   constexpr: ``rules.MAXIMIZE`` | the rule's switches
        returns the new parameter (ignored where the rule writes a direction), the tuple of the states' new
        true values, and the direction d (written to ``out`` where ``rules.writes_direction``; else any tile)

Each product, quotient, sum and square root rounded once, in the reference's order: ``tl.math.div_rn`` and
``sqrt_rn`` (``/`` and ``tl.sqrt`` are approximate on CUDA), launched with ``enable_fp_fusion=False`` (no
FMA). A rule returns once, at its end, and its constexpr branches assign (Triton 3.9 miscompiles returns
of tuples of different lengths under them); it tests a switch as ``_SWITCH & FLAGS`` (the interpreter has no
int & constexpr). Adding a rule to this backend: its function here and its entry in ``RULES``.

The template (``_step_kernel``) reads a chunk row (member, first block, blocks), the member's addresses from
the device tables (``triton_group``), decodes each slot of the tile (``SLOTS``: ``SlotShape`` per slot, its
width and transforms), applies ``RULE``, stores p (or d), and encodes each slot: a new scale per block,
codes to nearest, or stochastically for a slot whose ``stochastic`` is set, with slot j's uniforms
(``contract.slot_uniforms``) from one hash per element.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from . import rules
from . import triton_blocks as tb
from .contract import RATIO, SQRT

BOOK = 256  # entries per codebook in the books table (the 8-bit size; narrower codebooks padded)
_BOOK = tl.constexpr(BOOK)

# the rules' switches (``rules.Rule.flags``) and the transforms, as constexprs (the only globals a kernel reads)
_AMSGRAD = tl.constexpr(rules.ADAM.flag("amsgrad"))
_LINEAR = tl.constexpr(rules.MOMENTUM.flag("linear"))
_SIGN = tl.constexpr(rules.MOMENTUM.flag("sign"))
_HEAVY = tl.constexpr(rules.RMSPROP.flag("heavy"))
_CENTERED = tl.constexpr(rules.RMSPROP.flag("centered"))
_MAXIMIZE = tl.constexpr(rules.MAXIMIZE)
_SQRT = tl.constexpr(SQRT)
_RATIO = tl.constexpr(RATIO)


class SlotShape(NamedTuple):
    """A slot as its kernel is compiled (``contract.Slot`` without its codebooks), a constexpr."""

    bits: int
    decode: int  # the stored codes' transform: contract.NONE, SQRT or RATIO
    encode: int  # the new codes' transform
    divisor: int  # RATIO: the slot it is relative to
    stochastic: bool  # rounds stochastically (a seeded slot of a group with seeds)


# ---- the rules (``rules``), op for op ----

@triton.jit
def _adam_moments(p, g, m, v, h):
    # rules._adam_moments: (gi, m, v)
    gi = g + tl.load(h + 1) * p
    return gi, m + tl.load(h + 2) * (gi - m), v * tl.load(h + 3) + tl.load(h + 4) * (gi * gi)


@triton.jit
def _adam_denominator(v, h):
    # sqrt(v) / bc2_sqrt + eps
    return tl.math.div_rn(tl.math.sqrt_rn(v), tl.load(h + 7)) + tl.load(h + 5)


@triton.jit
def adam(p, g, s, h, FLAGS: tl.constexpr):
    # rules.adam: AMSGRAD puts the running max of v (s[2]; NaN where either is, as torch.maximum) below m
    gi, m, v = _adam_moments(p, g, s[0], s[1], h)
    new = (m, v)
    top = v
    if _AMSGRAD & FLAGS:
        top = tl.maximum(s[2], v, propagate_nan=tl.PropagateNan.ALL)
        new = (m, v, top)
    p = p * tl.load(h) + tl.load(h + 6) * tl.math.div_rn(m, _adam_denominator(top, h))
    return p, new, p


@triton.jit
def nadam(p, g, s, h, FLAGS: tl.constexpr):
    # rules.nadam
    gi, m, v = _adam_moments(p, g, s[0], s[1], h)
    denom = _adam_denominator(v, h)
    p = (p * tl.load(h) + tl.load(h + 10) * tl.math.div_rn(gi, denom)) + tl.load(h + 6) * tl.math.div_rn(m, denom)
    return p, (m, v), p


@triton.jit
def radam(p, g, s, h, FLAGS: tl.constexpr):
    # rules.radam: the rectified step where ``rectify`` (field 10) is nonzero, else the momentum step
    gi, m, v = _adam_moments(p, g, s[0], s[1], h)
    step = tl.where(tl.load(h + 10) != 0, tl.math.div_rn(m, _adam_denominator(v, h)), m)
    p = p * tl.load(h) + tl.load(h + 6) * step
    return p, (m, v), p


@triton.jit
def ademamix(p, g, s, h, FLAGS: tl.constexpr):
    # rules.ademamix: states (m1, m2, nu)
    m1 = s[0] + tl.load(h + 1) * (g - s[0])
    m2 = s[1] + tl.load(h + 2) * (g - s[1])
    nu = s[2] * tl.load(h + 3) + tl.load(h + 4) * (g * g)
    mix = tl.math.div_rn(m1, tl.load(h + 8)) + tl.load(h + 9) * m2
    p = p * tl.load(h) + tl.load(h + 6) * tl.math.div_rn(mix, _adam_denominator(nu, h))
    return p, (m1, m2, nu), p


@triton.jit
def momentum(p, g, s, h, FLAGS: tl.constexpr):
    # rules.momentum: LINEAR applies d, SIGN its sign (NaN kept), neither leaves d to out
    m = s[0]
    gi = g + tl.load(h) * p
    m_new = m * tl.load(h + 1) + tl.load(h + 2) * gi
    d = (m * tl.load(h + 3) + m_new * tl.load(h + 4)) + gi * tl.load(h + 5)
    if _LINEAR & FLAGS:
        p = p * tl.load(h + 6) + tl.load(h + 7) * d
    elif _SIGN & FLAGS:
        p = p * tl.load(h + 6) + tl.load(h + 7) * tb.sign_of(d)
    return p, (m_new,), d


@triton.jit
def rmsprop(p, g, s, h, FLAGS: tl.constexpr):
    # rules.rmsprop: states v[, buf (HEAVY)][, grad_avg (CENTERED)]
    gi = g + tl.load(h) * p
    v = s[0] * tl.load(h + 1) + tl.load(h + 2) * (gi * gi)
    new = (v,)
    if _CENTERED & FLAGS:
        ga = s[1]
        if _HEAVY & FLAGS:
            ga = s[2]
        ga = ga + tl.load(h + 2) * (gi - ga)
        var = v - ga * ga
        avg = tl.math.sqrt_rn(tl.where(var < 0, 0.0, var)) + tl.load(h + 3)  # as rules.rmsprop: low-bit v, ga cross
    else:
        avg = tl.math.sqrt_rn(v) + tl.load(h + 3)
    if _HEAVY & FLAGS:
        buf = s[1] * tl.load(h + 5) + tl.math.div_rn(gi, avg)
        new = new + (buf,)
        p = p + tl.load(h + 4) * buf
    else:
        p = p + tl.load(h + 4) * tl.math.div_rn(gi, avg)
    if _CENTERED & FLAGS:
        new = new + (ga,)
    return p, new, p


@triton.jit
def adagrad(p, g, s, h, FLAGS: tl.constexpr):
    # rules.adagrad
    gi = g + tl.load(h) * p
    acc = s[0] + gi * gi
    p = p + tl.load(h + 1) * tl.math.div_rn(gi, tl.math.sqrt_rn(acc) + tl.load(h + 2))
    return p, (acc,), p


RULES = {"adam": adam, "nadam": nadam, "radam": radam, "ademamix": ademamix, "momentum": momentum,
         "rmsprop": rmsprop, "adagrad": adagrad}  # rules.RULES' names -> their Triton functions


# ---- the template ----

@triton.jit
def _pointer(table, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    # the int64 address at table as a pointer to DTYPE; ALIGNED: the address is a multiple of 16, which the
    # compiler cannot know of a loaded value and needs for vector loads (the hint must sit on the load)
    pointer = tl.load(table).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def _param_and_gradient(p_ptr, g_ptr, offs, mask, FLAGS: tl.constexpr):
    # p and g of a tile in fp32, g negated for MAXIMIZE
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if _MAXIMIZE & FLAGS:
        g = -g
    return p, g


@triton.jit
def _true_values(stored, h, SLOTS: tl.constexpr, DEC_EPS: tl.constexpr):
    # step_torch._decoded: stored values (qmap[code] * scale) -> true values by each slot's transform
    true = ()
    for j in tl.static_range(len(SLOTS)):
        x = stored[j]
        if _SQRT == SLOTS[j].decode:
            x = x * x
        elif _RATIO == SLOTS[j].decode:
            x = x * (stored[SLOTS[j].divisor] + tl.load(h + DEC_EPS))  # r * (s + eps'), in this order
        true = true + (x,)
    return true


@triton.jit
def _stored_values(true, h, SLOTS: tl.constexpr, ENC_EPS: tl.constexpr):
    # step_torch._encoded: true values -> the values to store (square roots first: a ratio's divisor)
    roots = ()
    for j in tl.static_range(len(SLOTS)):
        x = true[j]
        if _SQRT == SLOTS[j].encode:
            x = tl.math.sqrt_rn(x)
        roots = roots + (x,)
    stored = ()
    for j in tl.static_range(len(SLOTS)):
        x = roots[j]
        if _RATIO == SLOTS[j].encode:
            x = tl.math.div_rn(true[j], roots[SLOTS[j].divisor] + tl.load(h + ENC_EPS))
        stored = stored + (x,)
    return stored


@triton.jit
def _decoded(codes_at, scales_at, books, tile, SLOTS: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    # each slot's stored values qmap[code] * scale, fp32 [ROWS, BLOCK] (absent lanes 0); tile: the
    # geometry's (b, bmask, r, col0, mask, row_len)
    b, bmask, r, col0, mask, row_len = tile
    stored = ()
    for j in tl.static_range(len(SLOTS)):
        stored = stored + (tb.decode(codes_at[j], scales_at[j], books + _BOOK * (3 * j), b, bmask, r, col0, mask,
                                     row_len, BLOCK, SLOTS[j].bits, ALIGNED),)
    return stored


@triton.jit
def _encode(stored, hashes, codes_at, scales_at, books, tile, SLOTS: tl.constexpr, BLOCK: tl.constexpr,
            ROWS: tl.constexpr, ALIGNED: tl.constexpr):
    # each slot's values to store, requantized into its codes and scales: a new scale per block, codes to
    # nearest, or stochastically with the slot's uniforms from the elements' hashes (uint32)
    b, bmask, r, col0, mask, row_len = tile
    for j in tl.static_range(len(SLOTS)):
        x = stored[j]
        codes, absmax = tb.encode(x, mask, books + _BOOK * (3 * j + 1), SLOTS[j].bits)
        if SLOTS[j].stochastic:
            codes = tb.stochastic(codes, x, absmax, books + _BOOK * (3 * j + 2), tb.uniform(hashes, j), SLOTS[j].bits)
        tb.store(codes, absmax, codes_at[j], scales_at[j], b, bmask, r, col0, mask, row_len, BLOCK, ROWS,
                 SLOTS[j].bits, ALIGNED)


@triton.jit
def _step_kernel(
    chunks,  # int64 [programs, 3]: (member, first block, blocks) of each program's tile
    members,  # int64 [T, 2 + 2 * len(SLOTS)]: addresses of p, then each slot's codes and scales; then row_len
    calls,  # int64 [T, 2]: addresses of the gradient and of the fp32 out (read only when OUT)
    hyper,  # fp32 [T, FIELDS]: the rule's scalars per member
    seeds,  # int64 [T]: uint32 seeds (read only where a slot rounds stochastically)
    books,  # fp32 [len(SLOTS), 3, BOOK]: per slot its decode map, the search tree of its encode map's
    #         midpoints (triton_blocks.search_tree), its encode map
    p_like, g_like,  # a param and a grad of the group: their dtypes
    RULE: tl.constexpr,  # the rule: a function of RULES
    FLAGS: tl.constexpr,  # rules.MAXIMIZE | the rule's switches
    FIELDS: tl.constexpr,  # len(rule.fields)
    SLOTS: tl.constexpr,  # SlotShape per slot
    DEC_EPS: tl.constexpr, ENC_EPS: tl.constexpr,  # the fields of decode_eps / encode_eps (ratio slots)
    OUT: tl.constexpr,  # the rule writes its direction to out and leaves p alone
    STOCHASTIC: tl.constexpr,  # some slot rounds stochastically
    BLOCK: tl.constexpr, ROWS: tl.constexpr,  # the tile: ROWS blocks of BLOCK lanes (triton_blocks.tile_shape)
    ALIGNED: tl.constexpr,  # every param, grad, out and codes address 16-byte aligned, every row_len a multiple of 16
):
    chunk = chunks + tl.program_id(0).to(tl.int64) * 3
    i = tl.load(chunk)
    row = members + i * (2 + 2 * len(SLOTS))
    row_len = tl.load(row + 1 + 2 * len(SLOTS))
    if ALIGNED:  # here, on the load: a hint on a jit function's argument is lost
        row_len = tl.multiple_of(row_len, 16)
    b, bmask, r, col0, offs, mask = tb.geometry(tl.load(chunk + 1), tl.load(chunk + 2), row_len, BLOCK, ROWS)
    h = hyper + i * FIELDS
    p_ptr = _pointer(row, p_like.dtype.element_ty, ALIGNED)
    p, g = _param_and_gradient(p_ptr, _pointer(calls + 2 * i, g_like.dtype.element_ty, ALIGNED), offs, mask, FLAGS)
    codes_at, scales_at = (), ()  # each slot's codes and scales
    for j in tl.static_range(len(SLOTS)):
        codes_at = codes_at + (_pointer(row + 1 + 2 * j, tl.uint8, ALIGNED),)
        scales_at = scales_at + (_pointer(row + 2 + 2 * j, tl.float32, False),)
    tile = (b, bmask, r, col0, mask, row_len)
    stored = _decoded(codes_at, scales_at, books, tile, SLOTS, BLOCK, ALIGNED)
    p, new, d = RULE(p, g, _true_values(stored, h, SLOTS, DEC_EPS), h, FLAGS)
    if OUT:
        tl.store(_pointer(calls + 2 * i + 1, tl.float32, ALIGNED) + offs, d, mask=mask)
    else:
        tl.store(p_ptr + offs, tb.cast_to(p, p_ptr.dtype.element_ty), mask=mask)
    hashes = offs.to(tl.uint32)  # read only where a slot rounds stochastically
    if STOCHASTIC:
        hashes = tb.mix32(hashes ^ tl.load(seeds + i).to(tl.uint32))  # one per element for every slot
    _encode(_stored_values(new, h, SLOTS, ENC_EPS), hashes, codes_at, scales_at, books, tile, SLOTS, BLOCK, ROWS,
            ALIGNED)

@triton.jit
def _dense_kernel(
    chunks,  # int64 [programs, 3]: (member, first element, elements) of each program's tile
    members,  # int64 [T, 1 + STATES]: addresses of p, then of each fp32 state
    calls,  # int64 [T, 2]: addresses of the gradient and of the fp32 out (read only when OUT)
    hyper,  # fp32 [T, FIELDS]: the rule's scalars per member
    p_like, g_like,  # a param and a grad of the group: their dtypes
    RULE: tl.constexpr, FLAGS: tl.constexpr, FIELDS: tl.constexpr, OUT: tl.constexpr,  # as _step_kernel's
    STATES: tl.constexpr,  # states per member
    TILE: tl.constexpr,  # elements per program
    ALIGNED: tl.constexpr,  # every address 16-byte aligned, every member's size a multiple of 16
):
    chunk = chunks + tl.program_id(0).to(tl.int64) * 3
    i = tl.load(chunk)
    row = members + i * (1 + STATES)
    first, count = tl.load(chunk + 1), tl.load(chunk + 2)
    if ALIGNED:
        first, count = tl.multiple_of(first, 16), tl.multiple_of(count, 16)
    offs = first + tl.arange(0, TILE)
    mask = tl.arange(0, TILE) < count
    h = hyper + i * FIELDS
    p_ptr = _pointer(row, p_like.dtype.element_ty, ALIGNED)
    p, g = _param_and_gradient(p_ptr, _pointer(calls + 2 * i, g_like.dtype.element_ty, ALIGNED), offs, mask, FLAGS)
    s = ()
    for j in tl.static_range(STATES):
        s = s + (tl.load(_pointer(row + 1 + j, tl.float32, ALIGNED) + offs, mask=mask, other=0.0),)
    p, new, d = RULE(p, g, s, h, FLAGS)
    for j in tl.static_range(STATES):
        tl.store(_pointer(row + 1 + j, tl.float32, ALIGNED) + offs, new[j], mask=mask)
    if OUT:
        tl.store(_pointer(calls + 2 * i + 1, tl.float32, ALIGNED) + offs, d, mask=mask)
    else:
        tl.store(p_ptr + offs, tb.cast_to(p, p_ptr.dtype.element_ty), mask=mask)
