"""The C kernels' one step of every optimizer (``backend_native.step`` / ``dense``: ``ckq_step_group`` and
``ckq_dense_group``) against the PyTorch reference (``step_torch.step_group`` / ``dense_group``), bit for bit.

Every rule of ``rules.RULES`` with each flag word (its switches; MAXIMIZE in some cases), slot widths 8, 6, 4
and 2 (alone and mixed), one group of three members per case: the flat layout ending in a short block, rows
that end in short blocks, rows of whole blocks (sizes that leave every vector path a partial vector), fp32 /
bf16 / fp16 params and grads, nearest and stochastic rounding, NaN and Inf in gradients and parameters; the
transforms as optimizers declare them and as older files store them; the fp32 states of small parameters.
Each case runs here, through ctypes, on every build of tests/kernels/test_native.py's ``build`` fixture that this
machine can load: this CPU's, scalar C (x86-64-v2), AVX2 and AVX-512 builds where the CPU has them. The
builds it cannot load (aarch64 NEON and aarch64 scalar C under qemu-user, beside the x86 ones) run the same
cases (this module's ``FLAG_WORDS``, ``VARIANTS``, ``UNSHAPED``, ``make_group``, ``make_dense``) through a
standalone driver: tests/kernels/test_step_driver.py.
"""

from __future__ import annotations

import pytest
import torch

from ckptq.codec import ops, policy
from ckptq.kernels import backend_native, backend_torch, rules, step_torch
from ckptq.kernels.contract import NONE, RATIO, SQRT, Dense, Group, GroupMember, Slot, layout_blocks, layout_bytes
from tests.kernels.test_native import _assert_same, build  # noqa: F401 (the build fixture)

pytestmark = pytest.mark.skipif(not backend_native.available(), reason="C kernels unavailable")

# codebooks per width: signed ones for plain and ratio slots, unsigned ones for square-root slots
SIGNED = {8: policy.ratio_policy(8).qmap(), 6: policy.ratio_policy(6).qmap(), 4: policy.ratio_policy(4).qmap(),
          2: torch.tensor([-1.0, -0.3, 0.0, 1.0])}
UNSIGNED = {8: policy.policy_for("exp_avg_sq", 8).qmap(), 6: torch.linspace(0, 1, 64) ** 2,
            4: policy.policy_for("exp_avg_sq", 4).qmap(), 2: policy.policy_for("exp_avg_sq", 2).qmap()}

# each slot's (decode, encode, divisor) as the optimizers declare them (ckptq/optim/*.py STATES)
DECLARED = {"adam": ((RATIO, RATIO, 1), (SQRT, SQRT, -1), (SQRT, SQRT, -1)),
            "nadam": ((RATIO, RATIO, 1), (SQRT, SQRT, -1)), "radam": ((RATIO, RATIO, 1), (SQRT, SQRT, -1)),
            "ademamix": ((NONE, NONE, -1), (NONE, NONE, -1), (SQRT, SQRT, -1)),
            "momentum": ((NONE, NONE, -1),), "adagrad": ((SQRT, SQRT, -1),)}

# the flag words the optimizers use (rmsprop: heavy, centered)
FLAG_WORDS = [("adam", 0), ("adam", 2), ("nadam", 0), ("radam", 0), ("ademamix", 0), ("momentum", 2),
              ("momentum", 4), ("momentum", 0), ("rmsprop", 0), ("rmsprop", 2), ("rmsprop", 4), ("rmsprop", 6),
              ("adagrad", 0)]


def declared_shape(rule: str, flags: int) -> tuple:
    names = rules.RULES[rule].states(flags)
    if rule == "rmsprop":  # square_avg (sqrt), momentum_buffer, grad_avg (plain)
        return ((SQRT, SQRT, -1),) + ((NONE, NONE, -1),) * (len(names) - 1)
    return DECLARED[rule][: len(names)]


def _values(n: int, signed: bool, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-5, 0, generator=gen)
    x[: min(n, 3)] = 0.0
    return x if signed else x.abs()


def _members(layouts, block: int, slots: tuple, dtype: torch.dtype, gen: torch.Generator) -> tuple:
    """A member per (rows, row_len) (row_len None: the flat layout of ``rows`` elements), its slots' codes
    and scales quantized from values by the reference (square-root slots from non-negative values)."""
    members = []
    for rows, row_len in layouts:
        n = rows * (row_len or 1)
        p = (torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-3, 1, generator=gen)).to(dtype)
        codes, absmax = [], []
        for s in slots:
            c = torch.empty(layout_bytes(n, row_len, s.bits), dtype=torch.uint8)
            a = torch.empty(layout_blocks(n, row_len, block))
            x = _values(n, SQRT not in (s.decode, s.encode_as), gen) * 1e-2  # second moments: >= 0
            backend_torch.quantize(x, s.thresholds, block, False, c, a, s.bits, row_len)
            codes.append(c)
            absmax.append(a)
        members.append(GroupMember(p, tuple(codes), tuple(absmax), row_len))
    return tuple(members)


