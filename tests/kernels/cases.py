"""What the kernel tests share: the backend axis (``over``), bit-for-bit comparison, input values, codebooks of
every width, and the builders of grouped steps: ``make_group`` / ``make_dense`` with ``FLAG_WORDS``, ``VARIANTS``
and ``UNSHAPED`` (the C kernels' cases, in test_step.py here and through the cross-target driver in
test_step_driver.py), and ``slots`` / ``members`` / ``run_both`` (the Triton template's cases, in test_step.py
and test_triton_cuda.py).
"""

from __future__ import annotations

import pytest
import torch

from ckptq.codec import codebooks, ops, policy
from ckptq.kernels import backend_torch, contract, lut, rules, step_torch
from ckptq.kernels.contract import NONE, RATIO, SQRT, Dense, Group, GroupMember, Slot, layout_blocks, layout_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where Triton cases run (the interpreter: the CPU)

C_BUILDS = ("native", "portable", "avx2", "avx512-no-vbmi")  # tests/kernels/conftest.py's C builds
OTHER_BUILDS = C_BUILDS[1:]


def over(names: str, cases, ids=None) -> pytest.MarkDecorator:
    """``pytest.mark.parametrize("kernel," + names, cases)`` with ``kernel`` (each case's first value: a C build or
    "triton") given indirectly to the ``kernel`` fixture (conftest.py); ids: the values joined by "-" (or
    ``ids``)."""
    cases = list(cases)

    def text(v) -> str:
        if isinstance(v, torch.dtype):
            return str(v).removeprefix("torch.")
        if isinstance(v, (tuple, list)):
            return "+".join(map(text, v))
        return getattr(v, "__name__", str(v))

    return pytest.mark.parametrize("kernel," + names, cases, indirect=["kernel"],
                                   ids=ids or ["-".join(text(v) for v in case) for case in cases])


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def device_of(kernel: str) -> str:
    return DEVICE if kernel == "triton" else "cpu"


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bits, except that any NaN equals any NaN (payloads are not part of the contract)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(a[~nan], b[~nan])
    if a.is_floating_point():  # -0.0 vs +0.0 too
        assert torch.equal(torch.signbit(a[~nan]), torch.signbit(b[~nan]))


def special(n: int, signed: bool, gen: torch.Generator) -> torch.Tensor:
    """Values over 33 decades: an all-zero block, -0.0, subnormals, NaN and Inf (n > 300)."""
    x = torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-30, 3, generator=gen)
    x = x if signed else x.abs()
    x[:64] = 0.0  # an all-zero block
    x[64:80] = -0.0 if signed else 0.0
    x[80:90] = 1e-42  # subnormal
    if n > 300:
        x[200] = float("nan")
        x[290] = float("inf")
    return x


