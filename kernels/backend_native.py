"""The C backend: ``cpu_kernels.c`` (built and loaded by ``native``) called through ctypes on the CPU pool
(ctypes releases the GIL for the length of a call).

quantize / dequantize: each call takes a range of blocks of the row layout (``contract``, "Rows"); the
pool runs chunks of about ``cpu_runtime.native_chunk`` elements. The step: one ``ckq_adam_step_group``
call per pool thread for a whole group, the threads taking (member, block range) items from a shared
counter, so that hundreds of small tensors and a few huge ones balance alike; one parameter's step is a
group of one. What a group's members determine (the kernels' config of codebooks and code tables, the
table of member addresses, the work list) is built once into ``group.cache``; a call refreshes only the
gradients' addresses and passes its hyper rows and seeds.

Signatures and contract in ``contract``; results equal ``backend_torch`` bit for bit. ``ckptq.ops`` sends
work here only where the kernels can take it: CPU tensors of ``contract.KERNEL_DTYPES``, codebooks with
a code table (``usable``), the library loaded.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np
import torch

from . import cpu_runtime, lut, memo, native
from .contract import (KERNEL_DTYPES, DenseGroup, GroupMember, StepCodebooks, StepFlags, StepGroup, StepState,
                       layout_blocks, layout_rows)

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
    """What a grouped step keeps in ``group.cache``: the kernel's arguments that follow from the members."""

    count: int  # members
    config: native.StepConfig | None  # the step's shared config (None: the dense step)
    members: np.ndarray  # int64 [count, 8] (member_t) or [count, 4] (dense_member_t): addresses
    grads: np.ndarray  # int64 [count]: the gradients' addresses, refreshed at every call
    items: np.ndarray  # int64 [k, 3]: (member, first, end) blocks (dense: elements)
    counter: np.ndarray  # int64 [1]: the next item, shared by the threads of a call
    keep: tuple  # tensors whose addresses the config holds


def _work_items(sizes: list[int], per_item: list[int]) -> np.ndarray:
    """(member, first, end) items covering each member's ``sizes[i]`` units ``per_item[i]`` at a time,
    largest first (stable), so that the last items the threads take are small ones."""
    items = [(i, s, min(s + step, size)) for i, (size, step) in enumerate(zip(sizes, per_item))
             for s in range(0, size, step)]
    items.sort(key=lambda item: item[1] - item[2])
    return np.array(items, dtype=np.int64).reshape(-1, 3)


def _step_config(group: StepGroup) -> tuple[native.StepConfig, tuple]:
    """The kernels' config of a group (its codebooks as decode maps, code tables, thresholds; its flags)
    and the tensors it points into."""
    books: tuple[StepCodebooks, ...] = group.codebooks
    decode = [memo.by_tensor(_decode_map, cb.qmap) for cb in books]
    tables = [memo.by_tensor(lut.native_code_table, cb.thresholds) for cb in books]
    config = native.StepConfig()
    for k, (cb, d, t) in enumerate(zip(books, decode, tables)):
        config.decode[k], config.table[k], config.thresholds[k] = d.data_ptr(), t.data_ptr(), cb.thresholds.data_ptr()
        config.bits[k] = group.bits[k]
        if k < 2:
            config.encode[k] = cb.encode.data_ptr()
    config.moments, config.block, config.ratio = len(books), group.block_size, group.ratio
    config.maximize, config.pdtype = group.maximize, KERNEL_DTYPES[group.members[0].p.dtype]
    return config, tuple(decode) + tuple(tables) + tuple(books)


def _member_row(m: GroupMember) -> list[int]:
    """member_t of cpu_kernels.c: param, codes x 3, absmax x 3 (0 where absent), row length."""
    codes = [c.data_ptr() for c in m.codes] + [0] * (3 - len(m.codes))
    absmax = [a.data_ptr() for a in m.absmax] + [0] * (3 - len(m.absmax))
    return [m.p.data_ptr(), *codes, *absmax, m.row_len]


