"""The C backend: ``cpu_kernels.c`` (built and loaded by ``native``) called through ctypes on the CPU pool
(ctypes releases the GIL for the length of a call).

quantize / dequantize: each call takes a range of blocks of the row layout (``contract``, "Rows"); the
pool runs chunks of about ``cpu_runtime.native_chunk`` elements. The one step of every rule
(``contract.Group`` / ``Dense``, through ``registry``): one ``ckq_step_group`` (``ckq_dense_group``) call
per pool thread for a whole group, the threads taking (member, block range) items from a shared counter,
so that hundreds of small tensors and a few huge ones balance alike; one parameter's step (``adam_step``,
``momentum_step``: ``ckptq.codec.ops``' older per-parameter operations) is a group of one. What a group's
members determine (the table of member addresses, the work list) is built once into ``group.cache``, the
kernels' config of its slots (codebooks, code tables, transforms, rule) once per codebook tensors; a call
refreshes only the gradients' (and outs') addresses and passes its hyper rows and seeds.

Signatures and contract in ``contract``; results equal ``backend_torch`` bit for bit. ``ckptq.codec.ops`` sends
work here only where the kernels can take it: CPU tensors of ``contract.KERNEL_DTYPES``, codebooks with
a code table (``usable``), the library loaded.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import numpy as np
import torch

from . import cpu_runtime, lut, memo, native, rules, single
from .contract import (KERNEL_DTYPES, RATIO, Dense, Group, MomentumFlags, StepFlags, StepState, layout_blocks,
                       layout_rows)

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
    # (narrow widths with blocks that do not start on a byte), an unknown dtype, or a step config that does
    # not fit its rule, which ckptq.ops and accepts_step never pass.
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
    """A group's kernel arguments that follow from its members, kept in ``group.cache``."""

    witness: tuple  # member count and the first and last members' addresses when it was built
    members: np.ndarray  # int64 [count, 8] (member_t) or [count, 4] (dense_member_t)
    grads: np.ndarray  # int64 [count]: the gradients' addresses, refreshed at every call
    outs: np.ndarray | None  # int64 [count]: the outs' addresses (rules that write a direction)
    items: np.ndarray  # int64 [items, 3]: (member, first, end) blocks (elements for the dense step)
    counter: np.ndarray  # int64 [1]: the next item, shared by the threads of a call


def _work_items(sizes: list[int], per_item: list[int]) -> np.ndarray:
    """(member, first, end) items covering each member's ``sizes[i]`` units ``per_item[i]`` at a time,
    largest first (stable), so that the last items the threads take are small ones."""
    items = [(i, s, min(s + step, size)) for i, (size, step) in enumerate(zip(sizes, per_item))
             for s in range(0, size, step)]
    items.sort(key=lambda item: item[1] - item[2])
    return np.array(items, dtype=np.int64).reshape(-1, 3)


def _plan(cache: dict, witness: tuple, build) -> _Plan:
    """The cached plan, or a new one. The caller keeps the cache only while its members stay; an O(1)
    check (member count, the first and last members' addresses) still catches a cache kept past that
    (say after ``model.to``), which would otherwise send the kernel to freed memory."""
    plan = cache.get(_PLAN)
    if plan is None or plan.witness != witness:
        plan = cache[_PLAN] = build()
    return plan


def _new_plan(witness: tuple, rows: list[list[int]], sizes: list[int], per_item: list[int], outs: bool) -> _Plan:
    count = len(rows)
    return _Plan(witness, np.array(rows, dtype=np.int64), np.zeros(count, dtype=np.int64),
                 np.zeros(count, dtype=np.int64) if outs else None, _work_items(sizes, per_item),
                 np.zeros(1, dtype=np.int64))


