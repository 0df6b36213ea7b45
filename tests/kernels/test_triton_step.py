"""The Triton template of the one step (``triton_group.step`` / ``dense``: ``contract.Group`` / ``Dense``, one
launch over a chunk table of many parameters) against the reference that steps the members one by one
(``step_torch.step_group`` / ``dense_group``): params, outs, codes and scales equal bit for bit (NaN equals
NaN), for every rule and flag word the optimizers use, with the slots they declare (``ckptq/optim``'s
``STATES``: plain, sqrt and ratio transforms, a first moment still plain from an older file), code widths
8/6/4/2 mixed within a group, members of irregular sizes and row layouts (1, block - 1, block + 1, rows with
a short last block, rows of whole blocks, rows shorter than a block, empty, a vectorizable one),
fp32/bf16/fp16 params and grads, nearest and stochastic rounding, NaN/Inf/huge gradients and all-zero
blocks. Not the full product (the interpreter is slow): each rule and flag word once, the other axes
spread over the cases. Then the cache (built once, the call table rewritten only for new tensors), narrow
tiles for short rows, the registry, and each optimizer's steps on the Triton backend against the reference.
On the CPU the kernels run in Triton's interpreter (conftest.py).
"""

import os

import pytest
import torch

from ckptq.kernels import contract, registry, rules, step_torch
from ckptq.kernels.contract import NONE, RATIO, SQRT, Dense, Group, GroupMember
from ckptq.optim import (Adagrad8bit, AdamW8bit, AdEMAMix8bit, Lion8bit, Muon8bit, NAdam8bit, RAdam8bit, RMSprop8bit,
                         SGD8bit)
from ckptq.optim.spec import codebook
from tests.kernels.test_native import _assert_same
from tests.kernels.test_triton_rows import MAPS  # signed and unsigned codebooks of every width (roles other than Adam's: 8, 4)

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton runs here only under TRITON_INTERPRET=1 (set by conftest.py)", allow_module_level=True)
pytest.importorskip("triton")
from ckptq.kernels import triton_group, triton_step  # noqa: E402  (imports triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 64
SHAPES = ((1,), (BLOCK - 1,), (BLOCK + 1,), (3, 70), (2, 2 * BLOCK), (5, 12), (0,), (96,))  # (rows, row_len) or (n,)
OPTIMIZERS = {"adam": AdamW8bit, "nadam": NAdam8bit, "radam": RAdam8bit, "ademamix": AdEMAMix8bit,
              "momentum": SGD8bit, "rmsprop": RMSprop8bit, "adagrad": Adagrad8bit}  # whose STATES give the slots

# plausible scalars per field (rules.Rule.fields), varied per member; (rule, field) where rules differ
FIELDS = {"decay": 0.999, "l2": 0.01, "one_minus_beta1": 0.1, "beta2": 0.999, "one_minus_beta2": 0.001, "eps": 1e-8,
          "neg_step_size": -1e-2, "bc2_sqrt": 0.3, "decode_eps": 1e-9, "encode_eps": 2e-9, "neg_grad_step": -2e-3,
          "one_minus_beta3": 1e-2, "neg_lr": -1e-2, "bc1": 0.2, "keep": 0.9, "take": 0.1, "c_old": 0.5,
          "c_new": 0.9, "c_grad": 1.0, "one_minus_alpha": 0.01, "momentum": 0.9, "neg_clr": -0.1,
          ("ademamix", "alpha"): 5.0, ("rmsprop", "alpha"): 0.99}


def hyper(rule, t: int) -> torch.Tensor:
    """fp32 [t, len(rule.fields)]: member i's scalars (RAdam: rectified on every other member)."""
    rows = []
    for i in range(t):
        row = [float(i % 2) if f == "rectify" else FIELDS.get((rule.name, f), FIELDS.get(f, 0.5)) * (1 + 0.1 * i)
               for f in rule.fields]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32).view(t, len(rule.fields))


