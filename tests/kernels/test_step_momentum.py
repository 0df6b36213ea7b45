"""The one-state step of one parameter (SGD, Lion, Muon: ``contract.MOMENTUM_FIELDS``; each backend's
``momentum_step`` of ``kernels/contract.py``, ``ops.momentum_step``), bit for bit.

First the PyTorch reference (``momentum_torch.momentum_step``) against the math written out plainly here
(decode, update, blockwise requantization). Then every backend against the reference, parametrized backend
x layout x width: the C builds of conftest.py's ``kernel`` fixture and the Triton kernels (the one step's
template, the interpreter on the CPU: small cases): params, codes, scales and d, over code widths 8/6/4/2,
the flat layout (and one spanning several work items of the C pool) and rows with a short last block,
fp32/bf16/fp16 params and grads, the three updates, nearest and stochastic rounding, maximize, NaN/Inf,
all-zero blocks, codes decoded on one codebook and written on another; grouped steps against their members
one by one; dispatch through ``ops`` and ``codec.grouped``.

sign(NaN): the contract says NaN; torch.sign gives 0, so the reference (``momentum_torch._sign``) keeps NaN
itself (``test_reference_sign_of_nan_is_nan``).
"""

import pytest
import torch

from ckptq.codec import codebooks, policy
from ckptq.kernels import backend_torch, contract, momentum_torch, registry, rules
from ckptq.kernels.contract import (UPDATE_LINEAR, UPDATE_NONE, UPDATE_SIGN, GroupMember, MomentumFlags,
                                    MomentumGroup, StepCodebooks, StepState, layout_blocks, layout_bytes)
from tests.kernels.cases import C_BUILDS, DEVICE, assert_same, device_of, over

QMAPS = {8: codebooks.dynamic_map(True), 6: policy.ratio_policy(6).qmap(), 4: codebooks.power_map(True, 2.5, 4),
         2: torch.tensor([-1.0, -0.2, 0.3, 1.0])}  # signed codebooks of each width

# (l2, keep, take, c_old, c_new, c_grad, decay, neg_lr) of each update
HYPER = {UPDATE_LINEAR: (0.01, 0.9, 0.875, 0.0, 0.9, 1.0, 1.0, -0.1),  # SGD, dampening, nesterov, L2
         UPDATE_SIGN: (0.0, 0.99, 0.01, 0.9, 0.0, 0.1, 0.999, -1e-3),  # Lion, decoupled decay
         UPDATE_NONE: (0.0, 0.95, 0.05, 0.0, 0.95, 0.05, 1.0, 0.0)}  # Muon, nesterov (update applied outside)
UPDATES = {"linear": UPDATE_LINEAR, "sign": UPDATE_SIGN, "none": UPDATE_NONE}

# (n, row_len, block): flat with a short last block; rows of whole blocks; rows with a short last block
# (and rows shorter than one block); flat over two work items of the C pool (backend_native.ITEM_ELEMENTS)
LAYOUTS = {"flat": (1000, None, 64), "rows-whole": (6 * 128, 128, 64), "rows-short": (5 * 100, 100, 64),
           "rows-tiny": (5 * 12, 12, 64), "flat-items": (32768 + 4077, None, 256)}


def _state(n, row_len, block, bits, gen, device, zero_block=False, qmap=None):
    qmap = QMAPS[bits] if qmap is None else qmap
    thresholds = contract.midpoints(qmap)
    m = torch.randn(n, generator=gen) * 0.1
    if zero_block:
        m[:min(block, row_len or n)] = 0.0
    codes = torch.zeros(layout_bytes(n, row_len, bits), dtype=torch.uint8)
    absmax = torch.zeros(layout_blocks(n, row_len, block), dtype=torch.float32)
    backend_torch.quantize(m, thresholds, block, False, codes, absmax, bits, row_len)
    return StepState(codes.to(device), absmax.to(device), qmap.to(device), thresholds.to(device), qmap.to(device),
                     bits)


