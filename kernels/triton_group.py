"""The one step on Triton's side of the registry (``contract.Group``: low-bit states; ``contract.Dense``: fp32
states): every member of a group stepped by one launch of the template (``triton_step``; two where some
members cannot take the vectorized path), bit for bit as ``step_torch.step_group`` / ``dense_group`` step
them one by one. Every rule of ``rules.RULES``, every flag word, 1 to 3 slots of any width and transforms.

Like torch's ``multi_tensor_apply`` (aten/src/ATen/native/cuda/MultiTensorApply.cuh), the launch runs over
a chunk table: program k reads row k, (member, first block, blocks), and steps that tile of that member.
Unlike it, the members' addresses are not kernel arguments but int64 tables on the device, read in the
kernel and cast to pointers, so one launch takes any number of members. Per member the kernel also reads
its row of hyper (fp32 [T, len(rule.fields)]) and its seed.

What depends only on the members (the chunk table, the state addresses, row lengths, the slots' codebooks
as one table) is built on the first call and kept in ``group.cache``; a call then only refreshes the
gradient and out addresses, and only when one changed. Nothing in a step waits for the device: tables go
up by non-blocking copies from pinned memory, so a step can be captured in a CUDA graph once one eager step
has built the cache. Under capture the gradient and out addresses are copied from a pinned buffer the
cache keeps unchanged (the graph replays that copy), and ``hyper``/``seeds`` must be on the device (the
caller updates them there between replays).
"""

from __future__ import annotations

import torch

from . import rules
from . import triton_blocks as tb
from . import triton_step as ts
from .contract import KERNEL_DTYPES, is_flat, layout_rows, num_blocks

_TILE, _DENSE_WARPS = 2048, 4  # elements and warps per program of the dense step
# unaligned tiles run on twice the warps: their masked scalar loads and stores (of packed codes) hold more
# registers per element, and at 16 elements per thread three slots spill (tools/scripts/triton_compile_check.py)
UNALIGNED_WARPS = 2
_KEY = "triton"  # this backend's entry in a group's cache