def _step_plan(group: StepGroup) -> _Plan:
    config, keep = _step_config(group)
    members = np.array([_member_row(m) for m in group.members], dtype=np.int64)
    blocks = [layout_blocks(m.p.numel(), m.row_len, group.block_size) for m in group.members]
    per_item = [max(1, ITEM_ELEMENTS // max(1, min(group.block_size, m.row_len))) for m in group.members]
    return _Plan(len(members), config, members, np.zeros(len(members), dtype=np.int64), _work_items(blocks, per_item),
                 np.zeros(1, dtype=np.int64), keep)


def _plan(cache: dict, count: int, build) -> _Plan:
    plan = cache.get(_PLAN)
    if plan is None or plan.count != count:  # the caller keeps the cache only while its members stay
        plan = cache[_PLAN] = build()
    return plan


def _run(plan: _Plan, kernel, *args) -> None:
    """``kernel(*args, items, n_items, counter, ...)`` on as many threads as help (each takes items until
    none are left), after the gradients' addresses were refreshed."""
    items = len(plan.items)
    if not items:
        return
    plan.counter[0] = 0

    def work() -> None:
        _check(kernel(*args))

    cpu_runtime.run_on_workers(work, min(cpu_runtime.workers(), items))


def _host(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """t as a contiguous CPU tensor of dtype (itself when it is one already)."""
    return None if t is None else t.to("cpu", dtype).contiguous()


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def adam_step_group(group: StepGroup) -> None:
    if not group.members:
        return
    plan = _plan(group.cache, len(group.members), lambda: _step_plan(group))
    plan.grads[:] = [g.data_ptr() for g in group.grads]
    plan.config.gdtype = KERNEL_DTYPES[group.grads[0].dtype]
    hyper, seeds = _host(group.hyper, torch.float32), _host(group.seeds, torch.int64)
    _run(plan, native.library().ckq_adam_step_group, ctypes.addressof(plan.config), plan.members.ctypes.data,
         plan.grads.ctypes.data, hyper.data_ptr(), _address(seeds), plan.items.ctypes.data, len(plan.items),
         plan.counter.ctypes.data)


def adam_step(p, g, states: tuple[StepState, ...], h, flags: StepFlags) -> None:
    """One parameter: a group of one (same kernel, same bits)."""
    member = GroupMember(p, tuple(s.codes for s in states), tuple(s.absmax for s in states), flags.row_len or p.numel())
    seeds = None if flags.seed is None else torch.tensor([flags.seed], dtype=torch.int64)
    books = tuple(StepCodebooks(s.qmap, s.thresholds, s.encode) for s in states)
    adam_step_group(StepGroup((member,), (g,), h.view(1, -1), seeds, books, tuple(s.bits for s in states),
                              flags.block_size, flags.ratio, flags.maximize, {}))


def _dense_plan(group: DenseGroup) -> _Plan:
    rows = [[p.data_ptr(), m[0].data_ptr(), m[1].data_ptr(), m[2].data_ptr() if len(m) > 2 and m[2] is not None else 0]
            for p, m in zip(group.params, group.moments)]
    sizes = [p.numel() for p in group.params]
    return _Plan(len(sizes), None, np.array(rows, dtype=np.int64).reshape(-1, 4), np.zeros(len(sizes), dtype=np.int64),
                 _work_items(sizes, [ITEM_ELEMENTS] * len(sizes)), np.zeros(1, dtype=np.int64), ())


def adam_dense_group(group: DenseGroup) -> None:
    if not group.params:
        return
    plan = _plan(group.cache, len(group.params), lambda: _dense_plan(group))
    plan.grads[:] = [g.data_ptr() for g in group.grads]
    hyper = _host(group.hyper, torch.float32)
    _run(plan, native.library().ckq_adam_dense_group, plan.members.ctypes.data, plan.grads.ctypes.data,
         hyper.data_ptr(), plan.items.ctypes.data, len(plan.items), plan.counter.ctypes.data,
         KERNEL_DTYPES[group.params[0].dtype], KERNEL_DTYPES[group.grads[0].dtype], group.maximize)
