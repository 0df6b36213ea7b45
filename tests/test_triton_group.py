"""The grouped Triton steps (``triton_group.adam_step_group`` / ``adam_dense_group``: one launch over a
chunk table of many parameters) against the reference, which steps the members one by one
(``backend_torch.adam_step_group`` / ``adam_dense_group``): params, codes and scales equal bit for bit, over
members of mixed sizes and row layouts (flat, whole blocks, short last blocks, a single element, an empty
one), every width mix, fp32/bf16/fp16, amsgrad, maximize, per-member hyper rows and seeds; and the cache:
built once, the gradient table refreshed when a gradient is a new tensor, not when it is reused.
On the CPU the kernels run in Triton's interpreter (conftest.py): small sizes.
"""

import os

import pytest
import torch

from ckptq.codec import ops
from ckptq.kernels import backend_torch
from ckptq.kernels.contract import DenseGroup, GroupMember, StepCodebooks, StepGroup
from test_native import _assert_same
from test_triton_rows import MAPS, row_states

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton runs here only under TRITON_INTERPRET=1 (set by conftest.py)", allow_module_level=True)
pytest.importorskip("triton")
from ckptq.kernels import backend_triton, triton_group  # noqa: E402, F401  (imports triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 64
SHAPES = ((3, 65), (200,), (2, 128), (1,), (5, 201), (0,), (7, 1))  # (rows, row_len) or (n,): flat
ALIGNED_SHAPES = ((3, 80), (2, 128), (96,), (0,))  # every row a multiple of 16: the kernel's vectorizing path


def _hyper(t: int, step: int, decoupled: bool = True) -> torch.Tensor:
    """fp32 [t, 10]: a different lr and step per member (contract.HYPER_FIELDS)."""
    rows = []
    for i in range(t):
        lr, wd, s = 1e-3 * (i + 1), 0.1, step + i
        bc1, bc2 = 1 - 0.9**s, (1 - 0.999**s) ** 0.5
        rows.append([1 - lr * wd if decoupled else 1.0, 0.0 if decoupled else wd, 0.1, 0.999, 0.001, 1e-8, -lr / bc1,
                     bc2, 1e-9, 1e-9 * (1 + i % 2)])
    return torch.tensor(rows, dtype=torch.float32)


def _members(widths, pdtype, amsgrad, gen, shapes=SHAPES):
    """GroupMembers on the CPU (reference copies are made from them), one per shape."""
    out = []
    for shape in shapes:
        n = shape[0] * shape[1] if len(shape) == 2 else shape[0]
        row_len = shape[1] if len(shape) == 2 else None
        states = row_states(widths, n, row_len, amsgrad, gen) if n else \
            [(torch.empty(0, dtype=torch.uint8), torch.empty(0), None)] * (3 if amsgrad else 2)
        p = torch.randn(n, generator=gen).to(pdtype)
        out.append(GroupMember(p, tuple(c for c, _, _ in states), tuple(a for _, a, _ in states), row_len))
    return out


def _on(member: GroupMember, device) -> GroupMember:
    return GroupMember(member.p.to(device, copy=True), tuple(c.to(device, copy=True) for c in member.codes),
                       tuple(a.to(device, copy=True) for a in member.absmax), member.row_len)


def _codebooks(widths, amsgrad, device):
    """Per moment (decode map, midpoints of the encode map, encode map); exp_avg decodes with one map and
    encodes with another, so that a swapped kernel argument shows."""
    out = []
    for k, bits in enumerate(widths[: 3 if amsgrad else 2]):
        qmap = MAPS[bits][min(k, 1)]
        encode = qmap if k else torch.sort(torch.cat([qmap[:1], qmap[1:-1] * 0.9, qmap[-1:]])).values
        out.append(StepCodebooks(qmap.to(device), ops.midpoints(encode).to(device), encode.to(device)))
    return tuple(out)


