"""The C kernels' grouped steps (``contract.StepGroup`` / ``DenseGroup``) against the PyTorch reference,
bit for bit: the reference steps the members one by one (``backend_torch.adam_step_group``), and the C
kernels must equal it in one call whose threads share the members' blocks; so must the C per-member loop.
Groups of hundreds of small tensors with a big one, irregular rows, every width mix, 1 and 2 threads,
two calls on one cache (new gradients, hyper rows and seeds).
"""

import contextlib

import pytest
import torch

from ckptq.kernels import backend_native, backend_torch
from ckptq.kernels.contract import DenseGroup, GroupMember, StepCodebooks, StepGroup, member_steps
from test_native import _assert_same
from test_native_rows import _hyper, _states

pytestmark = pytest.mark.skipif(not backend_native.available(), reason="C kernels unavailable")


@contextlib.contextmanager
def torch_threads(count: int):
    """torch's thread count (and so the C kernels' pool: ``cpu_runtime.workers``) set to ``count`` inside.
    Only the C calls run under it: small torch ops on two threads of a busy machine take seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def one_thread():
    """Everything but the C calls runs on one thread (test_native_rows does the same)."""
    with torch_threads(1):
        yield


def _shapes(count: int, big: tuple[int, int], gen: torch.Generator) -> list[tuple[int, int]]:
    """(rows, row_len) of ``count`` small members (rows of 1 .. 1,100 elements, whole blocks or not; a
    single row is given as the flat layout) and one big one, in a shuffled order."""
    lengths = torch.tensor([1, 7, 63, 64, 100, 256, 300, 577, 1100])
    small = [(int(r), int(lengths[i])) for r, i in zip(torch.randint(1, 5, (count,), generator=gen),
                                                          torch.randint(0, len(lengths), (count,), generator=gen))]
    order = torch.randperm(count + 1, generator=gen).tolist()
    return [(small + [big])[i] for i in order]


def make_group(shapes, mix, block: int, dtypes, seeded: bool, maximize: bool, seed: int) -> StepGroup:
    """A group of fresh members (the same ones for the same arguments), each with its own hyper row and seed."""
    gen = torch.Generator().manual_seed(seed)
    members, grads = [], []
    for rows, row_len in shapes:
        n = rows * row_len
        states = _states(n, row_len, block, mix, gen)
        p = (torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-4, 1, generator=gen)).to(dtypes[0])
        flat = None if rows == 1 else row_len  # one row is the flat layout: members say so with None
        members.append(GroupMember(p, tuple(s.codes for s in states), tuple(s.absmax for s in states), flat))
        grads.append((torch.randn(n, generator=gen) * 1e-2).to(dtypes[1]))
    books = tuple(StepCodebooks(s.qmap, s.thresholds, s.encode) for s in states)  # shared by all members
    return StepGroup(tuple(members), tuple(grads), _hyper_rows(len(shapes), 4), _seeds(len(shapes), seeded, 1),
                     books, mix, block, True, maximize, {})


def _hyper_rows(count: int, step: int) -> torch.Tensor:
    """fp32 [count, 10]: member i at its own step count and learning rate (AdamW and Adam alternating)."""
    rows = [_hyper(step + i % 5, decoupled=i % 2 == 0) * torch.tensor([1.0] * 6 + [1 + i / count] + [1.0] * 3)
            for i in range(count)]
    return torch.stack(rows)


def _seeds(count: int, seeded: bool, call: int):
    return torch.arange(count, dtype=torch.int64) * 0x9E3779B1 % 2**32 + call if seeded else None


def _next_call(group: StepGroup, call: int) -> StepGroup:
    """The same members and cache with new gradients, hyper rows and seeds."""
    grads = tuple(g * (-1.5) ** call for g in group.grads)
    seeds = None if group.seeds is None else _seeds(len(grads), True, call)
    return group._replace(grads=grads, hyper=_hyper_rows(len(grads), 4 + call), seeds=seeds)


def _member_loop(group: StepGroup) -> None:
    """The C kernels' per-parameter path on each member in turn."""
    for call in member_steps(group):
        backend_native.adam_step(*call)


def _assert_same_members(a: StepGroup, b: StepGroup) -> None:
    for i, (x, y) in enumerate(zip(a.members, b.members)):
        _assert_same(x.p, y.p)
        for k in range(len(a.bits)):
            assert torch.equal(x.codes[k], y.codes[k]), f"member {i}, moment {k}: codes differ"
            _assert_same(x.absmax[k], y.absmax[k])


GROUPS = {  # mix, block, (param dtype, grad dtype), seeded, maximize, big member
    "8+8-fp32": ((8, 8), 256, (torch.float32, torch.float32), False, False, (64, 4096)),
    "6+2+4-bf16-seeded": ((6, 2, 4), 128, (torch.bfloat16, torch.bfloat16), True, True, (48, 2049)),
    "4+4-fp16-seeded": ((4, 4), 64, (torch.float16, torch.float16), True, False, (40, 3 * 64 + 7)),
    "8+8+8-bf16-fp32-grad": ((8, 8, 8), 4096, (torch.bfloat16, torch.float32), False, True, (3, 3 * 4096 + 7)),
    "2+2+2-fp32-seeded": ((2, 2, 2), 512, (torch.float32, torch.float32), True, False, (16, 5000)),
}