def _hyper(rule: rules.Rule, count: int, gen: torch.Generator) -> torch.Tensor:
    """Scalars of the right order of magnitude per field (their values do not change the kernels' path)."""
    h = torch.rand(count, len(rule.fields), generator=gen) * 0.5 + 0.25
    for k, name in enumerate(rule.fields):
        if name in ("eps", "decode_eps", "encode_eps"):
            h[:, k] = 1e-8 * (1 + torch.arange(count))
        elif name == "rectify":
            h[:, k] = (torch.arange(count) % 2).float()  # RAdam: tractable or not, member by member
        elif name.startswith("neg"):
            h[:, k] = -h[:, k] * 1e-2
    return h


def make_group(rule: str, flags: int, widths, layouts, block: int, dtypes, seeded: bool, seed: int,
               shape=None, special: bool = False) -> Group:
    """A ``contract.Group`` of fresh members (the same ones for the same arguments): ``widths`` per slot,
    ``shape`` per slot (decode, encode, divisor; default: as declared), grads of ``dtypes[1]``, a hyper row and
    a seed per member; ``special``: NaN and Inf in a gradient and a parameter."""
    gen = torch.Generator().manual_seed(seed)
    r = rules.RULES[rule]
    shape = shape or declared_shape(rule, flags)
    slots = []
    for j, ((dec, enc, div), bits) in enumerate(zip(shape, widths)):
        q = (UNSIGNED if dec == SQRT else SIGNED)[bits]
        slots.append(Slot(q, ops.midpoints(q), q, bits, dec, enc, div, not (rule == "adam" and j == 2)))
    members = _members(layouts, block, tuple(slots), dtypes[0], gen)
    grads = tuple((torch.randn(m.p.numel(), generator=gen) * 1e-2).to(dtypes[1]) for m in members)
    if special:
        grads[0][[1, 5]] = torch.tensor([float("nan"), float("inf")]).to(dtypes[1])
        members[-1].p[-2] = float("inf")
    outs = tuple(torch.zeros(m.p.numel()) for m in members) if rules.writes_direction(r, flags) else ()
    seeds = torch.arange(len(members), dtype=torch.int64) * 0x9E3779B1 % 2**32 + seed if seeded else None
    return Group(rule, flags, members, grads, outs, _hyper(r, len(members), gen), seeds, tuple(slots), block, {})


def clone_group(group: Group) -> Group:
    members = tuple(m._replace(p=m.p.clone(), codes=tuple(c.clone() for c in m.codes),
                               absmax=tuple(a.clone() for a in m.absmax)) for m in group.members)
    return group._replace(members=members, outs=tuple(o.clone() for o in group.outs), cache={})


def assert_same_groups(got: Group, want: Group) -> None:
    for i, (a, b) in enumerate(zip(got.members, want.members)):
        _assert_same(a.p, b.p)
        for j, (x, y) in enumerate(zip(a.codes, b.codes)):
            assert torch.equal(x, y), f"member {i}, slot {j}: codes differ"
        for x, y in zip(a.absmax, b.absmax):
            _assert_same(x, y)
    for a, b in zip(got.outs, want.outs):
        _assert_same(a, b)


def step_both(group: Group) -> None:
    """The reference and the C kernels on copies of the group: equal params (or outs), codes and scales."""
    want, got = clone_group(group), clone_group(group)
    step_torch.step_group(want)
    assert backend_native.accepts_step(got)
    backend_native.step(got)
    assert_same_groups(got, want)


def layouts(block: int) -> list:
    """Flat, ending in a short block; rows ending in short blocks; rows of whole blocks (the flat layout)."""
    return [(3 * block + 29, None), (3, 2 * block + 37), (2, 2 * block)]


# (widths of slots 0, 1, 2; block; (param, grad) dtypes; stochastic; maximize): four per flag word, so that
# every width, dtype pair and rounding meets every rule
VARIANTS = [((8, 8, 8), 64, (torch.float32, torch.float32), False, False),
            ((4, 4, 4), 128, (torch.bfloat16, torch.bfloat16), True, True),
            ((6, 2, 2), 64, (torch.float16, torch.float16), True, False),
            ((2, 8, 4), 256, (torch.bfloat16, torch.float32), False, True)]


