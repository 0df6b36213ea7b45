"""The one-state step (SGD, Lion, Muon: ``contract.MOMENTUM_FIELDS``) of every backend, bit for bit.

First the PyTorch reference (``momentum_torch.momentum_step``) against the math written out plainly here
(decode, update, blockwise requantization). Then the C kernels (``backend_native``: this CPU's build and
a portable scalar one) and the Triton kernels (``backend_triton``: the one step's template, the interpreter on
the CPU) against the reference: params, codes, scales and d, over code widths 8/6/4/2, the flat layout
and rows with a short last block, fp32/bf16/fp16 params and grads, the three updates, nearest and
stochastic rounding, maximize, NaN/Inf, all-zero blocks; grouped steps against their members one by one.

sign(NaN): the contract says NaN; torch.sign gives 0, so the reference (``momentum_torch._sign``) keeps NaN
itself (``test_reference_sign_of_nan_is_nan``).
"""

import os
import subprocess
import sys

import pytest
import torch

from ckptq.codec import codebooks, policy
from ckptq.kernels import backend_torch, contract, momentum_torch, native, rules
from ckptq.kernels.contract import (UPDATE_LINEAR, UPDATE_NONE, UPDATE_SIGN, GroupMember, MomentumFlags,
                                    MomentumGroup, StepCodebooks, StepState, layout_blocks, layout_bytes)
from tests.helpers.paths import ROOT
from tests.kernels.test_native import _assert_same, build  # noqa: F401  (build: the C builds fixture)

needs_c = pytest.mark.skipif(native.library() is None, reason=f"C kernels unavailable: {native.why_unavailable()}")
ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return ON_CUDA or os.environ.get("TRITON_INTERPRET") == "1"


needs_triton = pytest.mark.skipif(not _triton_ok(), reason="triton needs CUDA or TRITON_INTERPRET=1")

QMAPS = {8: codebooks.dynamic_map(True), 6: policy.ratio_policy(6).qmap(), 4: codebooks.power_map(True, 2.5, 4),
         2: torch.tensor([-1.0, -0.2, 0.3, 1.0])}  # signed codebooks of each width

# (l2, keep, take, c_old, c_new, c_grad, decay, neg_lr) of each update
HYPER = {UPDATE_LINEAR: (0.01, 0.9, 0.875, 0.0, 0.9, 1.0, 1.0, -0.1),  # SGD, dampening, nesterov, L2
         UPDATE_SIGN: (0.0, 0.99, 0.01, 0.9, 0.0, 0.1, 0.999, -1e-3),  # Lion, decoupled decay
         UPDATE_NONE: (0.0, 0.95, 0.05, 0.0, 0.95, 0.05, 1.0, 0.0)}  # Muon, nesterov (update applied outside)

# (n, row_len, block): flat with a short last block; rows of whole blocks; rows with a short last block
# (and rows shorter than one block)
LAYOUTS = {"flat": (1000, None, 64), "rows-whole": (6 * 128, 128, 64), "rows-short": (5 * 100, 100, 64),
           "rows-tiny": (5 * 12, 12, 64)}


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
            _assert_same(a[~skip_p], b[~skip_p])
        else:
            _assert_same(a, b)


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


# ---- the C kernels ----

if native.library() is not None:
    from ckptq.kernels import backend_native
DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32))


@needs_c
@pytest.mark.parametrize("bits", (8, 6, 4, 2))
@pytest.mark.parametrize("layout", tuple(LAYOUTS))
@pytest.mark.parametrize("update", (UPDATE_LINEAR, UPDATE_SIGN, UPDATE_NONE))
@pytest.mark.parametrize("seed", (None, 0xDEADBEEF))
def test_native_matches_reference(bits, layout, update, seed):
    for k, (pdtype, gdtype) in enumerate(DTYPES):
        maximize, special = k == 1, k == 2
        p, g, state, (block, row_len) = _case(layout, bits, pdtype, gdtype, special, 100 * bits + k)
        skip = _nan_direction(p, g, state, update, maximize, block, row_len) if special else None
        want = _step(momentum_torch, p, g, state, update, maximize, seed, block, row_len)
        got = _step(backend_native, p, g, state, update, maximize, seed, block, row_len)
        _assert_results(got, want, skip)
        if skip is not None and bool(skip.any()):  # the contract's sign(NaN) = NaN: p becomes NaN there
            assert bool(torch.isnan(got[0][skip]).all())


