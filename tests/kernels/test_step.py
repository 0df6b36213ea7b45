"""The one step of every optimizer (``contract.Group`` / ``Dense``: ``backend_native.step`` / ``dense``, the C
kernels' ``ckq_step_group`` / ``ckq_dense_group``; ``triton_group.step`` / ``dense``, the Triton template, one
launch over a chunk table of many parameters) against the PyTorch reference that steps the members one by one
(``step_torch.step_group`` / ``dense_group``): params, outs, codes and scales equal bit for bit (NaN equals NaN).

Parametrized backend x rule x flag word, over layouts and widths: every rule of ``rules.RULES`` with each flag
word the optimizers use (MAXIMIZE in some cases), slot widths 8/6/4/2 (alone and mixed within a group), the
flat layout ending in a short block, rows that end in short blocks, rows of whole blocks, rows shorter than
a block, empty members, fp32/bf16/fp16 params and grads, nearest and stochastic rounding, NaN and Inf in
gradients and parameters, all-zero blocks; the transforms as optimizers declare them and as older files
store them (a first moment still plain); the fp32 states of small parameters.

The C kernels: small groups of three members (``cases.make_group``: four variants per flag word, so that every
width, dtype pair and rounding meets every rule), on every build of conftest.py's ``kernel`` fixture this
machine can load. The builds it cannot load (aarch64 NEON and scalar C under qemu-user) run the same cases
(``cases.FLAG_WORDS``, ``VARIANTS``, ``UNSHAPED``, ``make_group``, ``make_dense``) through a standalone driver:
tests/kernels/test_step_driver.py. Triton (the interpreter on the CPU is slow): each rule and flag word once,
the other axes spread over the cases. Grouping itself (hundreds of members, threads, caches): test_step_group.py.
Then the registry, and each optimizer's steps on every backend against the reference.
"""

import pytest
import torch

from ckptq.kernels import registry, rules, step_torch
from ckptq.kernels.contract import Dense, Group, GroupMember
from ckptq.optim import (Adagrad8bit, AdamW8bit, AdEMAMix8bit, Lion8bit, Muon8bit, NAdam8bit, RAdam8bit, RMSprop8bit,
                         SGD8bit)
from tests.kernels.cases import (BLOCK, C_BUILDS, DEVICE, FLAG_WORDS, UNSHAPED, VARIANTS, assert_members_equal,
                                 assert_same, assert_same_groups, clone_dense, clone_group, device_of, gradients,
                                 hyper, layouts, make_dense, make_group, members, on, outs_for, over, run_both, slots)

M = rules.MAXIMIZE
AMSGRAD, HEAVY, CENTERED = rules.ADAM.flag("amsgrad"), rules.RMSPROP.flag("heavy"), rules.RMSPROP.flag("centered")
LINEAR, SIGN = rules.MOMENTUM.flag("linear"), rules.MOMENTUM.flag("sign")
f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16


def step_both(group: Group) -> None:
    """The reference and the C kernels on copies of the group: equal params (or outs), codes and scales."""
    backend_native = registry.backend("native")
    want, got = clone_group(group), clone_group(group)
    step_torch.step_group(want)
    assert backend_native.accepts_step(got)
    backend_native.step(got)
    assert_same_groups(got, want)


TRITON_CASES = (  # rule, flag word, widths, param dtype, grad dtype, seeded, special values, first moment still plain
    ("adam", 0, (8, 8), f32, f32, False, False, False),
    ("adam", AMSGRAD | M, (6, 2, 4), bf16, bf16, True, False, False),
    ("adam", AMSGRAD, (4, 4, 8), f16, f32, True, True, True),
    ("nadam", M, (4, 6), bf16, f32, True, False, False),
    ("radam", 0, (6, 2), f32, bf16, False, True, False),
    ("ademamix", 0, (8, 4, 6), f32, f32, True, False, False),
    ("momentum", LINEAR, (6,), f16, f16, False, False, False),
    ("momentum", SIGN | M, (8,), bf16, bf16, True, True, False),
    ("momentum", 0, (2,), f32, bf16, True, False, False),
    ("rmsprop", 0, (4,), bf16, bf16, False, False, False),
    ("rmsprop", HEAVY | M, (8, 2), f32, f32, True, False, False),
    ("rmsprop", CENTERED, (6, 4), f16, f32, False, True, False),
    ("rmsprop", HEAVY | CENTERED, (2, 6, 8), f32, f32, True, False, False),
    ("adagrad", M, (4,), f32, f32, True, True, False),
)
STEP_CASES = ([(b, rule, flags, VARIANTS) for b in C_BUILDS for rule, flags in FLAG_WORDS]
              + [("triton", c[0], c[1], c) for c in TRITON_CASES])
STEP_IDS = [f"{b}-{rule}-{flags}-" + ("variants" if b != "triton" else "".join(map(str, c[2])))
            for b, rule, flags, c in STEP_CASES]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inside the interpreter, on NaN and Inf