@pytest.mark.parametrize("rule,flags", FLAG_WORDS, ids=[f"{r}-{f}" for r, f in FLAG_WORDS])
def test_every_rule_matches_the_reference(rule, flags, build):
    for k, (widths, block, dtypes, seeded, maximize) in enumerate(VARIANTS):
        word = flags | (rules.MAXIMIZE if maximize else 0)
        step_both(make_group(rule, word, widths, layouts(block), block, dtypes, seeded, seed=k, special=k == 3))


# states stored otherwise than their optimizer declares: a first moment of an older file (plain, written back
# as a ratio), a square-root slot stored plain; both through the kernels' generic transform passes
UNSHAPED = [("adam", 0, ((NONE, RATIO, 1), (SQRT, SQRT, -1))),
            ("adam", 2, ((NONE, RATIO, 1), (NONE, SQRT, -1), (SQRT, SQRT, -1))),
            ("nadam", 0, ((NONE, RATIO, 1), (SQRT, SQRT, -1))),
            ("rmsprop", 2, ((NONE, SQRT, -1), (NONE, NONE, -1)))]


@pytest.mark.parametrize("rule,flags,shape", UNSHAPED, ids=[f"{r}-{f}-{i}" for i, (r, f, _) in enumerate(UNSHAPED)])
@pytest.mark.parametrize("seeded", (False, True))
def test_states_stored_otherwise_match_the_reference(rule, flags, shape, seeded, build):
    for widths, block in (((8, 8, 8), 64), ((6, 2, 4), 128)):
        step_both(make_group(rule, flags, widths, layouts(block), block, (torch.float32,) * 2, seeded, seed=block,
                             shape=shape))


def make_dense(rule: str, flags: int, sizes, dtypes, seed: int) -> Dense:
    gen = torch.Generator().manual_seed(seed)
    r = rules.RULES[rule]
    k = len(r.states(flags))
    params = tuple(torch.randn(n, generator=gen).to(dtypes[0]) for n in sizes)
    grads = tuple((torch.randn(n, generator=gen) * 1e-2).to(dtypes[1]) for n in sizes)
    states = tuple(tuple(torch.rand(n, generator=gen) * 1e-3 for _ in range(k)) for n in sizes)
    outs = tuple(torch.zeros(n) for n in sizes) if rules.writes_direction(r, flags) else ()
    grads[0][0] = float("nan")
    return Dense(rule, flags, params, grads, states, outs, _hyper(r, len(sizes), gen), {})


def clone_dense(group: Dense) -> Dense:
    return group._replace(params=tuple(p.clone() for p in group.params), outs=tuple(o.clone() for o in group.outs),
                          states=tuple(tuple(s.clone() for s in st) for st in group.states), cache={})


def dense_both(group: Dense) -> None:
    want, got = clone_dense(group), clone_dense(group)
    step_torch.dense_group(want)
    assert backend_native.accepts_dense(got)
    backend_native.dense(got)
    for a, b in zip(got.params + got.outs, want.params + want.outs):
        _assert_same(a, b)
    for a, b in zip(got.states, want.states):
        for x, y in zip(a, b):
            _assert_same(x, y)


@pytest.mark.parametrize("rule,flags", FLAG_WORDS, ids=[f"{r}-{f}" for r, f in FLAG_WORDS])
def test_every_rule_on_fp32_states_matches_the_reference(rule, flags, build):
    for k, dtypes in enumerate(((torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float16, torch.float32))):
        dense_both(make_dense(rule, flags | (rules.MAXIMIZE if k == 1 else 0), (1, 7, 1000, 4099), dtypes, seed=k))


def test_the_backend_takes_every_rule_it_implements():
    """Every rule of rules.RULES has its C function (ckq_rule_id), and the registry sends groups there."""
    from ckptq.kernels import registry

    assert all(backend_native.rule_id(name) >= 0 for name in rules.RULES)
    assert backend_native.rule_id("no-such-rule") == -1
    group = make_group("rmsprop", 6, (8, 8, 8), layouts(64), 64, (torch.float32,) * 2, False, seed=1)
    assert registry.implementation("step", "native", group) is backend_native.step
    dense = make_dense("adagrad", 0, (5,), (torch.float32,) * 2, seed=1)
    assert registry.implementation("dense", "native", dense) is backend_native.dense