@needs_c
@pytest.mark.parametrize("bits", (8, 6, 4, 2))
@pytest.mark.parametrize("update", (UPDATE_LINEAR, UPDATE_SIGN))
def test_every_build_matches_reference(bits, update, build):  # noqa: F811
    """This CPU's build, a portable one (scalar loops only) and an AVX-512 one without VBMI, on a size
    that spans several work items of the pool."""
    n, block = 32768 + 4077, 256  # two work items of the pool (backend_native.ITEM_ELEMENTS)
    gen = torch.Generator().manual_seed(bits)
    p, g = torch.randn(n, generator=gen).to(torch.bfloat16), torch.randn(n, generator=gen)
    state = _state(n, None, block, bits, gen, "cpu")
    for seed in (None, 7):
        want = _step(momentum_torch, p, g, state, update, False, seed, block, None)
        got = _step(backend_native, p, g, state, update, False, seed, block, None)
        _assert_results(got, want)


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
        _assert_same(a.p, b.p)
        _assert_same(a.codes[0], b.codes[0])
        _assert_same(a.absmax[0], b.absmax[0])
    for a, b in zip(got.outs, want.outs):
        _assert_same(a, b)


GROUP_SPECS = ((100, None), (12 * 20, 20), (3 * 150, 150), (1, None), (0, None), (5 * 33, 33))


def _as_group(group: MomentumGroup) -> contract.Group:
    """The same step as the one step's ``contract.Group`` (the rule ``momentum``, its update a switch)."""
    update = {UPDATE_LINEAR: rules.MOMENTUM.flag("linear"), UPDATE_SIGN: rules.MOMENTUM.flag("sign")}.get(group.update, 0)
    books = group.codebooks
    slot = contract.Slot(books.qmap, books.thresholds, books.encode, group.bits, contract.NONE, contract.NONE)
    return contract.Group("momentum", update | (rules.MAXIMIZE if group.maximize else 0), group.members, group.grads,
                          group.outs, group.hyper, group.seeds, (slot,), group.block_size, group.cache)


@needs_c
@pytest.mark.parametrize("bits,update,maximize,seeded", [(8, UPDATE_LINEAR, False, False), (4, UPDATE_SIGN, True, True),
                                                         (6, UPDATE_NONE, False, True), (2, UPDATE_LINEAR, True, False)])
def test_native_group_matches_members(bits, update, maximize, seeded):
    """The C kernels' one step on the group (``backend_native.step``) equals the reference's one-state step of
    each member in turn, twice on one cache."""
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


OTHER = {8: codebooks.power_map(True, 2.5, 8), 6: codebooks.lloyd_gaussian_map_6bit(),
         4: policy.ratio_policy(4).qmap(), 2: torch.tensor([-1.0, -0.3, 0.2, 1.0])}


@needs_c
@pytest.mark.parametrize("bits", (8, 6, 4, 2))
def test_native_decodes_and_encodes_on_different_codebooks(bits):
    """Stored codes on one codebook (qmap), new ones written on another (encode, its thresholds)."""
    other = OTHER[bits] / OTHER[bits].abs().max()
    for seed in (None, 11):
        p, g, state, (block, row_len) = _case("rows-short", bits, torch.float32, torch.float32, False, bits)
        state = state._replace(thresholds=contract.midpoints(other), encode=other)
        want = _step(momentum_torch, p, g, state, UPDATE_LINEAR, False, seed, block, row_len)
        got = _step(backend_native, p, g, state, UPDATE_LINEAR, False, seed, block, row_len)
        _assert_results(got, want)


