"""The grouped step where grouping matters (``contract.Group`` / ``Dense`` of many members in one call) against
the PyTorch reference, which steps the members one by one (``step_torch.step_group`` / ``dense_group``), bit
for bit; test_step.py covers every rule, flag word and width on small groups.

The C kernels (``backend_native.step`` / ``dense``: one call whose threads share the members' blocks): groups
of hundreds of small tensors with a big one, irregular rows, width mixes, 1 and 2 threads, two calls on one
cache (new gradients, hyper rows and seeds), a cache that must be rebuilt, a rule that writes its direction.
The Triton template (``triton_group.step``, the interpreter on the CPU): its cache built once and the call
table rewritten only for new tensors, narrow tiles for short rows.
"""

import contextlib

import pytest
import torch

from ckptq.kernels import registry, rules, step_torch
from ckptq.kernels.contract import Group
from tests.kernels.cases import (BLOCK, DEVICE, assert_members_equal, assert_same, assert_same_groups, clone_dense,
                                 clone_group, gradients, hyper, make_dense, make_group, members, on, on_device,
                                 outs_for, over, slots)

pytestmark = pytest.mark.usefixtures("one_thread")  # everything but the C calls runs on one thread


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


def _layouts(count: int, big: tuple[int, int], gen: torch.Generator) -> list[tuple[int, int | None]]:
    """(rows, row_len) of ``count`` small members (rows of 1 .. 1,100 elements, whole blocks or not; a
    single row given as the flat layout: (n, None)) and one big one, in a shuffled order."""
    lengths = torch.tensor([1, 7, 63, 64, 100, 256, 300, 577, 1100])
    small = []
    for r, i in zip(torch.randint(1, 5, (count,), generator=gen), torch.randint(0, len(lengths), (count,), generator=gen)):
        rows, length = int(r), int(lengths[i])
        small.append((length, None) if rows == 1 else (rows, length))
    order = torch.randperm(count + 1, generator=gen).tolist()
    return [(small + [big])[i] for i in order]


def _next_call(group, call: int):
    """The same members and cache with new gradients, hyper rows and seeds."""
    grads = tuple(g * (-1.5) ** call for g in group.grads)
    seeds = None if group.seeds is None else group.seeds + call
    return group._replace(grads=grads, hyper=group.hyper * (1 + 0.1 * call), seeds=seeds)


GROUPS = {  # rule, flags, widths, block, (param dtype, grad dtype), seeded, big member
    "adam-8+8-fp32": ("adam", 0, (8, 8), 256, (torch.float32, torch.float32), False, (64, 4096)),
    "adam-6+2+4-bf16-seeded-maximize": ("adam", 3, (6, 2, 4), 128, (torch.bfloat16,) * 2, True, (48, 2049)),
    "momentum-4-fp16-seeded": ("momentum", 2, (4,), 64, (torch.float16,) * 2, True, (40, 3 * 64 + 7)),
    "momentum-direction-8-bf16-fp32-grad": ("momentum", 0, (8,), 4096, (torch.bfloat16, torch.float32), False,
                                            (3, 3 * 4096 + 7)),
    "rmsprop-2+2+2-fp32-seeded": ("rmsprop", 6, (2, 2, 2), 512, (torch.float32,) * 2, True, (16, 5000)),
}


@over("name,threads", [("native", name, 2) for name in GROUPS] + [("native", "adam-8+8-fp32", 1),
                                                                  ("native", "adam-6+2+4-bf16-seeded-maximize", 1)])
def test_group_equals_the_members_one_by_one(kernel, name, threads):
    """Hundreds of small members and a big one, two calls on one cache: the C group call (on ``threads``)
    equals the reference's member loop, bit for bit; the second call reuses the cached plan."""
    backend_native = registry.backend("native")
    rule, flags, widths, block, dtypes, seeded, big = GROUPS[name]
    layouts = _layouts(200 if block < 4096 else 60, big, torch.Generator().manual_seed(len(name)))
    group = make_group(rule, flags, widths, layouts, block, dtypes, seeded, seed=7)
    want, got = clone_group(group), clone_group(group)
    first_plan = None
    for call in range(2):
        if call:
            want, got = _next_call(want, call), _next_call(got, call)
        step_torch.step_group(want)
        with torch_threads(threads):
            backend_native.step(got)
        plan = got.cache[backend_native._PLAN]
        assert call == 0 or plan is first_plan
        first_plan = plan
        assert_same_groups(got, want)


@over("rule,flags,dtypes,threads", [
    ("native", "adam", 0, (torch.float32,) * 2, 2), ("native", "adam", 3, (torch.bfloat16,) * 2, 2),
    ("native", "momentum", 0, (torch.float16,) * 2, 1), ("native", "rmsprop", 6, (torch.bfloat16, torch.float32), 2)],
    ids=["native-adam-fp32", "native-adam-amsgrad-maximize-bf16", "native-momentum-direction-fp16-1-thread",
         "native-rmsprop-bf16-fp32-grad"])
def test_dense_group_equals_the_reference(kernel, rule, flags, dtypes, threads):
    """Plain fp32 states (parameters below min_size, and one big): 200 members in one call, twice."""
    backend_native = registry.backend("native")
    sizes = torch.randint(1, 4096, (200,), generator=torch.Generator().manual_seed(5)).tolist() + [100_003]
    group = make_dense(rule, flags, sizes, dtypes, seed=11)
    want, got = clone_dense(group), clone_dense(group)
    for call in range(2):
        grads, hyper_rows = tuple(x * (call + 1) for x in group.grads), group.hyper * (1 + call)
        want, got = want._replace(grads=grads, hyper=hyper_rows), got._replace(grads=grads, hyper=hyper_rows)
        step_torch.dense_group(want)
        with torch_threads(threads):
            backend_native.dense(got)
        for a, b in zip(got.params + sum(got.states, ()) + got.outs, want.params + sum(want.states, ()) + want.outs):
            assert_same(a, b)