def slots(rule_name: str, flags: int, widths, plain_first: bool = False, device="cpu") -> tuple:
    """The optimizer's slots for a flag word (as ``optim.plan`` makes them), slot j at widths[j] (with its
    role's codebook where the role has one at that width, else a signed or unsigned one); slot 0
    decodes with one codebook and encodes with another (a swapped argument shows); ``plain_first``: a
    ratio slot still stored plain (an older file's first moment)."""
    cls = OPTIMIZERS[rule_name]
    states = [next(s for s in cls.STATES if s.slot_name == name) for name in cls.RULE.states(flags)]
    keys = [s.key for s in states]
    out = []
    for j, (s, bits) in enumerate(zip(states, widths)):
        transform = s.kernel_transform
        qmap = (codebook(s, bits) if bits in (8, 4) or transform == RATIO else MAPS[bits][transform == SQRT]).float()
        encode = torch.sort(torch.cat([qmap[:1], qmap[1:-1] * 0.9, qmap[-1:]])).values if j == 0 else qmap
        decode = NONE if plain_first and transform == RATIO else transform
        out.append(contract.Slot(qmap.to(device), contract.midpoints(encode).to(device), encode.to(device), bits,
                                 decode, transform, keys.index(s.divisor) if s.divisor else -1, s.seeded))
    return tuple(out)


def members(group_slots, pdtype, gen, shapes=SHAPES, special: bool = False) -> list:
    """GroupMembers on the CPU: random codes, scales by transform (ratios ~1, square roots ~0.1, plain
    values ~0.01); ``special``: the first block of every member all zero (p, codes, scales)."""
    scale = {NONE: 1e-2, SQRT: 1e-1, RATIO: 1.0}
    out = []
    for shape in shapes:
        n, row_len = (shape[0] * shape[1], shape[1]) if len(shape) == 2 else (shape[0], None)
        rows, length = contract.layout_rows(n, row_len)
        codes, absmax = [], []
        for s in group_slots:
            c = torch.randint(0, 2**s.bits, (rows, length), generator=gen, dtype=torch.uint8)
            codes.append(contract.pack_rows(c, s.bits).reshape(-1).clone() if n else torch.empty(0, dtype=torch.uint8))
            absmax.append(torch.rand(contract.layout_blocks(n, row_len, BLOCK), generator=gen) * scale[s.decode])
        p = torch.randn(n, generator=gen)
        if special and n:
            p[: min(BLOCK, length)] = 0.0
            for c, a in zip(codes, absmax):
                a[0] = 0.0
        out.append(GroupMember(p.to(pdtype), tuple(codes), tuple(absmax), row_len))
    return out