def _chunk_table(sizes: list[int], per_program: int) -> torch.Tensor:
    """int64 [programs, 3] (host): (member, first, count) for tiles of ``per_program`` units (blocks or
    elements) over each member's ``sizes[i]`` units, members in order."""
    size = torch.tensor(sizes, dtype=torch.int64)
    tiles = (size + per_program - 1) // per_program
    member = torch.repeat_interleave(torch.arange(len(sizes)), tiles)
    start = torch.cumsum(tiles, 0) - tiles  # each member's first program
    first = (torch.arange(member.numel()) - start[member]) * per_program
    return torch.stack([member, first, torch.minimum(size[member] - first, torch.tensor(per_program))], 1)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _copy_in(dst: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """dst (on the device) = host without waiting: a non-blocking copy from pinned memory (torch's caching
    host allocator keeps the pinned block until the copy has run, so the next call cannot overwrite it)."""
    if dst.device.type != "cuda":
        return dst.copy_(host)
    return dst.copy_(host.pin_memory(), non_blocking=True)


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new device copy of a host table (the cache's, built on a group's first call)."""
    if _capturing(device):
        raise RuntimeError("the grouped step builds its tables on its first call; run one step before capturing "
                           "it in a CUDA graph")
    return _copy_in(torch.empty(host.shape, dtype=host.dtype, device=device), host)


def _readable(src: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """``src`` (hyper or seeds) where the kernel can read it, in the buffer's dtype: as is on the device,
    else copied into the cache's device ``buffer``."""
    if src.device == buffer.device:
        return src.to(buffer.dtype).contiguous()  # no copy when it is already fp32 (int64) and contiguous
    if _capturing(buffer.device):
        raise RuntimeError("a captured grouped step reads hyper and seeds on the device: the values of a host "
                           "tensor would be frozen into the graph; pass them on the device")
    return _copy_in(buffer, src)


def _refresh_calls(cache: dict, grads: tuple, outs: tuple) -> None:
    """The device table of this call's addresses, int64 [T, 2] (gradient, out or 0), rewritten when one
    changed. Under capture it is always rewritten, from a pinned buffer that the cache then keeps unchanged
    for good: the graph's copy replays from it (a spare made by the eager call before, since capture allows
    no pinned allocation). Once a graph holds such a copy, its replays may have rewritten the table behind
    the cache's back: eager calls then always rewrite it."""
    key = tuple(g.data_ptr() for g in grads) + tuple(o.data_ptr() for o in outs)
    capturing = _capturing(cache["device"])
    if not capturing and cache["device"].type == "cuda" and "spare" not in cache:
        cache["spare"] = torch.empty(len(grads), 2, dtype=torch.int64, pin_memory=True)
    if key == cache["call_key"] and not capturing and not cache["captured"]:
        return
    assert len({g.dtype for g in grads}) == 1, "a group's gradients share one dtype (contract)"
    host = torch.zeros(len(grads), 2, dtype=torch.int64)
    host[:, 0] = torch.tensor(key[: len(grads)], dtype=torch.int64)
    if outs:
        host[:, 1] = torch.tensor(key[len(grads):], dtype=torch.int64)
    if capturing:
        if "spare" not in cache:
            raise RuntimeError("run one eager step of this group before each CUDA-graph capture of it")
        stage = cache.pop("spare").copy_(host)
        cache["captured"].append(stage)
        cache["calls"].copy_(stage, non_blocking=True)
    else:
        _copy_in(cache["calls"], host)
    cache["call_key"] = key
    cache["calls_aligned"] = all(address % 16 == 0 for address in key)


def _largest(tensors) -> int:
    """The index of the largest tensor: the member whose param and grad tell the kernel their dtypes (an
    empty one might have no storage to point at)."""
    sizes = [t.numel() for t in tensors]
    return sizes.index(max(sizes))


def _common(members_table: list, sizes: list[int], aligned: list[bool], per_program: int, fields: int,
            device: torch.device) -> dict:
    """The tables of a group: member addresses; a chunk table per launch (members that take the aligned,
    vectorizing path, and the others); device buffers for what changes per call."""
    launches = []
    for kind in (True, False):
        chunks = _chunk_table([size if ok == kind else 0 for size, ok in zip(sizes, aligned)], per_program)
        if chunks.shape[0]:
            launches.append((_upload(chunks, device), chunks.shape[0], kind))
    n = len(sizes)
    return {"device": device, "members": _upload(torch.tensor(members_table, dtype=torch.int64), device),
            "launches": launches, "call_key": None, "captured": [],
            "calls": torch.zeros(n, 2, dtype=torch.int64, device=device),
            "hyper": torch.empty(n, fields, dtype=torch.float32, device=device),
            "seeds": torch.empty(n, dtype=torch.int64, device=device)}


def _books(slots) -> torch.Tensor:
    """fp32 [len(slots), 3, BOOK] on the slots' device: per slot its decode map, the search tree of its
    encode map's midpoints, its encode map (each padded to BOOK entries). Built on the device, no sync."""
    tables = [torch.nn.functional.pad(t.to(torch.float32), (0, ts.BOOK - t.numel()))
              for s in slots for t in (s.qmap, tb.search_tree(s.thresholds), s.encode)]
    return torch.stack(tables).view(len(slots), 3, ts.BOOK).contiguous()


def _step_cache(group) -> dict:
    """What the launch needs from the members alone, built once per group: the member table (p, each slot's
    codes and scales, row length), its chunks and launches, the tile shape, the codebooks' table."""
    cache = group.cache.get(_KEY)
    if cache is not None:
        return cache
    table, blocks, longest = [], [], 1
    for m in group.members:
        n = m.p.numel()
        rows, row_len = layout_rows(n, None if is_flat(n, m.row_len, group.block_size) else m.row_len)
        table.append([m.p.data_ptr(), *(t.data_ptr() for pair in zip(m.codes, m.absmax) for t in pair), row_len or 16])
        blocks.append((rows, row_len))
        longest = max(longest, row_len)
    block, per_program, warps = tb.tile_shape(group.block_size, longest)
    aligned = [all(a % 16 == 0 for a in (row[0], *row[1:-1:2], row[-1])) for row in table]  # p, codes, row_len
    cache = _common(table, [rows * num_blocks(length, block) for rows, length in blocks], aligned, per_program,
                    len(rules.RULES[group.rule].fields), group.members[0].p.device)
    cache.update(block=block, per_program=per_program, warps=warps, like=_largest(m.p for m in group.members))
    group.cache[_KEY] = cache
    return cache


def _codebooks(cache: dict, slots) -> torch.Tensor:
    """The slots' codebooks as one device table (``_books``), made again only for other codebook tensors (or
    ones changed in place)."""
    tensors = tuple(t for s in slots for t in (s.qmap, s.thresholds, s.encode))
    versions = tuple(t._version for t in tensors)
    kept = cache.get("codebooks")
    if kept is None or kept[1] != versions or len(kept[0]) != len(tensors) \
            or any(a is not b for a, b in zip(kept[0], tensors)):
        kept = cache["codebooks"] = (tensors, versions, _books(slots))
    return kept[2]


def _ready(group, cache_of) -> tuple[dict, torch.Tensor] | None:
    """A group's cache (``cache_of(group)``) with this call's addresses in its table, and its hyper where the
    kernel reads it; None when there is nothing to launch."""
    if not group.grads:
        return None
    cache = cache_of(group)
    if not cache["launches"]:
        return None
    _refresh_calls(cache, group.grads, group.outs)
    return cache, _readable(group.hyper, cache["hyper"])


def _eps_fields(rule) -> tuple[int, int]:
    """The fields of decode_eps and encode_eps (the last field where a rule has none, as step_torch reads it)."""
    last = len(rule.fields) - 1
    return tuple(rule.fields.index(name) if name in rule.fields else last for name in ("decode_eps", "encode_eps"))


def step(group) -> None:
    """One step of every member of a ``contract.Group`` by its rule, in place; bit for bit
    ``step_torch.step_group``. One launch per kind of member (vectorizable or not)."""
    ready = _ready(group, _step_cache)
    if ready is None:
        return
    cache, hyper = ready
    rule = rules.RULES[group.rule]
    seeded = group.seeds is not None
    slots = tuple(ts.SlotShape(s.bits, s.decode, s.encode_as, s.divisor, seeded and s.seeded) for s in group.slots)
    seeds = _readable(group.seeds, cache["seeds"]) if seeded else cache["seeds"]
    out = rules.writes_direction(rule, group.flags)
    dec_eps, enc_eps = _eps_fields(rule)
    books = _codebooks(cache, group.slots)
    for chunks, programs, aligned in cache["launches"]:
        aligned = aligned and cache["calls_aligned"]
        ts._step_kernel[(programs,)](
            chunks, cache["members"], cache["calls"], hyper, seeds, books, group.members[cache["like"]].p,
            group.grads[cache["like"]], RULE=ts.RULES[rule.name], FLAGS=group.flags, FIELDS=len(rule.fields),
            SLOTS=slots, DEC_EPS=dec_eps, ENC_EPS=enc_eps, OUT=out, STOCHASTIC=any(s.stochastic for s in slots),
            BLOCK=cache["block"], ROWS=cache["per_program"], ALIGNED=aligned,
            num_warps=cache["warps"] * (1 if aligned else UNALIGNED_WARPS), enable_fp_fusion=False)


def _dense_cache(group) -> dict:
    cache = group.cache.get(_KEY)
    if cache is None:
        assert len({len(states) for states in group.states}) == 1, "one flag word per group (contract)"
        table = [[p.data_ptr(), *(t.data_ptr() for t in states)] for p, states in zip(group.params, group.states)]
        aligned = [all(a % 16 == 0 for a in row) and p.numel() % 16 == 0 for row, p in zip(table, group.params)]
        cache = _common(table, [p.numel() for p in group.params], aligned, _TILE,
                        len(rules.RULES[group.rule].fields), group.params[0].device)
        cache["like"] = _largest(group.params)
        group.cache[_KEY] = cache
    return cache


def dense(group) -> None:
    """The rule on the fp32 states of every member of a ``contract.Dense``, in place; bit for bit
    ``step_torch.dense_group``. One launch (two where some members are not 16-aligned)."""
    ready = _ready(group, _dense_cache)
    if ready is None:
        return
    cache, hyper = ready
    rule = rules.RULES[group.rule]
    for chunks, programs, aligned in cache["launches"]:
        aligned = aligned and cache["calls_aligned"]
        ts._dense_kernel[(programs,)](
            chunks, cache["members"], cache["calls"], hyper, group.params[cache["like"]], group.grads[cache["like"]],
            RULE=ts.RULES[rule.name], FLAGS=group.flags, FIELDS=len(rule.fields),
            OUT=rules.writes_direction(rule, group.flags), STATES=len(group.states[0]), TILE=_TILE, ALIGNED=aligned,
            num_warps=_DENSE_WARPS * (1 if aligned else UNALIGNED_WARPS), enable_fp_fusion=False)


def _dtypes_ok(params, grads) -> bool:
    return all(t.dtype in KERNEL_DTYPES for t in (*params[:1], *grads[:1]))


def accepts_step(group) -> bool:
    """Every rule of ``rules.RULES`` (with its Triton function), fp32/bf16/fp16 params and grads."""
    return group.rule in ts.RULES and _dtypes_ok([m.p for m in group.members], group.grads)


def accepts_dense(group) -> bool:
    return group.rule in ts.RULES and _dtypes_ok(group.params, group.grads)