def _case(layout, bits, pdtype, gdtype, special, seed_gen, device="cpu"):
    n, row_len, block = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed_gen)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    if special:  # NaN and Inf gradients, huge ones, a block all zero (state, grad and param)
        first = min(block, row_len or n)  # the layout's first block
        g[first + 3], g[n // 2], g[-1] = float("nan"), float("inf"), -float("inf")
        g[n // 3] = 3e38
        p[:first] = g[:first] = 0.0
    state = _state(n, row_len, block, bits, gen, device, zero_block=special)
    return p.to(pdtype).to(device), g.to(gdtype).to(device), state, (block, row_len)


def _clone(state: StepState) -> StepState:
    return state._replace(codes=state.codes.clone(), absmax=state.absmax.clone())


def _step(impl, p, g, state, update, maximize, seed, block, row_len):
    p, state = p.clone(), _clone(state)
    out = torch.full(p.shape, 7.0, dtype=torch.float32, device=p.device) if update == UPDATE_NONE else None
    h = torch.tensor(HYPER[update], dtype=torch.float32)
    impl.momentum_step(p, g, state, h, out, MomentumFlags(block, maximize, update, seed, row_len))
    return p, state.codes, state.absmax, out


def _assert_results(got, want, skip_p=None):
    for i, (a, b) in enumerate(zip(got, want)):
        if a is None or b is None:
            assert a is None and b is None
        elif i == 0 and skip_p is not None:  # p where the reference's sign(NaN) differs: compared apart
            assert_same(a.cpu()[~skip_p], b[~skip_p])
        else:
            assert_same(a.cpu(), b)


def _nan_direction(p, g, state, update, maximize, block, row_len):
    """The elements whose d is NaN (UPDATE_SIGN: where the reference's torch.sign gives 0, not NaN)."""
    if update != UPDATE_SIGN:
        return None
    out = torch.empty(p.shape, dtype=torch.float32, device=p.device)
    h = torch.tensor(HYPER[update], dtype=torch.float32)
    momentum_torch.momentum_step(p.clone(), g, _clone(state), h, out, MomentumFlags(block, maximize, update, None,
                                                                                   row_len))
    return torch.isnan(out)


# ---- the reference against the math written out plainly ----

def _plain(p, g, state: StepState, h, maximize, update, block, row_len):
    """The one-state step in plain torch on [rows, row_len]: the decoded old state, p, d and m_new."""
    n = p.numel()
    rows, length = contract.layout_rows(n, row_len)
    codes = contract.unpack_rows(state.codes.view(rows, -1), length, state.bits).long()
    col_block = torch.arange(length) // block
    scale = state.absmax.view(rows, -1)[:, col_block]
    m = state.qmap[codes] * scale
    pf, gf = p.float().view(rows, length), g.float().view(rows, length)
    gi = (-gf if maximize else gf) + h[0] * pf
    m_new = m * h[1] + h[2] * gi
    d = (m * h[3] + m_new * h[4]) + gi * h[5]
    step = torch.where(torch.isnan(d), d, torch.sign(d)) if update == UPDATE_SIGN else d
    p_new = pf * h[6] + h[7] * step if update != UPDATE_NONE else pf
    return p_new.reshape(-1), d.reshape(-1), m_new, col_block


@pytest.mark.parametrize("bits", (8, 4, 2))
@pytest.mark.parametrize("layout", ("flat", "rows-short"))
@pytest.mark.parametrize("update", (UPDATE_LINEAR, UPDATE_SIGN, UPDATE_NONE))
@pytest.mark.parametrize("seed", (None, 12345))
def test_reference_equals_the_plain_math(bits, layout, update, seed):
    """p and d exactly; each block's new scale is max |m_new| over it; the decoded new state lies within
    half the largest codebook gap (a whole gap when rounding stochastically; or the distance from +-1 to
    the codebook's ends) times that scale of m_new."""
    p, g, state, (block, row_len) = _case(layout, bits, torch.float32, torch.float32, False, bits + update)
    h = torch.tensor(HYPER[update], dtype=torch.float32)
    want_p, want_d, m_new, col_block = _plain(p, g, state, h, False, update, block, row_len)
    got_p, codes, absmax, out = _step(momentum_torch, p, g, state, update, False, seed, block, row_len)
    assert torch.equal(got_p, want_p)
    if update == UPDATE_NONE:
        assert torch.equal(out, want_d)
    rows, length = m_new.shape
    scales = absmax.view(rows, -1)
    want_scales = torch.stack([m_new[:, col_block == j].abs().amax(1) for j in range(scales.shape[1])], 1)
    assert torch.equal(scales, want_scales)
    decoded = state.qmap[contract.unpack_rows(codes.view(rows, -1), length, bits).long()] * scales[:, col_block]
    q = state.qmap
    gap = float((q[1:] - q[:-1]).max()) / (1 if seed is not None else 2)
    ends = max(1 + float(q[0]), 1 - float(q[-1]))  # y in [-1, 1] may lie beyond the codebook's ends
    bound = max(gap, ends) * scales[:, col_block] * 1.0001  # and fp32 rounding
    assert bool(((decoded - m_new).abs() <= bound).all())


def test_reference_stochastic_rounding_is_unbiased():
    """Averaged over many seeds, the decoded state lies far closer to m_new than round-to-nearest's."""
    p, g, state, (block, row_len) = _case("flat", 2, torch.float32, torch.float32, False, 5)
    h = torch.tensor(HYPER[UPDATE_LINEAR], dtype=torch.float32)
    _, _, m_new, _ = _plain(p, g, state, h, False, UPDATE_LINEAR, block, row_len)

    def decoded(seed):
        _, codes, absmax, _ = _step(momentum_torch, p, g, state, UPDATE_LINEAR, False, seed, block, row_len)
        return state.qmap[contract.unpack_codes(codes, p.numel(), 2).long()] * absmax.repeat_interleave(block)[:p.numel()]

    mean = sum(decoded(seed) for seed in range(64)) / 64
    nearest = (decoded(None) - m_new.view(-1)).abs().mean()
    assert float((mean - m_new.view(-1)).abs().mean()) < 0.3 * float(nearest)


def test_reference_sign_of_nan_is_nan():
    d = torch.tensor([float("nan"), 1.0, -1.0, 0.0])
    assert bool(torch.isnan(momentum_torch._sign(d)[0])) and momentum_torch._sign(d)[1:].tolist() == [1.0, -1.0, 0.0]


# ---- every backend against the reference ----

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (param dtype, grad dtype, maximize, special values, data seed): three variants per C case (data seed
# 100 * bits + k); one per Triton case (data seed: bits)
def c_variants(bits: int) -> tuple:
    return ((F32, F32, False, False, 100 * bits), (BF16, BF16, True, False, 100 * bits + 1),
            (F16, F32, False, True, 100 * bits + 2))


STEP_CASES = (
    [("native", bits, layout, update, seed, c_variants(bits)) for bits in (8, 6, 4, 2)
     for layout in ("flat", "rows-whole", "rows-short", "rows-tiny") for update in ("linear", "sign", "none")
     for seed in (None, 0xDEADBEEF)]
    + [(b, bits, "flat-items", update, seed, ((BF16, F32, False, False, bits),)) for b in C_BUILDS
       for bits in (8, 6, 4, 2) for update in ("linear", "sign") for seed in (None, 7)]
    + [("triton", 8, "flat", "linear", None, ((F32, F32, False, False, 8),)),
       ("triton", 6, "rows-short", "sign", 99, ((BF16, BF16, True, False, 6),)),
       ("triton", 4, "rows-tiny", "none", 3, ((F16, F16, False, True, 4),)),
       ("triton", 2, "rows-whole", "sign", None, ((F32, F32, False, True, 2),)),
       ("triton", 4, "flat", "linear", 0xFFFFFFFF, ((BF16, BF16, True, True, 4),))])
STEP_IDS = [f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{c[4]}-" + "+".join(
    f"{str(v[0])[6:]}{'' if v[1] == v[0] else '-' + str(v[1])[6:]}{'-max' if v[2] else ''}{'-special' if v[3] else ''}"
    for v in c[5]) for c in STEP_CASES]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN and Inf
@over("bits,layout,update,seed,variants", STEP_CASES, ids=STEP_IDS)
def test_step_matches_reference(kernel, bits, layout, update, seed, variants):
    impl, update = registry.backend(kernel), UPDATES[update]
    for pdtype, gdtype, maximize, special, data_seed in variants:
        p, g, state, (block, row_len) = _case(layout, bits, pdtype, gdtype, special, data_seed)
        skip = _nan_direction(p, g, state, update, maximize, block, row_len) if special else None
        want = _step(momentum_torch, p, g, state, update, maximize, seed, block, row_len)
        dev = device_of(kernel)
        state = state._replace(**{k: getattr(state, k).to(dev) for k in ("codes", "absmax", "qmap", "thresholds", "encode")})
        got = _step(impl, p.to(dev), g.to(dev), state, update, maximize, seed, block, row_len)
        _assert_results(got, want, skip)
        if skip is not None and bool(skip.any()):  # the contract's sign(NaN) = NaN: p becomes NaN there
            assert bool(torch.isnan(got[0].cpu()[skip]).all())


OTHER = {8: codebooks.power_map(True, 2.5, 8), 6: codebooks.lloyd_gaussian_map_6bit(),
         4: policy.ratio_policy(4).qmap(), 2: torch.tensor([-1.0, -0.3, 0.2, 1.0])}


@over("bits", [("native", bits) for bits in (8, 6, 4, 2)])
def test_decodes_and_encodes_on_different_codebooks(kernel, bits):
    """Stored codes on one codebook (qmap), new ones written on another (encode, its thresholds)."""
    other = OTHER[bits] / OTHER[bits].abs().max()
    for seed in (None, 11):
        p, g, state, (block, row_len) = _case("rows-short", bits, torch.float32, torch.float32, False, bits)
        state = state._replace(thresholds=contract.midpoints(other), encode=other)
        want = _step(momentum_torch, p, g, state, UPDATE_LINEAR, False, seed, block, row_len)
        got = _step(registry.backend(kernel), p, g, state, UPDATE_LINEAR, False, seed, block, row_len)
        _assert_results(got, want)


# ---- grouped one-state steps against their members one by one ----

def _group(members_spec, bits, update, maximize, seeded, device="cpu", pdtype=torch.float32):
    """A MomentumGroup of members (n, row_len) sharing one block size of 64 and one codebook."""
    gen = torch.Generator().manual_seed(len(members_spec) + bits)
    block, qmap = 64, QMAPS[bits].to(device)
    books = StepCodebooks(qmap, contract.midpoints(qmap), qmap)
    members, grads, outs = [], [], []
    for n, row_len in members_spec:
        state = _state(n, row_len, block, bits, gen, device, qmap=qmap)
        p = torch.randn(n, generator=gen).to(pdtype).to(device)
        members.append(GroupMember(p, (state.codes,), (state.absmax,), row_len))
        grads.append(torch.randn(n, generator=gen).to(device))
        if update == UPDATE_NONE:
            outs.append(torch.zeros(n, device=device))
    hyper = torch.tensor([HYPER[update]] * len(members_spec), dtype=torch.float32)
    hyper[:, 1] += torch.arange(len(members_spec)) * 0.01  # a hyper row per member
    seeds = torch.arange(len(members_spec), dtype=torch.int64) * 0x9E3779B9 % 2**32 if seeded else None
    return MomentumGroup(tuple(members), tuple(grads), tuple(outs), hyper, seeds, books, bits, block, maximize, update,
                         {})


def _clone_group(group: MomentumGroup) -> MomentumGroup:
    members = tuple(m._replace(p=m.p.clone(), codes=tuple(c.clone() for c in m.codes),
                               absmax=tuple(a.clone() for a in m.absmax)) for m in group.members)
    return group._replace(members=members, outs=tuple(o.clone() for o in group.outs), cache={})


def _assert_groups(got: MomentumGroup, want: MomentumGroup):
    for a, b in zip(got.members, want.members):
        assert_same(a.p, b.p)
        assert_same(a.codes[0], b.codes[0])
        assert_same(a.absmax[0], b.absmax[0])
    for a, b in zip(got.outs, want.outs):
        assert_same(a, b)


GROUP_SPECS = ((100, None), (12 * 20, 20), (3 * 150, 150), (1, None), (0, None), (5 * 33, 33))


def _as_group(group: MomentumGroup) -> contract.Group:
    """The same step as the one step's ``contract.Group`` (the rule ``momentum``, its update a switch)."""
    update = {UPDATE_LINEAR: rules.MOMENTUM.flag("linear"), UPDATE_SIGN: rules.MOMENTUM.flag("sign")}.get(group.update, 0)
    books = group.codebooks
    slot = contract.Slot(books.qmap, books.thresholds, books.encode, group.bits, contract.NONE, contract.NONE)
    return contract.Group("momentum", update | (rules.MAXIMIZE if group.maximize else 0), group.members, group.grads,
                          group.outs, group.hyper, group.seeds, (slot,), group.block_size, group.cache)


GROUP_CASES = [("native", 8, "linear", False, False), ("native", 4, "sign", True, True),
               ("native", 6, "none", False, True), ("native", 2, "linear", True, False),
               ("triton", 8, "sign", False, True), ("triton", 4, "none", True, False)]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@over("bits,update,maximize,seeded", GROUP_CASES)
def test_group_matches_members(kernel, bits, update, maximize, seeded):
    """The C kernels: the one step on the group (``backend_native.step``) equals the reference's one-state step
    of each member in turn, twice on one cache. Triton: the older grouped contract (``grouped.momentum_group``),
    each member through ``backend_triton.momentum_step``, a group of one of the one step's template."""
    from ckptq.codec import grouped

    update = UPDATES[update]
    if kernel == "triton":
        group = _group(GROUP_SPECS[:4], bits, update, maximize, seeded, DEVICE, torch.bfloat16)
        want, got = _clone_group(group), _clone_group(group)
        momentum_torch.momentum_step_group(want)
        grouped.momentum_group(got, "triton")
        _assert_groups(got, want)
        return
    backend_native = registry.backend("native")
    group = _group(GROUP_SPECS, bits, update, maximize, seeded, pdtype=torch.bfloat16)
    want, got = _clone_group(group), _clone_group(group)
    momentum_torch.momentum_step_group(want)
    backend_native.step(_as_group(got))
    _assert_groups(got, want)
    grads = tuple(g * -0.5 for g in group.grads)  # again, from its cache, with new grads
    want, got = want._replace(grads=grads), got._replace(grads=grads)
    backend_native.step(_as_group(got))
    momentum_torch.momentum_step_group(want)
    _assert_groups(got, want)


@over("bits", [("native", 4)])
def test_ops_and_grouped_steps_dispatch_to_the_c_kernels(kernel, bits):
    from ckptq.codec import grouped, ops

    backend_native = registry.backend("native")
    p, g, state, (block, row_len) = _case("rows-short", bits, torch.bfloat16, torch.bfloat16, False, 1)
    assert ops.momentum_backend("native", (p.dtype, g.dtype), state.thresholds, False) is backend_native
    results = []
    for backend in ("torch", "native"):
        q, s = p.clone(), _clone(state)
        ops.momentum_step(q, g, ops.StepInput(s.codes, s.absmax, s.qmap, s.encode), torch.tensor(HYPER[UPDATE_SIGN]),
                          block_size=block, bits=bits, update=UPDATE_SIGN, seed=5, row_len=row_len, backend=backend)
        results.append((q, s.codes, s.absmax))
    _assert_results(results[1], results[0])
    group = _group(GROUP_SPECS, 6, UPDATE_NONE, True, True)
    want, got = _clone_group(group), _clone_group(group)
    grouped.momentum_group(want, "torch")
    grouped.momentum_group(got, "native")
    _assert_groups(got, want)