def _group(members, grads, hyper, seeds, widths, amsgrad, maximize, device, cache):
    return StepGroup(tuple(members), tuple(grads), hyper.to(device), None if seeds is None else seeds.to(device),
                     _codebooks(widths, amsgrad, device), tuple(widths[: 3 if amsgrad else 2]), BLOCK, True,
                     maximize, cache)


def _assert_members_equal(ref, out):
    for a, b in zip(ref, out):
        _assert_same(a.p, b.p.cpu())
        for ca, cb in zip(a.codes, b.codes):
            assert torch.equal(ca, cb.cpu())
        for aa, ab in zip(a.absmax, b.absmax):
            _assert_same(aa, ab.cpu())


CASES = (  # widths, param dtype, grad dtype, amsgrad, maximize, seeded, member shapes
    ((6, 2, 4), torch.float32, torch.float32, True, False, True, SHAPES),
    ((4, 4, 4), torch.bfloat16, torch.bfloat16, False, True, True, SHAPES),
    ((8, 8, 8), torch.float16, torch.float16, True, True, False, SHAPES),
    ((2, 2, 2), torch.bfloat16, torch.float32, False, False, False, SHAPES),
    ((8, 2, 6), torch.float32, torch.bfloat16, True, False, True, SHAPES),
    ((6, 2, 4), torch.bfloat16, torch.bfloat16, True, True, True, ALIGNED_SHAPES),
    ((8, 8), torch.float32, torch.float32, False, False, False, ALIGNED_SHAPES),
)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("widths,pdtype,gdtype,amsgrad,maximize,seeded,shapes", CASES)
def test_grouped_step_equals_the_members_stepped_one_by_one(widths, pdtype, gdtype, amsgrad, maximize, seeded, shapes):
    """Two steps on one cache: the second with new gradient tensors (their table is rewritten), then a
    third with the second's tensors refilled in place (the table is kept)."""
    gen = torch.Generator().manual_seed(sum(widths))
    members = _members(widths, pdtype, amsgrad, gen, shapes)
    ref, out, cache = [_on(m, "cpu") for m in members], [_on(m, DEVICE) for m in members], {}
    seeds = torch.tensor([(2**31 + 7 * i) if i % 2 else 11 * i for i in range(len(members))]) if seeded else None
    grads = None
    for step in (1, 2, 3):
        if step < 3:
            grads = [torch.randn(m.p.numel(), generator=gen).to(gdtype) for m in members]
            dev_grads = [g.to(DEVICE) for g in grads]
        else:
            for g, d in zip(grads, dev_grads):
                g.copy_(torch.randn(g.numel(), generator=gen).to(gdtype))
                d.copy_(g)
        hyper = _hyper(len(members), step, decoupled=step != 2)
        backend_torch.adam_step_group(_group(ref, grads, hyper, seeds, widths, amsgrad, maximize, "cpu", {}))
        triton_group.adam_step_group(_group(out, dev_grads, hyper, seeds, widths, amsgrad, maximize, DEVICE, cache))
        _assert_members_equal(ref, out)
        assert cache["triton"]["grad_key"] == tuple(g.data_ptr() for g in dev_grads)
    kinds = [aligned for _, _, aligned in cache["triton"]["launches"]]  # vectorizing members, then the others
    assert kinds == ([True] if shapes == ALIGNED_SHAPES else [True, False])


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_grouped_step_tiles_short_rows_narrowly():
    """When every row is short (here 20 and 9 elements, block 256), tiles are as wide as the longest row
    (32) and hold more blocks: the same bits as the reference's blocks of 256."""
    gen = torch.Generator().manual_seed(5)
    members = []
    for rows, row_len in ((4, 20), (6, 9)):
        states = row_states((4, 2), rows * row_len, row_len, False, gen, block=256)
        members.append(GroupMember(torch.randn(rows * row_len, generator=gen), tuple(c for c, _, _ in states),
                                   tuple(a for _, a, _ in states), row_len))
    ref, out, cache = [_on(m, "cpu") for m in members], [_on(m, DEVICE) for m in members], {}
    grads = [torch.randn(m.p.numel(), generator=gen) for m in members]
    hyper = _hyper(2, 4)
    group = _group(ref, grads, hyper, None, (4, 2), False, False, "cpu", {})._replace(block_size=256)
    backend_torch.adam_step_group(group)
    triton_group.adam_step_group(group._replace(members=tuple(out), grads=tuple(g.to(DEVICE) for g in grads),
                                                  hyper=hyper.to(DEVICE), codebooks=_codebooks((4, 2), False, DEVICE),
                                                  cache=cache))
    _assert_members_equal(ref, out)
    assert (cache["triton"]["block"], cache["triton"]["per_program"]) == (32, 64)