@over("rule", [("native", "adam")])
def test_a_new_grad_dtype_or_other_members_rebuild_the_plan(kernel, rule):
    """A cached plan serves its members: a call with bf16 gradients after fp32 ones (another config, the
    same plan), then a group of fewer members, then one whose state tensors were replaced, all on the same
    cache dict, still equal the reference."""
    backend_native = registry.backend("native")
    group = make_group(rule, 0, (8, 8), [(3, 201), (2, 64), (5000, None)], 64, (torch.float32,) * 2, False, seed=3)
    want, got = clone_group(group), clone_group(group)
    for call, dtype in enumerate((torch.float32, torch.bfloat16)):
        grads = tuple(x.to(dtype) * (call + 1) for x in group.grads)
        want, got = want._replace(grads=grads), got._replace(grads=grads)
        step_torch.step_group(want)
        backend_native.step(got)
        assert_same_groups(got, want)
    fewer = [g._replace(members=g.members[:2], grads=g.grads[:2], hyper=g.hyper[:2]) for g in (want, got)]
    step_torch.step_group(fewer[0])
    backend_native.step(fewer[1])
    assert_same_groups(fewer[1], fewer[0])
    moved = [g._replace(members=tuple(m._replace(p=m.p.clone(), absmax=tuple(a.clone() for a in m.absmax))
                                      for m in g.members)) for g in fewer]  # say, after a load_state_dict
    step_torch.step_group(moved[0])
    backend_native.step(moved[1])
    assert_same_groups(moved[1], moved[0])


@over("rule", [("native", "momentum")])
def test_a_rule_that_writes_its_direction_leaves_the_parameter(kernel, rule):
    """Muon's momentum step (neither LINEAR nor SIGN) writes d to out and leaves p as it was."""
    group = make_group(rule, 0, (8,), [(3, 100)], 64, (torch.bfloat16,) * 2, True, seed=2)
    got = clone_group(group)
    registry.backend("native").step(got)
    assert torch.equal(got.members[0].p, group.members[0].p)
    assert not torch.equal(got.outs[0], group.outs[0])
    assert rules.writes_direction(rules.MOMENTUM, 0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@over("rule", [("triton", "momentum")])
def test_the_cache_is_built_once_and_the_call_table_follows_new_tensors(kernel, rule):
    """Three steps of a direction rule on one cache: new gradient and out tensors (the call table is
    rewritten), then the same tensors refilled in place (it is kept)."""
    from ckptq.kernels import triton_group

    gen = torch.Generator().manual_seed(3)
    group_slots = slots(rule, 0, (4,))
    ref = members(group_slots, torch.float32, gen)
    out = [on(m, DEVICE) for m in ref]
    sizes = [m.p.numel() for m in ref]
    r, cache, dev_slots = rules.MOMENTUM, {}, on_device(group_slots)
    grads = dev_grads = outs = None
    for step in (1, 2, 3):
        if step < 3:
            grads = gradients(sizes, torch.float32, gen)
            dev_grads = [g.to(DEVICE) for g in grads]
            outs = outs_for(r, 0, sizes, DEVICE)
        else:
            for g, d in zip(grads, dev_grads):
                g.copy_(torch.randn(g.numel(), generator=gen))
                d.copy_(g)
        ref_outs = outs_for(r, 0, sizes, "cpu")
        h = hyper(r, len(ref)) * step
        step_torch.step_group(Group(rule, 0, tuple(ref), tuple(grads), ref_outs, h, None, group_slots, BLOCK, {}))
        triton_group.step(Group(rule, 0, tuple(out), tuple(dev_grads), outs, h.to(DEVICE), None, dev_slots,
                                BLOCK, cache))
        assert_members_equal(ref, out)
        for a, b in zip(ref_outs, outs):
            assert_same(a, b.cpu())
        kept = cache["triton"]
        if step == 1:
            tables = kept["members"]
        assert kept["members"] is tables
        assert kept["call_key"] == tuple(g.data_ptr() for g in dev_grads) + tuple(o.data_ptr() for o in outs)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@over("rule", [("triton", "adam")])
def test_short_rows_take_narrow_tiles(kernel, rule):
    """When every row is short (20 and 9 elements, block 256), tiles are as wide as the longest row (32)
    and hold more blocks: the same bits as the reference's blocks of 256."""
    from ckptq.kernels import contract, triton_group

    gen = torch.Generator().manual_seed(5)
    group_slots = slots(rule, 0, (4, 2))
    ref = members(group_slots, torch.float32, gen, shapes=((4, 20), (6, 9)))
    ref = [m._replace(absmax=tuple(a[: contract.layout_blocks(m.p.numel(), m.row_len, 256)] for a in m.absmax))
           for m in ref]  # one block per row at block 256
    out, cache, h = [on(m, DEVICE) for m in ref], {}, hyper(rules.ADAM, 2)
    grads = gradients([m.p.numel() for m in ref], torch.float32, gen)
    step_torch.step_group(Group(rule, 0, tuple(ref), tuple(grads), (), h, None, group_slots, 256, {}))
    triton_group.step(Group(rule, 0, tuple(out), tuple(g.to(DEVICE) for g in grads), (), h.to(DEVICE), None,
                            on_device(group_slots), 256, cache))
    assert_members_equal(ref, out)
    assert (cache["triton"]["block"], cache["triton"]["per_program"]) == (32, 64)
