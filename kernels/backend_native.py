"""The C backend: ``cpu_kernels.c`` (built and loaded by ``native``) called through ctypes on the CPU pool
(ctypes releases the GIL for the length of a call).

quantize / dequantize: each call takes a range of blocks of the row layout (``contract``, "Rows"); the
pool runs chunks of about ``cpu_runtime.native_chunk`` elements. The step: one ``ckq_adam_step_group``
call per pool thread for a whole group, the threads taking (member, block range) items from a shared
counter, so that hundreds of small tensors and a few huge ones balance alike; one parameter's step is a
group of one. The one-state step (``momentum_step`` / ``momentum_step_group``: SGD, Lion, Muon) works the
same way through ``ckq_momentum_step_group``. What a group's members determine (the kernels' config of codebooks and code tables, the
table of member addresses, the work list) is built once into ``group.cache``; a call refreshes only the
gradients' addresses and passes its hyper rows and seeds.

Signatures and contract in ``contract``; results equal ``backend_torch`` bit for bit. ``ckptq.ops`` sends
work here only where the kernels can take it: CPU tensors of ``contract.KERNEL_DTYPES``, codebooks with
a code table (``usable``), the library loaded.
"""

from __future__ import annotations

import ctypes
from typing import Callable, NamedTuple

import numpy as np
import torch

from . import cpu_runtime, legacy_groups, lut, memo, native
from .contract import (KERNEL_DTYPES, DenseGroup, GroupMember, MomentumFlags, MomentumGroup, StepCodebooks, StepFlags,
                       StepGroup, StepState, layout_blocks, layout_rows)

ROWS = True  # quantize, dequantize and the step take rows that are not whole blocks (ckptq.ops routes them here)

# Work items of the grouped steps: about this many elements each (whole blocks). Small enough that two
# threads end within ~50 us of each other, large enough that taking an item (an atomic add) costs nothing.
ITEM_ELEMENTS = 1 << 15
_PLAN = "backend_native"  # the key of this backend's entries in a group's cache


def available() -> bool:
    return native.library() is not None


def why_unavailable() -> str:
    return native.why_unavailable()


def usable(thresholds: torch.Tensor) -> bool:
    """Whether the C kernels can write codes on the codebook of these thresholds (a code table exists)."""
    return memo.by_tensor(lut.native_code_table, thresholds) is not None


def _check(rc: int) -> None:
    # The kernels return -1 only for a block size outside 1..4096, a code width other than 8, 6, 4, 2
    # (narrow widths with blocks that do not start on a byte) or an unknown dtype, which ckptq.ops never passes.
    if rc != 0:
        raise RuntimeError(f"ckptq internal error: the C kernels refused their arguments (code {rc})")


def _decode_map(qmap: torch.Tensor) -> torch.Tensor:
    """The kernels' decode map: 256 fp32 entries (a smaller codebook padded with zeros: its codes never
    index the padding)."""
    if qmap.numel() == 256:
        return qmap
    return torch.cat([qmap, qmap.new_zeros(256 - qmap.numel())])