def _dense(pdtype, amsgrad, gen):
    params, moments = [], []
    for n in ((1, 300, 2048 + 5, 0, 77, 2096) if pdtype != torch.float16 else (16, 2048 + 32, 0)):  # fp16: aligned
        params.append(torch.randn(n, generator=gen).to(pdtype))
        moments.append(tuple([torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 1e-2] +
                             ([torch.rand(n, generator=gen) * 2e-2] if amsgrad else [])))
    return params, moments


@pytest.mark.parametrize("pdtype,gdtype,amsgrad,maximize", (
    (torch.float32, torch.float32, False, False), (torch.bfloat16, torch.bfloat16, True, True),
    (torch.float16, torch.float32, True, False), (torch.bfloat16, torch.float32, False, True)))
def test_dense_group_equals_adam_dense_step_on_each(pdtype, gdtype, amsgrad, maximize):
    gen = torch.Generator().manual_seed(7)
    params, moments = _dense(pdtype, amsgrad, gen)
    out_p, out_m, cache = [p.to(DEVICE, copy=True) for p in params], [tuple(t.to(DEVICE, copy=True) for t in ms) for ms in moments], {}
    for step in (1, 2):
        grads = [torch.randn(p.numel(), generator=gen).to(gdtype) for p in params]
        hyper = _hyper(len(params), step, decoupled=step == 1)
        backend_torch.adam_dense_group(DenseGroup(tuple(params), tuple(grads), tuple(moments), hyper, maximize, {}))
        triton_group.adam_dense_group(DenseGroup(tuple(out_p), tuple(g.to(DEVICE) for g in grads), tuple(out_m),
                                                   hyper.to(DEVICE), maximize, cache))
        for p, q, ms, qs in zip(params, out_p, moments, out_m):
            _assert_same(p, q.cpu())
            for a, b in zip(ms, qs):
                _assert_same(a, b.cpu())
    kinds = [aligned for _, _, aligned in cache["triton"]["launches"]]  # vectorizing members, then the others
    assert kinds == ([True] if pdtype == torch.float16 else [True, False]) and cache["triton"]["grads_aligned"]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
def test_dense_group_handles_special_values():
    """NaN, Inf and huge gradients (v overflows to Inf) with amsgrad: NaN propagates through the maximum."""
    gen = torch.Generator().manual_seed(3)
    params, moments = _dense(torch.float32, True, gen)
    g = [torch.randn(p.numel(), generator=gen) for p in params]
    g[1][5], g[1][9], g[2][-10:] = float("nan"), float("inf"), 1e20
    out_p, out_m = [p.to(DEVICE, copy=True) for p in params], [tuple(t.to(DEVICE, copy=True) for t in ms) for ms in moments]
    hyper = _hyper(len(params), 3)
    backend_torch.adam_dense_group(DenseGroup(tuple(params), tuple(g), tuple(moments), hyper, False, {}))
    triton_group.adam_dense_group(DenseGroup(tuple(out_p), tuple(x.to(DEVICE) for x in g), tuple(out_m),
                                               hyper.to(DEVICE), False, {}))
    assert bool(torch.isnan(params[1]).any()) and bool(torch.isinf(moments[2][1]).any())
    for p, q, ms, qs in zip(params, out_p, moments, out_m):
        _assert_same(p, q.cpu())
        for a, b in zip(ms, qs):
            _assert_same(a, b.cpu())