@over("rule,flags,case", STEP_CASES, ids=STEP_IDS)
def test_step_matches_reference(kernel, rule, flags, case):
    """C: each of ``VARIANTS`` (MAXIMIZE where it says; NaN and Inf in the last) on the three layouts of its
    block. Triton: one case, members of every shape of ``cases.SHAPES``; the vectorizing members launch first."""
    if kernel != "triton":
        for k, (widths, block, dtypes, seeded, maximize) in enumerate(case):
            word = flags | (M if maximize else 0)
            step_both(make_group(rule, word, widths, layouts(block), block, dtypes, seeded, seed=k, special=k == 3))
        return
    _, _, widths, pdtype, gdtype, seeded, special, plain_first = case
    gen = torch.Generator().manual_seed(100 * len(rule) + flags + sum(widths))
    group_slots = slots(rule, flags, widths, plain_first)
    ref = members(group_slots, pdtype, gen, special=special)
    out = [on(m, DEVICE) for m in ref]
    grads = gradients([m.p.numel() for m in ref], gdtype, gen, special)
    cache = {}
    ref_outs, dev_outs = run_both(rule, flags, group_slots, ref, out, grads, seeded, cache)
    assert_members_equal(ref, out)
    for a, b in zip(ref_outs, dev_outs):
        assert_same(a, b.cpu())
    kinds = [aligned for _, _, aligned in cache["triton"]["launches"]]  # vectorizing members, then the others
    assert kinds == [True, False]


@over("rule,flags,shape,seeded", [(b, rule, flags, shape, seeded) for b in C_BUILDS for seeded in (False, True)
                                  for rule, flags, shape in UNSHAPED],
      ids=[f"{b}-{rule}-{flags}-{i}-{'seeded' if seeded else 'nearest'}" for b in C_BUILDS for seeded in (False, True)
           for i, (rule, flags, _) in enumerate(UNSHAPED)])
def test_states_stored_otherwise_match_reference(kernel, rule, flags, shape, seeded):
    """States stored otherwise than their optimizer declares (``cases.UNSHAPED``), through the C kernels'
    generic transform passes (Triton: the ``plain_first`` case of test_step_matches_reference)."""
    for widths, block in (((8, 8, 8), 64), ((6, 2, 4), 128)):
        step_both(make_group(rule, flags, widths, layouts(block), block, (f32,) * 2, seeded, seed=block, shape=shape))


def dense_both(group: Dense) -> None:
    backend_native = registry.backend("native")
    want, got = clone_dense(group), clone_dense(group)
    step_torch.dense_group(want)
    assert backend_native.accepts_dense(got)
    backend_native.dense(got)
    for a, b in zip(got.params + got.outs, want.params + want.outs):
        assert_same(a, b)
    for a, b in zip(got.states, want.states):
        for x, y in zip(a, b):
            assert_same(x, y)


def _triton_dense(rule_name, flags, pdtype, gdtype, special):
    """fp32 states of sizes 1, 15, 16, 2048 + 5 (two tiles), 0, 96: the aligned launch and the other."""
    from ckptq.kernels import triton_group

    rule = rules.RULES[rule_name]
    gen = torch.Generator().manual_seed(len(rule_name) + flags)
    sizes = (1, 15, 16, 2048 + 5, 0, 96)
    n_states = len(rule.states(flags))
    params = [torch.randn(n, generator=gen).to(pdtype) for n in sizes]
    states = [tuple(torch.rand(n, generator=gen) * 1e-2 for _ in range(n_states)) for n in sizes]
    grads = gradients(sizes, gdtype, gen, special)
    h = hyper(rule, len(sizes))
    out_p = [p.to(DEVICE, copy=True) for p in params]
    out_s = [tuple(t.to(DEVICE, copy=True) for t in s) for s in states]
    ref_outs, dev_outs = outs_for(rule, flags, sizes, "cpu"), outs_for(rule, flags, sizes, DEVICE)
    step_torch.dense_group(Dense(rule_name, flags, tuple(params), tuple(grads), tuple(states), ref_outs, h, {}))
    group = Dense(rule_name, flags, tuple(out_p), tuple(g.to(DEVICE) for g in grads), tuple(out_s), dev_outs,
                  h.to(DEVICE), {})
    assert triton_group.accepts_dense(group)
    triton_group.dense(group)
    for p, q, s, t in zip(params, out_p, states, out_s):
        assert_same(p, q.cpu())
        for a, b in zip(s, t):
            assert_same(a, b.cpu())
    for a, b in zip(ref_outs, dev_outs):
        assert_same(a, b.cpu())
    assert [aligned for _, _, aligned in group.cache["triton"]["launches"]] == [True, False]