def sample(shape, dtype, non_negative: bool, seed: int) -> torch.Tensor:
    """Values spanning six decades, so that small codes near zero are hit as well as large ones."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 10.0 ** torch.empty(shape).uniform_(-6, 0, generator=gen)
    return (x.abs() if non_negative else x).to(dtype)


def bucket_edges(qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, the codebook's midpoints): both ends of every 2^16-float bucket in [-1, 1] (>= 0 for an unsigned
    codebook), every midpoint +-1 ulp, NaN and +-0, 63 to a block of 64 after a 1.0 that makes absmax 1."""
    t = ops.midpoints(qmap)
    lo, hi = lut.bucket_bounds()
    y = torch.cat([lo, hi, t, torch.nextafter(t, torch.tensor(2.0)), torch.nextafter(t, torch.tensor(-2.0)),
                   torch.tensor([float("nan"), -0.0, 0.0])])
    y = y[~(y.abs() > 1)]  # keeps NaN
    if bool((qmap >= 0).all()):
        y = y[~(y < 0)]
    n_blocks = -(-y.numel() // 63)
    body = torch.zeros(n_blocks * 63)
    body[: y.numel()] = y
    return torch.cat([torch.ones(n_blocks, 1), body.view(n_blocks, 63)], dim=1).view(-1), t


# ---- codebooks ----

# signed ones for plain and ratio slots, unsigned ones for square-root slots, per width (the C kernels' cases)
SIGNED = {8: policy.ratio_policy(8).qmap(), 6: policy.ratio_policy(6).qmap(), 4: policy.ratio_policy(4).qmap(),
          2: torch.tensor([-1.0, -0.3, 0.0, 1.0])}
UNSIGNED = {8: policy.policy_for("exp_avg_sq", 8).qmap(), 6: torch.linspace(0, 1, 64) ** 2,
            4: policy.policy_for("exp_avg_sq", 4).qmap(), 2: policy.policy_for("exp_avg_sq", 2).qmap()}
# (signed, unsigned) per width (the Triton kernels' cases; roles other than Adam's take them at 6 and 2 bits)
MAPS = {8: (codebooks.dynamic_map(True), codebooks.dynamic_map(False)),
        6: (policy.ratio_policy(6).qmap(), codebooks.power_map(False, 3.0)[::4].contiguous()),
        4: (policy.ratio_policy(4).qmap(), policy.policy_for("exp_avg_sq", 4).qmap()),
        2: (torch.tensor([-1.0, 0.0, 0.5, 1.0]), policy.policy_for("exp_avg_sq", 2).qmap())}


# ---- the C kernels' grouped steps (also the cross-target driver's cases: test_step_driver.py) ----

# each slot's (decode, encode, divisor) as the optimizers declare them (ckptq/optim/*.py STATES)
DECLARED = {"adam": ((RATIO, RATIO, 1), (SQRT, SQRT, -1), (SQRT, SQRT, -1)),
            "nadam": ((RATIO, RATIO, 1), (SQRT, SQRT, -1)), "radam": ((RATIO, RATIO, 1), (SQRT, SQRT, -1)),
            "ademamix": ((NONE, NONE, -1), (NONE, NONE, -1), (SQRT, SQRT, -1)),
            "momentum": ((NONE, NONE, -1),), "adagrad": ((SQRT, SQRT, -1),)}

# the flag words the optimizers use (rmsprop: heavy, centered)
FLAG_WORDS = [("adam", 0), ("adam", 2), ("nadam", 0), ("radam", 0), ("ademamix", 0), ("momentum", 2),
              ("momentum", 4), ("momentum", 0), ("rmsprop", 0), ("rmsprop", 2), ("rmsprop", 4), ("rmsprop", 6),
              ("adagrad", 0)]

# (widths of slots 0, 1, 2; block; (param, grad) dtypes; stochastic; maximize): four per flag word, so that
# every width, dtype pair and rounding meets every rule
VARIANTS = [((8, 8, 8), 64, (torch.float32, torch.float32), False, False),
            ((4, 4, 4), 128, (torch.bfloat16, torch.bfloat16), True, True),
            ((6, 2, 2), 64, (torch.float16, torch.float16), True, False),
            ((2, 8, 4), 256, (torch.bfloat16, torch.float32), False, True)]

# states stored otherwise than their optimizer declares: a first moment of an older file (plain, written back
# as a ratio), a square-root slot stored plain; both through the kernels' generic transform passes
UNSHAPED = [("adam", 0, ((NONE, RATIO, 1), (SQRT, SQRT, -1))),
            ("adam", 2, ((NONE, RATIO, 1), (NONE, SQRT, -1), (SQRT, SQRT, -1))),
            ("nadam", 0, ((NONE, RATIO, 1), (SQRT, SQRT, -1))),
            ("rmsprop", 2, ((NONE, SQRT, -1), (NONE, NONE, -1)))]


def declared_shape(rule: str, flags: int) -> tuple:
    names = rules.RULES[rule].states(flags)
    if rule == "rmsprop":  # square_avg (sqrt), momentum_buffer, grad_avg (plain)
        return ((SQRT, SQRT, -1),) + ((NONE, NONE, -1),) * (len(names) - 1)
    return DECLARED[rule][: len(names)]


def layouts(block: int) -> list:
    """Flat, ending in a short block; rows ending in short blocks; rows of whole blocks (the flat layout)."""
    return [(3 * block + 29, None), (3, 2 * block + 37), (2, 2 * block)]


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
        assert_same(a.p, b.p)
        for j, (x, y) in enumerate(zip(a.codes, b.codes)):
            assert torch.equal(x, y), f"member {i}, slot {j}: codes differ"
        for x, y in zip(a.absmax, b.absmax):
            assert_same(x, y)
    for a, b in zip(got.outs, want.outs):
        assert_same(a, b)


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


# ---- the Triton template's grouped steps (also test_triton_cuda.py's) ----

BLOCK = 64
SHAPES = ((1,), (BLOCK - 1,), (BLOCK + 1,), (3, 70), (2, 2 * BLOCK), (5, 12), (0,), (96,))  # (rows, row_len) or (n,)

# plausible scalars per field (rules.Rule.fields), varied per member; (rule, field) where rules differ
FIELDS = {"decay": 0.999, "l2": 0.01, "one_minus_beta1": 0.1, "beta2": 0.999, "one_minus_beta2": 0.001, "eps": 1e-8,
          "neg_step_size": -1e-2, "bc2_sqrt": 0.3, "decode_eps": 1e-9, "encode_eps": 2e-9, "neg_grad_step": -2e-3,
          "one_minus_beta3": 1e-2, "neg_lr": -1e-2, "bc1": 0.2, "keep": 0.9, "take": 0.1, "c_old": 0.5,
          "c_new": 0.9, "c_grad": 1.0, "one_minus_alpha": 0.01, "momentum": 0.9, "neg_clr": -0.1,
          ("ademamix", "alpha"): 5.0, ("rmsprop", "alpha"): 0.99}


def optimizers() -> dict:
    """rule -> the optimizer class whose STATES give its slots."""
    from ckptq.optim import Adagrad8bit, AdamW8bit, AdEMAMix8bit, NAdam8bit, RAdam8bit, RMSprop8bit, SGD8bit

    return {"adam": AdamW8bit, "nadam": NAdam8bit, "radam": RAdam8bit, "ademamix": AdEMAMix8bit,
            "momentum": SGD8bit, "rmsprop": RMSprop8bit, "adagrad": Adagrad8bit}


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
    from ckptq.optim.spec import codebook

    cls = optimizers()[rule_name]
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
        assert_same(a.p, b.p.cpu())
        for ca, cb in zip(a.codes, b.codes):
            assert torch.equal(ca, cb.cpu())
        for aa, ab in zip(a.absmax, b.absmax):
            assert_same(aa, ab.cpu())


def seeds_for(t: int) -> torch.Tensor:
    return torch.tensor([(2**31 + 7 * i) if i % 2 else 11 * i + 1 for i in range(t)], dtype=torch.int64)


def outs_for(rule, flags, sizes, device) -> tuple:
    if not rules.writes_direction(rule, flags):
        return ()
    return tuple(torch.full((n,), 7.0, device=device) for n in sizes)


def on_device(group_slots):
    return tuple(s._replace(qmap=s.qmap.to(DEVICE), thresholds=s.thresholds.to(DEVICE), encode=s.encode.to(DEVICE))
                 for s in group_slots)


def run_both(rule_name, flags, group_slots, ref, out, grads, seeded, cache, device_slots=None):
    """One step of the reference on ``ref`` and of the Triton template on ``out`` (copies of the same members);
    returns their outs."""
    from ckptq.kernels import triton_group

    rule = rules.RULES[rule_name]
    sizes = [m.p.numel() for m in ref]
    h = hyper(rule, len(ref))
    seeds = seeds_for(len(ref)) if seeded else None
    ref_outs, dev_outs = outs_for(rule, flags, sizes, "cpu"), outs_for(rule, flags, sizes, DEVICE)
    step_torch.step_group(Group(rule_name, flags, tuple(ref), tuple(grads), ref_outs, h, seeds, group_slots, BLOCK,
                                {}))
    group = Group(rule_name, flags, tuple(out), tuple(g.to(DEVICE) for g in grads), dev_outs, h.to(DEVICE),
                  None if seeds is None else seeds.to(DEVICE), device_slots or on_device(group_slots), BLOCK, cache)
    assert triton_group.accepts_step(group)
    triton_group.step(group)
    return ref_outs, dev_outs