@pytest.mark.parametrize("name,threads", [(name, 2) for name in GROUPS] + [("8+8-fp32", 1), ("6+2+4-bf16-seeded", 1)])
def test_group_equals_the_members_one_by_one(name, threads):
    """Hundreds of small members and a big one, two calls on one cache: the C group call (on ``threads``)
    equals the reference's member loop and the C member loop, bit for bit; the second call reuses the
    cached plan."""
    mix, block, dtypes, seeded, maximize, big = GROUPS[name]
    shapes = _shapes(200 if block < 4096 else 60, big, torch.Generator().manual_seed(len(name)))
    groups = [make_group(shapes, mix, block, dtypes, seeded, maximize, seed=7) for _ in range(3)]
    first_plan = None
    for call in range(2):
        if call:
            groups = [_next_call(g, call) for g in groups]
        backend_torch.adam_step_group(groups[0])
        with torch_threads(threads):
            backend_native.adam_step_group(groups[1])
            _member_loop(groups[2])
        plan = groups[1].cache[backend_native._PLAN]
        assert call == 0 or plan is first_plan
        first_plan = plan
        _assert_same_members(groups[0], groups[1])
        _assert_same_members(groups[0], groups[2])


def make_dense(sizes, dtypes, amsgrad: bool, maximize: bool, seed: int) -> DenseGroup:
    gen = torch.Generator().manual_seed(seed)
    params = tuple(torch.randn(n, generator=gen).to(dtypes[0]) for n in sizes)
    grads = tuple((torch.randn(n, generator=gen) * 1e-2).to(dtypes[1]) for n in sizes)
    moments = tuple((torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-5)
                    + ((torch.rand(n, generator=gen) * 2e-5,) if amsgrad else ()) for n in sizes)
    return DenseGroup(params, grads, moments, _hyper_rows(len(sizes), 3), maximize, {})


@pytest.mark.parametrize("dtypes,amsgrad,maximize,threads", [
    ((torch.float32, torch.float32), False, False, 2), ((torch.bfloat16, torch.bfloat16), True, False, 2),
    ((torch.float16, torch.float16), False, True, 1), ((torch.bfloat16, torch.float32), True, True, 2)],
    ids=["fp32", "bf16-amsgrad", "fp16-maximize-1-thread", "bf16-fp32-grad-amsgrad-maximize"])
def test_dense_group_equals_the_reference(dtypes, amsgrad, maximize, threads):
    """Plain fp32 moments (parameters below min_size, and one big): 200 members in one call, twice."""
    gen = torch.Generator().manual_seed(5)
    sizes = torch.randint(1, 4096, (200,), generator=gen).tolist() + [100_003]
    groups = [make_dense(sizes, dtypes, amsgrad, maximize, seed=11) for _ in range(2)]
    for call in range(2):
        groups = [g._replace(grads=tuple(x * (call + 1) for x in g.grads), hyper=_hyper_rows(len(sizes), 3 + call))
                  for g in groups]
        backend_torch.adam_dense_group(groups[0])
        with torch_threads(threads):
            backend_native.adam_dense_group(groups[1])
        for a, b in zip(groups[0].params + sum(groups[0].moments, ()), groups[1].params + sum(groups[1].moments, ())):
            _assert_same(a, b)


def test_a_new_grad_dtype_or_other_members_rebuild_the_plan():
    """A cached plan serves one grad dtype and its members: a call with bf16 gradients after fp32 ones,
    then a group of fewer members, then one whose state tensors were replaced, all on the same cache
    dict, still equal the reference."""
    shapes = [(3, 201), (2, 64), (1, 5000)]
    groups = [make_group(shapes, (8, 8), 64, (torch.float32,) * 2, False, False, seed=3) for _ in range(2)]
    for call, dtype in enumerate((torch.float32, torch.bfloat16)):
        groups = [g._replace(grads=tuple(x.to(dtype) for x in g.grads), hyper=_hyper_rows(3, 4 + call)) for g in groups]
        backend_torch.adam_step_group(groups[0])
        backend_native.adam_step_group(groups[1])
        assert groups[1].cache[backend_native._PLAN].grad_dtype == dtype
        _assert_same_members(groups[0], groups[1])
    fewer = [g._replace(members=g.members[:2], grads=g.grads[:2], hyper=g.hyper[:2]) for g in groups]
    backend_torch.adam_step_group(fewer[0])
    backend_native.adam_step_group(fewer[1])
    _assert_same_members(groups[0], groups[1])
    moved = [g._replace(members=tuple(m._replace(p=m.p.clone(), absmax=tuple(a.clone() for a in m.absmax))
                                      for m in g.members)) for g in fewer]  # say, after a load_state_dict
    backend_torch.adam_step_group(moved[0])
    backend_native.adam_step_group(moved[1])
    _assert_same_members(moved[0], moved[1])