def _for_blocks(fn, n: int, row_len, block: int, device: torch.device) -> None:
    """fn(b0, b1) over the blocks of n elements in rows of ``row_len``, in chunks of about
    ``native_chunk(n)`` elements, on the CPU pool."""
    rows, length = layout_rows(n, row_len)
    if n:
        per_chunk = max(1, cpu_runtime.native_chunk(n) // min(block, length))  # a block holds <= that many
        cpu_runtime.for_each_chunk(fn, layout_blocks(n, row_len, block), per_chunk, device)


def quantize(src, thresholds, block_size: int, sqrt: bool, codes, absmax, bits: int = 8, row_len=None) -> None:
    lib, table = native.library(), lut.native_code_table(thresholds)
    dtype, length = KERNEL_DTYPES[src.dtype], layout_rows(src.numel(), row_len)[1]
    thr = thresholds.data_ptr() if bits <= 4 else None

    def span(b0: int, b1: int) -> None:
        _check(lib.ckq_quantize(src.data_ptr(), dtype, length, block_size, b0, b1, sqrt, table.data_ptr(),
                                codes.data_ptr(), absmax.data_ptr(), bits, thr))

    _for_blocks(span, src.numel(), row_len, block_size, src.device)


def dequantize(codes, absmax, qmap, block_size: int, sqrt: bool, out, fresh: bool, bits: int = 8,
               row_len=None) -> None:
    lib, qmap = native.library(), _decode_map(qmap)
    length = layout_rows(out.numel(), row_len)[1]

    def span(b0: int, b1: int) -> None:
        _check(lib.ckq_dequantize(codes.data_ptr(), absmax.data_ptr(), qmap.data_ptr(), length, block_size, b0, b1,
                                  sqrt, out.data_ptr(), fresh, bits))

    _for_blocks(span, out.numel(), row_len, block_size, codes.device)


class _Plan(NamedTuple):
    """A grouped step's kernel arguments that follow from its members, kept in ``group.cache``: the call
    is ``kernel(*head, <per-call arguments>, *tail)``."""

    witness: tuple  # member count and the first and last members' addresses when it was built
    grad_dtype: torch.dtype  # the gradients' dtype it was built for (the step's config holds it)
    kernel: Callable  # ckq_adam_step_group or ckq_adam_dense_group
    head: tuple  # the step's config address, then the members' and the gradients' tables' addresses
    grads: np.ndarray  # int64 [count]: the gradients' addresses, refreshed at every call
    tail: tuple  # the work items' address, their count and the shared counter's address
    counter: np.ndarray  # int64 [1]: the next item, shared by the threads of a call
    keep: tuple  # what the addresses point into


def _new_plan(kernel, config, witness, grad_dtype, members: list[list[int]], sizes: list[int], per_item: list[int],
              keep: tuple) -> _Plan:
    """A plan for members (rows of addresses: ``member_t`` / ``dense_member_t``) of ``sizes[i]`` blocks
    (dense: elements), split into work items of ``per_item[i]``."""
    table, grads = np.array(members, dtype=np.int64), np.zeros(len(members), dtype=np.int64)
    counter = np.zeros(1, dtype=np.int64)
    items = _work_items(sizes, per_item)
    head = (() if config is None else (ctypes.addressof(config),)) + (table.ctypes.data, grads.ctypes.data)
    return _Plan(witness, grad_dtype, kernel, head, grads, (items.ctypes.data, len(items), counter.ctypes.data),
                 counter, keep + (config, table, items))


def _work_items(sizes: list[int], per_item: list[int]) -> np.ndarray:
    """(member, first, end) items covering each member's ``sizes[i]`` units ``per_item[i]`` at a time,
    largest first (stable), so that the last items the threads take are small ones."""
    items = [(i, s, min(s + step, size)) for i, (size, step) in enumerate(zip(sizes, per_item))
             for s in range(0, size, step)]
    items.sort(key=lambda item: item[1] - item[2])
    return np.array(items, dtype=np.int64).reshape(-1, 3)


_configs: dict = {}  # step configs by their codebook tensors (identity and version) and flags
_MAX_CONFIGS = 256


def _step_config(books: tuple[StepCodebooks, ...], bits: tuple, block: int, ratio: bool, maximize: bool,
                 dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[native.StepConfig, tuple]:
    """The kernels' config of a step (its codebooks as decode maps, code tables, thresholds; its flags and
    param and grad dtypes) and the tensors it points into; built once per codebook tensors and flags (the
    entry holds the tensors, so their ids stay theirs) and never changed after (threads share it)."""
    key = (tuple((id(t), t._version) for cb in books for t in cb), bits, block, ratio, maximize, dtypes)
    hit = _configs.get(key)
    if hit is not None:
        return hit
    decode = [memo.by_tensor(_decode_map, cb.qmap) for cb in books]
    tables = [memo.by_tensor(lut.native_code_table, cb.thresholds) for cb in books]
    config = native.StepConfig()
    for k, (cb, d, t) in enumerate(zip(books, decode, tables)):
        config.decode[k], config.table[k], config.thresholds[k] = d.data_ptr(), t.data_ptr(), cb.thresholds.data_ptr()
        config.bits[k] = bits[k]
        if k < 2:
            config.encode[k] = cb.encode.data_ptr()
    config.moments, config.block, config.ratio, config.maximize = len(books), block, ratio, maximize
    config.pdtype, config.gdtype = KERNEL_DTYPES[dtypes[0]], KERNEL_DTYPES[dtypes[1]]
    if len(_configs) >= _MAX_CONFIGS:
        _configs.clear()
    hit = _configs[key] = (config, tuple(decode) + tuple(tables) + tuple(books))
    return hit


def _member_row(p: torch.Tensor, codes, absmax, row_len: int) -> list[int]:
    """member_t of cpu_kernels.c: param, codes x 3, absmax x 3 (0 where absent), row length."""
    pad = [0] * (3 - len(codes))
    return [p.data_ptr(), *(c.data_ptr() for c in codes), *pad, *(a.data_ptr() for a in absmax), *pad, row_len]


def _step_plan(members, books, bits: tuple, block: int, ratio: bool, maximize: bool, grad_dtype) -> _Plan:
    """The plan of a step over GroupMembers sharing codebooks, widths, block size and flags."""
    config, keep = _step_config(books, bits, block, ratio, maximize, (members[0].p.dtype, grad_dtype))
    lengths = [layout_rows(m.p.numel(), m.row_len)[1] for m in members]  # flat: one row of all n elements
    rows = [_member_row(m.p, m.codes, m.absmax, length) for m, length in zip(members, lengths)]
    blocks = [layout_blocks(m.p.numel(), m.row_len, block) for m in members]
    per_item = [max(1, ITEM_ELEMENTS // max(1, min(block, length))) for length in lengths]
    return _new_plan(native.library().ckq_adam_step_group, config, _step_witness(members), grad_dtype, rows, blocks,
                     per_item, keep)


def _plan(cache: dict, witness: tuple, grad_dtype: torch.dtype, build) -> _Plan:
    """The cached plan, or a new one. The caller keeps the cache only while its members stay; an O(1)
    check (member count, the first and last members' addresses) still catches a cache kept past that
    (say after ``model.to``), which would otherwise send the kernel to freed memory. A plan serves one
    grad dtype."""
    plan = cache.get(_PLAN)
    if plan is None or plan.witness != witness or plan.grad_dtype != grad_dtype:
        plan = cache[_PLAN] = build()
    return plan


def _step_witness(members) -> tuple:
    first, last = members[0], members[-1]
    return len(members), first.p.data_ptr(), first.codes[0].data_ptr(), last.p.data_ptr(), last.absmax[-1].data_ptr()


def _dense_witness(group: DenseGroup) -> tuple:
    first, last = group.moments[0], group.moments[-1]
    return len(group.params), group.params[0].data_ptr(), first[0].data_ptr(), group.params[-1].data_ptr(), \
        last[1].data_ptr()


def _run(plan: _Plan, middle: tuple, last: tuple = ()) -> None:
    """``plan.kernel(*head, *middle, *tail, *last)`` on as many threads as help (each takes items until
    none are left), after the gradients' addresses were refreshed."""
    items = plan.tail[1]
    if not items:
        return
    plan.counter[0] = 0
    args = (*plan.head, *middle, *plan.tail, *last)

    def work() -> None:
        _check(plan.kernel(*args))

    cpu_runtime.run_on_workers(work, min(cpu_runtime.workers(), items))


def _host(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """t as a contiguous CPU tensor of dtype (itself when it is one already)."""
    return None if t is None else t.to("cpu", dtype).contiguous()


def adam_step_group(group: StepGroup) -> None:
    if not group.members:
        return
    grad_dtype = group.grads[0].dtype
    plan = _plan(group.cache, _step_witness(group.members), grad_dtype, lambda: _step_plan(
        group.members, group.codebooks, tuple(group.bits), group.block_size, group.ratio, group.maximize, grad_dtype))
    plan.grads[:] = [g.data_ptr() for g in group.grads]
    hyper, seeds = _host(group.hyper, torch.float32), _host(group.seeds, torch.int64)
    _run(plan, (hyper.data_ptr(), None if seeds is None else seeds.data_ptr()))


def adam_step(p, g, states: tuple[StepState, ...], h, flags: StepFlags) -> None:
    """One parameter: the grouped kernel on a group of one (same bits), without the group's objects."""
    books = tuple(StepCodebooks(s.qmap, s.thresholds, s.encode) for s in states)
    member = GroupMember(p, tuple(s.codes for s in states), tuple(s.absmax for s in states), flags.row_len or p.numel())
    plan = _step_plan((member,), books, tuple(s.bits for s in states), flags.block_size, flags.ratio, flags.maximize,
                      g.dtype)
    plan.grads[0] = g.data_ptr()
    seeds = None if flags.seed is None else np.array([flags.seed], dtype=np.int64)
    _run(plan, (h.data_ptr(), None if seeds is None else seeds.ctypes.data))


def _dense_plan(group: DenseGroup) -> _Plan:
    rows = [[p.data_ptr(), m[0].data_ptr(), m[1].data_ptr(), m[2].data_ptr() if len(m) > 2 and m[2] is not None else 0]
            for p, m in zip(group.params, group.moments)]
    sizes = [p.numel() for p in group.params]
    return _new_plan(native.library().ckq_adam_dense_group, None, _dense_witness(group), group.grads[0].dtype, rows,
                     sizes, [ITEM_ELEMENTS] * len(sizes), ())


def adam_dense_group(group: DenseGroup) -> None:
    if not group.params:
        return
    plan = _plan(group.cache, _dense_witness(group), group.grads[0].dtype, lambda: _dense_plan(group))
    plan.grads[:] = [g.data_ptr() for g in group.grads]
    hyper = _host(group.hyper, torch.float32)
    dtypes = (KERNEL_DTYPES[group.params[0].dtype], KERNEL_DTYPES[group.grads[0].dtype])
    _run(plan, (hyper.data_ptr(),), (*dtypes, group.maximize))


# The one-state step (SGD, Lion, Muon): ckq_momentum_step_group over a plan as the Adam step's, one state
# per member (member_t's first codes/absmax pair); outs (UPDATE_NONE's d) and hyper rows of 8 per call.

_momentum_configs: dict = {}


def _momentum_config(books: StepCodebooks, bits: int, block: int, maximize: bool, update: int,
                     dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[native.MomentumConfig, tuple]:
    """The kernels' config of a one-state step and the tensors it points into (as ``_step_config``)."""
    key = (tuple((id(t), t._version) for t in books), bits, block, maximize, update, dtypes)
    hit = _momentum_configs.get(key)
    if hit is not None:
        return hit
    decode = memo.by_tensor(_decode_map, books.qmap)
    table = memo.by_tensor(lut.native_code_table, books.thresholds)
    config = native.MomentumConfig(decode.data_ptr(), table.data_ptr(), books.thresholds.data_ptr(),
                                   books.encode.data_ptr(), bits, block, int(maximize), int(update),
                                   KERNEL_DTYPES[dtypes[0]], KERNEL_DTYPES[dtypes[1]])
    if len(_momentum_configs) >= _MAX_CONFIGS:
        _momentum_configs.clear()
    hit = _momentum_configs[key] = (config, (decode, table, books))
    return hit


def _momentum_plan(members, books: StepCodebooks, bits: int, block: int, maximize: bool, update: int,
                   grad_dtype) -> _Plan:
    config, keep = _momentum_config(books, bits, block, maximize, update, (members[0].p.dtype, grad_dtype))
    lengths = [layout_rows(m.p.numel(), m.row_len)[1] for m in members]
    rows = [_member_row(m.p, m.codes, m.absmax, length) for m, length in zip(members, lengths)]
    blocks = [layout_blocks(m.p.numel(), m.row_len, block) for m in members]
    per_item = [max(1, ITEM_ELEMENTS // max(1, min(block, length))) for length in lengths]
    return _new_plan(native.library().ckq_momentum_step_group, config, _step_witness(members), grad_dtype, rows,
                     blocks, per_item, keep)


def _outs_table(outs) -> np.ndarray | None:
    return np.array([o.data_ptr() for o in outs], dtype=np.int64) if outs else None


def momentum_step_group(group: MomentumGroup) -> None:
    if not group.members:
        return
    grad_dtype = group.grads[0].dtype
    plan = _plan(group.cache, _step_witness(group.members) + (group.update, group.maximize), grad_dtype, lambda: _momentum_plan(
        group.members, group.codebooks, group.bits, group.block_size, group.maximize, group.update, grad_dtype))
    plan.grads[:] = [g.data_ptr() for g in group.grads]
    hyper, seeds = _host(group.hyper, torch.float32), _host(group.seeds, torch.int64)
    outs = _outs_table(group.outs)
    _run(plan, (None if outs is None else outs.ctypes.data, hyper.data_ptr(),
                None if seeds is None else seeds.data_ptr()))


def momentum_step(p, g, state: StepState, h, out, flags: MomentumFlags) -> None:
    """One parameter: the grouped kernel on a group of one."""
    member = GroupMember(p, (state.codes,), (state.absmax,), flags.row_len or p.numel())
    plan = _momentum_plan((member,), StepCodebooks(state.qmap, state.thresholds, state.encode), state.bits,
                          flags.block_size, flags.maximize, flags.update, g.dtype)
    plan.grads[0] = g.data_ptr()
    outs = None if out is None else np.array([out.data_ptr()], dtype=np.int64)
    seeds = None if flags.seed is None else np.array([flags.seed], dtype=np.int64)
    h = _host(h, torch.float32)
    _run(plan, (None if outs is None else outs.ctypes.data, h.data_ptr(), None if seeds is None else seeds.ctypes.data))


# The one step (contract.Group / Dense, ckptq.kernels.registry): the rules the kernels above implement.

def _takes(members, grads, thresholds) -> bool:
    dtypes = {m.p.dtype for m in members} | {g.dtype for g in grads}
    return available() and dtypes <= set(KERNEL_DTYPES) and all(map(usable, thresholds))


def accepts_step(group) -> bool:
    legacy = legacy_groups.adam_group(group) or legacy_groups.momentum_group(group)
    return legacy is not None and _takes(group.members, group.grads, [s.thresholds for s in group.slots])


def step(group) -> None:
    legacy = legacy_groups.adam_group(group)
    if legacy is not None:
        adam_step_group(legacy)
    else:
        momentum_step_group(legacy_groups.momentum_group(group))


def accepts_dense(group) -> bool:
    return legacy_groups.adam_dense(group) is not None and available() and \
        {p.dtype for p in group.params} | {g.dtype for g in group.grads} <= set(KERNEL_DTYPES)


def dense(group) -> None:
    adam_dense_group(legacy_groups.adam_dense(group))