def _run(kernel, config, plan: _Plan, grads, outs, hyper: torch.Tensor, *seeds: torch.Tensor | None) -> None:
    """``kernel(config, members, grads, outs, hyper[, seeds], items, count, counter)`` on as many threads as
    help (each takes items until none are left), with this call's gradient and out addresses."""
    if not len(plan.items):
        return
    plan.grads[:] = [g.data_ptr() for g in grads]
    if plan.outs is not None:
        plan.outs[:] = [o.data_ptr() for o in outs]
    host = [_host(hyper, torch.float32)] + [_host(s, torch.int64) for s in seeds]  # alive for the call
    args = (ctypes.addressof(config), plan.members.ctypes.data, plan.grads.ctypes.data,
            None if plan.outs is None else plan.outs.ctypes.data, *(None if t is None else t.data_ptr() for t in host),
            plan.items.ctypes.data, len(plan.items), plan.counter.ctypes.data)
    plan.counter[0] = 0

    def work() -> None:
        _check(kernel(*args))

    cpu_runtime.run_on_workers(work, min(cpu_runtime.workers(), len(plan.items)))


def _host(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """t as a contiguous CPU tensor of dtype (itself when it is one already)."""
    return None if t is None else t.to("cpu", dtype).contiguous()


# ---- The one step (contract.Group / Dense, ckptq.kernels.registry): every rule the kernels implement ----

_configs: dict = {}  # step configs by their slots' tensors (identity and version), shapes, rule, flags, dtypes
_MAX_CONFIGS = 256


def rule_id(name: str) -> int:
    """The kernels' id of a rule (``rules.RULES``' key), -1 for one this build does not implement."""
    return _rule_ids(name)


@functools.lru_cache(maxsize=None)
def _rule_ids(name: str) -> int:
    return native.library().ckq_rule_id(name.encode())


def _eps_fields(rule: rules.Rule) -> tuple[int, int]:
    """The hyper fields of decode_eps and encode_eps (-1 where the rule has none)."""
    return tuple(rule.fields.index(f) if f in rule.fields else -1 for f in ("decode_eps", "encode_eps"))


def _step_config(group: Group, grad_dtype: torch.dtype) -> native.StepConfig:
    """The kernels' config of a step group (``step_config_t``), built once per slot tensors, shapes, rule,
    flags and dtypes (the entry holds the tensors it points into, so their ids stay theirs) and never
    changed after (threads share it)."""
    slots = group.slots
    key = (tuple((id(t), t._version) for s in slots for t in (s.qmap, s.thresholds, s.encode)),
           tuple((s.bits, s.decode, s.encode_as, s.divisor, s.seeded) for s in slots), group.rule, group.flags,
           group.block_size, group.members[0].p.dtype, grad_dtype)
    hit = _configs.get(key)
    if hit is not None:
        return hit[0]
    rule = rules.RULES[group.rule]
    config, keep = native.StepConfig(), []
    for j, s in enumerate(slots):
        decode = memo.by_tensor(_decode_map, s.qmap)
        table = memo.by_tensor(lut.native_code_table, s.thresholds)
        keep += [decode, table, s.thresholds, s.encode]
        config.slot[j] = native.SlotConfig(decode.data_ptr(), table.data_ptr(), None, s.thresholds.data_ptr(),
                                           s.encode.data_ptr(), s.bits, s.decode, s.encode_as, s.divisor,
                                           int(s.seeded))
    dec_eps, enc_eps = _eps_fields(rule)
    config.rule, config.flags, config.slots, config.block = rule_id(rule.name), group.flags, len(slots), group.block_size
    config.pdtype, config.gdtype = KERNEL_DTYPES[group.members[0].p.dtype], KERNEL_DTYPES[grad_dtype]
    config.fields, config.dec_eps, config.enc_eps = len(rule.fields), dec_eps, enc_eps
    if len(_configs) >= _MAX_CONFIGS:
        _configs.clear()
    _configs[key] = (config, tuple(keep))
    return config


def _member_row(p: torch.Tensor, codes, absmax, row_len: int) -> list[int]:
    """member_t of step.h: param, codes x 3, absmax x 3 (0 where absent), row length."""
    pad = [0] * (3 - len(codes))
    return [p.data_ptr(), *(c.data_ptr() for c in codes), *pad, *(a.data_ptr() for a in absmax), *pad, row_len]


def _witness(params, states) -> tuple:
    """Member count and the first and last members' param and first / last state addresses."""
    return len(params), params[0].data_ptr(), states[0][0].data_ptr(), params[-1].data_ptr(), states[-1][-1].data_ptr()


def _step_plan(group: Group) -> _Plan:
    members, block = group.members, group.block_size
    lengths = [layout_rows(m.p.numel(), m.row_len)[1] for m in members]  # flat: one row of all n elements
    rows = [_member_row(m.p, m.codes, m.absmax, length) for m, length in zip(members, lengths)]
    blocks = [layout_blocks(m.p.numel(), m.row_len, block) for m in members]
    per_item = [max(1, ITEM_ELEMENTS // max(1, min(block, length))) for length in lengths]
    return _new_plan(_step_witness(group), rows, blocks, per_item, bool(group.outs))


def _step_witness(group: Group) -> tuple:
    return _witness([m.p for m in group.members], [m.absmax for m in group.members]) + (bool(group.outs),)


def step(group: Group) -> None:
    """One step of every member of ``group`` by its rule, in place (``step_torch.step_group``, bit for bit)."""
    if not group.members:
        return
    plan = _plan(group.cache, _step_witness(group), lambda: _step_plan(group))
    config = _step_config(group, group.grads[0].dtype)
    _run(native.library().ckq_step_group, config, plan, group.grads, group.outs, group.hyper, group.seeds)


_dense_configs: dict = {}


def _dense_config(group: Dense) -> native.DenseConfig:
    key = (group.rule, group.flags, len(group.states[0]), group.params[0].dtype, group.grads[0].dtype)
    config = _dense_configs.get(key)
    if config is None:
        rule = rules.RULES[group.rule]
        config = _dense_configs[key] = native.DenseConfig(
            rule_id(rule.name), group.flags, len(group.states[0]), KERNEL_DTYPES[group.params[0].dtype],
            KERNEL_DTYPES[group.grads[0].dtype], len(rule.fields))
    return config


def _dense_plan(group: Dense) -> _Plan:
    rows = [[p.data_ptr(), *(s.data_ptr() for s in states), *[0] * (3 - len(states))]
            for p, states in zip(group.params, group.states)]
    sizes = [p.numel() for p in group.params]
    return _new_plan(_dense_witness(group), rows, sizes, [ITEM_ELEMENTS] * len(sizes), bool(group.outs))


def _dense_witness(group: Dense) -> tuple:
    return _witness(group.params, group.states) + (bool(group.outs),)


def dense(group: Dense) -> None:
    """The rule on plain fp32 states, in place (``step_torch.dense_group``, bit for bit)."""
    if not group.params:
        return
    plan = _plan(group.cache, _dense_witness(group), lambda: _dense_plan(group))
    _run(native.library().ckq_dense_group, _dense_config(group), plan, group.grads, group.outs, group.hyper)


def _dtypes_ok(params, grads) -> bool:
    """One param dtype and one grad dtype, both read by the kernels."""
    p, g = {t.dtype for t in params}, {t.dtype for t in grads}
    return len(p) == len(g) == 1 and p | g <= set(KERNEL_DTYPES)


def _shape_ok(slots) -> bool:
    """Transforms the kernels take (what ``ckptq.codec.grouped.check`` allows, less a ratio whose divisor is
    decoded as a ratio, which no optimizer declares)."""
    for s in slots:
        if RATIO in (s.decode, s.encode_as) and slots[s.divisor].decode == RATIO:
            return False
    return True


def accepts_step(group: Group) -> bool:
    """Every rule this build implements (``ckq_rule_id``), fp32/bf16/fp16 params and grads, codebooks with a
    code table."""
    return (available() and rule_id(group.rule) >= 0 and _dtypes_ok([m.p for m in group.members], group.grads)
            and all(usable(s.thresholds) for s in group.slots) and _shape_ok(group.slots))


def accepts_dense(group: Dense) -> bool:
    return available() and rule_id(group.rule) >= 0 and _dtypes_ok(group.params, group.grads)


# ---- ckptq.codec.ops' per-parameter steps: groups of one of the step above ----

def adam_step(p, g, states: tuple[StepState, ...], h, flags: StepFlags) -> None:
    """``contract``'s adam_step: a group of one (``single.adam_group``)."""
    step(single.adam_group(p, g, states, h, flags))


def momentum_step(p, g, state: StepState, h, out, flags: MomentumFlags) -> None:
    """``contract``'s momentum_step: a group of one (``single.momentum_group``)."""
    step(single.momentum_group(p, g, state, h, out, flags))