TRITON_DENSE = (  # rule, flag word, param dtype, grad dtype, special values
    ("adam", AMSGRAD | M, bf16, bf16, True), ("adam", 0, f16, f32, False), ("nadam", 0, f32, f32, False),
    ("radam", M, bf16, f32, False), ("ademamix", 0, f32, bf16, False), ("momentum", LINEAR, f32, f32, False),
    ("momentum", SIGN, bf16, bf16, True), ("momentum", M, f32, f32, False),
    ("rmsprop", HEAVY | CENTERED, f32, f32, True),
    ("rmsprop", CENTERED | M, f16, f16, False), ("rmsprop", HEAVY, bf16, f32, False), ("adagrad", 0, f32, f32, True),
)
DENSE_CASES = ([(b, rule, flags, None) for b in C_BUILDS for rule, flags in FLAG_WORDS]
               + [("triton", c[0], c[1], c) for c in TRITON_DENSE])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@over("rule,flags,case", DENSE_CASES, ids=[f"{b}-{rule}-{flags}" for b, rule, flags, _ in DENSE_CASES])
def test_dense_matches_reference(kernel, rule, flags, case):
    """C: sizes 1, 7, 1000, 4099 on three dtype pairs (MAXIMIZE on the second). Triton: one dtype pair each."""
    if kernel == "triton":
        _triton_dense(*case)
        return
    for k, dtypes in enumerate(((f32,) * 2, (bf16,) * 2, (f16, f32))):
        dense_both(make_dense(rule, flags | (M if k == 1 else 0), (1, 7, 1000, 4099), dtypes, seed=k))


@over("backend", [("native", "native"), ("triton", "triton")])
def test_every_rule_has_a_kernel_and_the_registry_picks_it(kernel, backend):
    """Every rule of rules.RULES has its C function (ckq_rule_id) and its Triton one, and the registry sends
    groups there (and a dtype no kernel takes to the reference)."""
    if kernel == "native":
        backend_native = registry.backend("native")
        assert all(backend_native.rule_id(name) >= 0 for name in rules.RULES)
        assert backend_native.rule_id("no-such-rule") == -1
        group = make_group("rmsprop", 6, (8, 8, 8), layouts(64), 64, (f32,) * 2, False, seed=1)
        assert registry.implementation("step", "native", group) is backend_native.step
        dense = make_dense("adagrad", 0, (5,), (f32,) * 2, seed=1)
        assert registry.implementation("dense", "native", dense) is backend_native.dense
        return
    from ckptq.kernels import triton_group, triton_step

    assert set(triton_step.RULES) == set(rules.RULES)
    for name, rule in rules.RULES.items():
        flags = (1 << (len(rule.flags) + 1)) - 1  # every switch, and MAXIMIZE
        group_slots = slots(name, flags, (8,) * 3)
        m = GroupMember(torch.zeros(4), (torch.zeros(4, dtype=torch.uint8),) * len(group_slots),
                        (torch.zeros(1),) * len(group_slots), None)
        group = Group(name, flags, (m,), (torch.zeros(4),), (), torch.zeros(1, len(rule.fields)), None, group_slots,
                      BLOCK, {})
        assert registry.implementation("step", "triton", group) is triton_group.step
        dense = Dense(name, flags, (m.p,), (m.p,), ((m.p,) * len(group_slots),), (), group.hyper, {})
        assert registry.implementation("dense", "triton", dense) is triton_group.dense
        doubles = group._replace(members=(m._replace(p=m.p.double()),))
        assert registry.implementation("step", "triton", doubles) is step_torch.step_group  # not a kernel dtype


OPTIMIZER_CASES = (  # class, its arguments
    (AdamW8bit, dict(amsgrad=True, bits=4)), (NAdam8bit, dict(weight_decay=0.1)), (RAdam8bit, {}),
    (AdEMAMix8bit, {}), (SGD8bit, dict(momentum=0.9, nesterov=True)), (Lion8bit, dict(bits=4)), (Muon8bit, {}),
    (RMSprop8bit, dict(momentum=0.9, centered=True)), (Adagrad8bit, dict(maximize=True)),
)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@over("cls,kwargs", [(b, *c) for b in ("native", "triton") for c in OPTIMIZER_CASES],
      ids=[f"{b}-{c.__name__}" for b in ("native", "triton") for c, _ in OPTIMIZER_CASES])
def test_optimizers_step_as_on_the_reference(kernel, cls, kwargs):
    """Three steps of each optimizer (stochastic rounding, a parameter with rows whose last block is short,
    a small one kept in fp32) on the backend and on backend="torch": the same parameters and states."""
    dev = device_of(kernel)
    runs = []
    for backend, device in (("torch", "cpu"), (kernel, dev)):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(device)) for shape in ((6, 70), (5, 3))]
        opt = cls(params, min_size=64, block_size=BLOCK, backend=backend, rounding="stochastic", **kwargs)
        for k in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(k)).to(device) * 0.1
            opt.step()
        runs.append((params, opt.state_dict()))
    (pa, sa), (pb, sb) = runs
    for a, b in zip(pa, pb):
        assert_same(a.detach().cpu(), b.detach().cpu())
    for pid, state in sa["state"].items():
        for key, value in state.items():
            other = sb["state"][pid][key]
            if isinstance(value, dict):
                for name in ("codes", "absmax"):
                    assert_same(value[name].cpu(), other[name].cpu())
            elif isinstance(value, torch.Tensor):
                assert_same(value.cpu(), other.cpu())