def gradients(sizes, gdtype, gen, special: bool = False) -> list:
    grads = [torch.randn(n, generator=gen) * 0.1 for n in sizes]
    if special:  # NaN, Inf, -Inf and huge gradients, and a zero first block
        for g in grads:
            if g.numel() > 3:
                g[: min(BLOCK, g.numel()) // 2] = 0.0
                g[-1], g[-2], g[-3] = float("nan"), float("inf"), 3e38
                g[g.numel() // 2] = -float("inf")
    return [g.to(gdtype) for g in grads]


def on(member: GroupMember, device) -> GroupMember:
    return GroupMember(member.p.to(device, copy=True), tuple(c.to(device, copy=True) for c in member.codes),
                       tuple(a.to(device, copy=True) for a in member.absmax), member.row_len)


def assert_members_equal(ref, out):
    for a, b in zip(ref, out):
        _assert_same(a.p, b.p.cpu())
        for ca, cb in zip(a.codes, b.codes):
            assert torch.equal(ca, cb.cpu())
        for aa, ab in zip(a.absmax, b.absmax):
            _assert_same(aa, ab.cpu())


def seeds_for(t: int) -> torch.Tensor:
    return torch.tensor([(2**31 + 7 * i) if i % 2 else 11 * i + 1 for i in range(t)], dtype=torch.int64)


def outs_for(rule, flags, sizes, device) -> tuple:
    if not rules.writes_direction(rule, flags):
        return ()
    return tuple(torch.full((n,), 7.0, device=device) for n in sizes)


def run_both(rule_name, flags, group_slots, ref, out, grads, seeded, cache, device_slots=None):
    """One step of the reference on ``ref`` and of the template on ``out`` (copies of the same members);
    returns their outs."""
    rule = rules.RULES[rule_name]
    sizes = [m.p.numel() for m in ref]
    h = hyper(rule, len(ref))
    seeds = seeds_for(len(ref)) if seeded else None
    ref_outs, dev_outs = outs_for(rule, flags, sizes, "cpu"), outs_for(rule, flags, sizes, DEVICE)
    step_torch.step_group(Group(rule_name, flags, tuple(ref), tuple(grads), ref_outs, h, seeds, group_slots, BLOCK,
                                {}))
    group = Group(rule_name, flags, tuple(out), tuple(g.to(DEVICE) for g in grads), dev_outs, h.to(DEVICE),
                  None if seeds is None else seeds.to(DEVICE), device_slots or _on_device(group_slots), BLOCK, cache)
    assert triton_group.accepts_step(group)
    triton_group.step(group)
    return ref_outs, dev_outs


def _on_device(group_slots):
    return tuple(s._replace(qmap=s.qmap.to(DEVICE), thresholds=s.thresholds.to(DEVICE), encode=s.encode.to(DEVICE))
                 for s in group_slots)


M = rules.MAXIMIZE
AMSGRAD, HEAVY, CENTERED = rules.ADAM.flag("amsgrad"), rules.RMSPROP.flag("heavy"), rules.RMSPROP.flag("centered")
LINEAR, SIGN = rules.MOMENTUM.flag("linear"), rules.MOMENTUM.flag("sign")
f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
CASES = (  # rule, flag word, widths, param dtype, grad dtype, seeded, special values, first moment still plain
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


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inside the interpreter, on NaN and Inf
@pytest.mark.parametrize("rule_name,flags,widths,pdtype,gdtype,seeded,special,plain_first", CASES,
                         ids=[f"{c[0]}-{c[1]}-{''.join(map(str, c[2]))}" for c in CASES])
def test_step_equals_the_reference(rule_name, flags, widths, pdtype, gdtype, seeded, special, plain_first):
    gen = torch.Generator().manual_seed(100 * len(rule_name) + flags + sum(widths))
    group_slots = slots(rule_name, flags, widths, plain_first)
    ref = members(group_slots, pdtype, gen, special=special)
    out = [on(m, DEVICE) for m in ref]
    grads = gradients([m.p.numel() for m in ref], gdtype, gen, special)
    cache = {}
    ref_outs, dev_outs = run_both(rule_name, flags, group_slots, ref, out, grads, seeded, cache)
    assert_members_equal(ref, out)
    for a, b in zip(ref_outs, dev_outs):
        _assert_same(a, b.cpu())
    kinds = [aligned for _, _, aligned in cache["triton"]["launches"]]  # vectorizing members, then the others
    assert kinds == [True, False]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_cache_is_built_once_and_the_call_table_follows_new_tensors():
    """Three steps of a direction rule on one cache: new gradient and out tensors (the call table is
    rewritten), then the same tensors refilled in place (it is kept)."""
    gen = torch.Generator().manual_seed(3)
    group_slots = slots("momentum", 0, (4,))
    ref = members(group_slots, f32, gen)
    out = [on(m, DEVICE) for m in ref]
    sizes = [m.p.numel() for m in ref]
    rule, cache, dev_slots = rules.MOMENTUM, {}, _on_device(group_slots)
    grads = dev_grads = outs = None
    for step in (1, 2, 3):
        if step < 3:
            grads = gradients(sizes, f32, gen)
            dev_grads = [g.to(DEVICE) for g in grads]
            outs = outs_for(rule, 0, sizes, DEVICE)
        else:
            for g, d in zip(grads, dev_grads):
                g.copy_(torch.randn(g.numel(), generator=gen))
                d.copy_(g)
        ref_outs = outs_for(rule, 0, sizes, "cpu")
        h = hyper(rule, len(ref)) * step
        step_torch.step_group(Group("momentum", 0, tuple(ref), tuple(grads), ref_outs, h, None, group_slots, BLOCK, {}))
        triton_group.step(Group("momentum", 0, tuple(out), tuple(dev_grads), outs, h.to(DEVICE), None, dev_slots,
                                BLOCK, cache))
        assert_members_equal(ref, out)
        for a, b in zip(ref_outs, outs):
            _assert_same(a, b.cpu())
        kept = cache["triton"]
        if step == 1:
            tables = kept["members"]
        assert kept["members"] is tables
        assert kept["call_key"] == tuple(g.data_ptr() for g in dev_grads) + tuple(o.data_ptr() for o in outs)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_short_rows_take_narrow_tiles():
    """When every row is short (20 and 9 elements, block 256), tiles are as wide as the longest row (32)
    and hold more blocks: the same bits as the reference's blocks of 256."""
    gen = torch.Generator().manual_seed(5)
    group_slots = slots("adam", 0, (4, 2))
    ref = members(group_slots, f32, gen, shapes=((4, 20), (6, 9)))
    ref = [m._replace(absmax=tuple(a[: contract.layout_blocks(m.p.numel(), m.row_len, 256)] for a in m.absmax))
           for m in ref]  # one block per row at block 256
    out, cache, h = [on(m, DEVICE) for m in ref], {}, hyper(rules.ADAM, 2)
    grads = gradients([m.p.numel() for m in ref], f32, gen)
    step_torch.step_group(Group("adam", 0, tuple(ref), tuple(grads), (), h, None, group_slots, 256, {}))
    triton_group.step(Group("adam", 0, tuple(out), tuple(g.to(DEVICE) for g in grads), (), h.to(DEVICE), None,
                            _on_device(group_slots), 256, cache))
    assert_members_equal(ref, out)
    assert (cache["triton"]["block"], cache["triton"]["per_program"]) == (32, 64)


DENSE_CASES = (  # rule, flag word, param dtype, grad dtype, special values
    ("adam", AMSGRAD | M, bf16, bf16, True), ("adam", 0, f16, f32, False), ("nadam", 0, f32, f32, False),
    ("radam", M, bf16, f32, False), ("ademamix", 0, f32, bf16, False), ("momentum", LINEAR, f32, f32, False),
    ("momentum", SIGN, bf16, bf16, True), ("momentum", M, f32, f32, False),
    ("rmsprop", HEAVY | CENTERED, f32, f32, True),
    ("rmsprop", CENTERED | M, f16, f16, False), ("rmsprop", HEAVY, bf16, f32, False), ("adagrad", 0, f32, f32, True),
)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("rule_name,flags,pdtype,gdtype,special", DENSE_CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in DENSE_CASES])
def test_dense_equals_the_reference(rule_name, flags, pdtype, gdtype, special):
    """fp32 states of sizes 1, 15, 16, 2048 + 5 (two tiles), 0, 96: the aligned launch and the other."""
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
        _assert_same(p, q.cpu())
        for a, b in zip(s, t):
            _assert_same(a, b.cpu())
    for a, b in zip(ref_outs, dev_outs):
        _assert_same(a, b.cpu())
    assert [aligned for _, _, aligned in group.cache["triton"]["launches"]] == [True, False]


def test_every_rule_has_a_triton_function_and_the_registry_picks_it():
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
@pytest.mark.parametrize("cls,kwargs", OPTIMIZER_CASES, ids=[c.__name__ for c, _ in OPTIMIZER_CASES])
def test_optimizers_step_on_triton_as_on_the_reference(cls, kwargs):
    """Three steps of each optimizer (stochastic rounding, a parameter with rows whose last block is short,
    a small one kept in fp32) on backend="triton" and on backend="torch": the same parameters and states."""
    runs = []
    for backend in ("torch", "triton"):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(DEVICE)) for shape in ((6, 70), (5, 3))]
        opt = cls(params, min_size=64, block_size=BLOCK, backend=backend, rounding="stochastic", **kwargs)
        for k in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(k)).to(DEVICE) * 0.1
            opt.step()
        runs.append((params, opt.state_dict()))
    (pa, sa), (pb, sb) = runs
    for a, b in zip(pa, pb):
        _assert_same(a.detach().cpu(), b.detach().cpu())
    for pid, state in sa["state"].items():
        for key, value in state.items():
            other = sb["state"][pid][key]
            if isinstance(value, dict):
                for name in ("codes", "absmax"):
                    _assert_same(value[name].cpu(), other[name].cpu())
            elif isinstance(value, torch.Tensor):
                _assert_same(value.cpu(), other.cpu())