@needs_c
def test_ops_and_grouped_steps_dispatch_to_the_c_kernels():
    from ckptq.codec import grouped, ops

    p, g, state, (block, row_len) = _case("rows-short", 4, torch.bfloat16, torch.bfloat16, False, 1)
    assert ops.momentum_backend("native", (p.dtype, g.dtype), state.thresholds, False) is backend_native
    results = []
    for backend in ("torch", "native"):
        q, s = p.clone(), _clone(state)
        ops.momentum_step(q, g, ops.StepInput(s.codes, s.absmax, s.qmap, s.encode), torch.tensor(HYPER[UPDATE_SIGN]),
                          block_size=block, bits=4, update=UPDATE_SIGN, seed=5, row_len=row_len, backend=backend)
        results.append((q, s.codes, s.absmax))
    _assert_results(results[1], results[0])
    group = _group(GROUP_SPECS, 6, UPDATE_NONE, True, True)
    want, got = _clone_group(group), _clone_group(group)
    grouped.momentum_group(want, "torch")
    grouped.momentum_group(got, "native")
    _assert_groups(got, want)


# ---- the Triton kernels (the interpreter on the CPU: small cases) ----

TRITON_CASES = [(8, "flat", torch.float32, UPDATE_LINEAR, None, False, False),
                (6, "rows-short", torch.bfloat16, UPDATE_SIGN, 99, True, False),
                (4, "rows-tiny", torch.float16, UPDATE_NONE, 3, False, True),
                (2, "rows-whole", torch.float32, UPDATE_SIGN, None, False, True),
                (4, "flat", torch.bfloat16, UPDATE_LINEAR, 0xFFFFFFFF, True, True)]


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN and Inf
@pytest.mark.parametrize("bits,layout,dtype,update,seed,maximize,special", TRITON_CASES)
def test_triton_matches_reference(bits, layout, dtype, update, seed, maximize, special):
    from ckptq.kernels import backend_triton

    p, g, state, (block, row_len) = _case(layout, bits, dtype, dtype, special, bits, DEVICE)
    skip = _nan_direction(p, g, state, update, maximize, block, row_len) if special else None
    want = _step(momentum_torch, p, g, state, update, maximize, seed, block, row_len)
    got = _step(backend_triton, p, g, state, update, maximize, seed, block, row_len)
    _assert_results(got, want, skip)
    if skip is not None and bool(skip.any()):
        assert bool(torch.isnan(got[0][skip]).all())


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("bits,update,maximize,seeded", [(8, UPDATE_SIGN, False, True), (4, UPDATE_NONE, True, False)])
def test_triton_group_matches_members(bits, update, maximize, seeded):
    """The older grouped contract (``grouped.momentum_group``) on the Triton backend: each member through
    ``backend_triton.momentum_step``, a group of one of the one step's template."""
    from ckptq.codec import grouped

    group = _group(GROUP_SPECS[:4], bits, update, maximize, seeded, DEVICE, torch.bfloat16)
    want, got = _clone_group(group), _clone_group(group)
    momentum_torch.momentum_step_group(want)
    grouped.momentum_group(got, "triton")
    _assert_groups(got, want)


_COMPILE = """
import sys
import triton_compile_check as t  # clears TRITON_INTERPRET before importing triton
from ckptq.kernels import triton_step
types = {**t._STEP_TYPES, "p_like": "*bf16"}
cases = [("sgd 8-bit seeded", t.step_constexprs("momentum", 2, (t._slot(8, stochastic=True),))),
         ("lion 4-bit maximize seeded", t.step_constexprs("momentum", 5, (t._slot(4, stochastic=True),), 128)),
         ("muon 6-bit unaligned", t.step_constexprs("momentum", 0, (t._slot(6),), 64, aligned=False))]
failures = []
for name, constexprs in cases:
    r = t.compile_case(triton_step._step_kernel, types, constexprs, 90)
    print(name, r)
    failures += t.check(name, constexprs, r) + ([name + ": no IEEE division"] if r["div.rn"] == 0 else [])
print(*failures, sep="\\n")
sys.exit(1 if failures else 0)
"""


def _has_ptxas() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


@pytest.mark.skipif(not _has_ptxas(), reason="this Triton build ships no ptxas to compile for CUDA")
def test_triton_kernels_compile_for_sm90_exact_and_without_spills():
    """What the interpreter cannot check (tools/scripts/triton_compile_check.py): the one step's template with the
    momentum rule (SGD, Lion, Muon) compiles for an H100/H200, with no FMA or approximate op, IEEE division,
    no spills, 128-bit loads where aligned."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "tools" / "scripts")  # the child imports triton_compile_check from there
    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
