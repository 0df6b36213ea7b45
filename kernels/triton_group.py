"""Grouped steps in Triton: every member of a ``contract.StepGroup`` (Adam(W), low-bit moments),
``contract.DenseGroup`` (fp32 moments) or ``contract.MomentumGroup`` (one-state: SGD, Lion, Muon) stepped by
one kernel launch (two where some members cannot take the vectorized path), bit for bit as
``backend_torch.adam_step_group`` / ``adam_dense_group`` / ``momentum_step_group`` step them one by one.

Like torch's ``multi_tensor_apply`` (aten/src/ATen/native/cuda/MultiTensorApply.cuh), the launch runs over
a chunk table: program k reads row k, (member, first block, blocks), and steps that tile of that member
(``triton_blocks.adam_tile``). Unlike it, the members' addresses are not kernel arguments but int64
tables on the device, read in the kernel and cast to pointers, so one launch takes any number of members.
Per member the kernel also reads its row of hyper (fp32 [T, 10], ``contract.HYPER_FIELDS``) and its seed.

What depends only on the members (the chunk table, the state addresses, row lengths) is built on the
first call and kept in ``group.cache``; a call then only refreshes the gradient addresses, and only when
one changed. Nothing in a step waits for the device: tables go up by non-blocking copies from pinned
memory, so a step can be captured in a CUDA graph once one eager step has built the cache. Under capture
the gradient addresses are copied from a pinned buffer the cache keeps unchanged (the graph replays that
copy), and ``hyper``/``seeds`` must be on the device (the caller updates them there between replays).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import legacy_groups, memo
from . import triton_blocks as tb
from .contract import DenseGroup, MomentumGroup, StepGroup, is_flat, layout_rows, num_blocks

_TILE = 2048  # elements per program of the dense step
_KEY = "triton"  # this backend's entry in a group's cache


@triton.jit
def _pointer(table, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    # the int64 address at table as a pointer to DTYPE; ALIGNED: the address is a multiple of 16, which the
    # compiler cannot know of a loaded value and needs for vector loads (the hint must sit on the load)
    pointer = tl.load(table).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def _step_group_kernel(
    chunks,  # int64 [programs, 3]: (member, first block, blocks) of each program's tile
    members,  # int64 [T, 8]: addresses of p, m codes, m absmax, v codes, v absmax, x codes, x absmax; row_len
    grads,  # int64 [T]: addresses of the gradients
    hyper,  # fp32 [T, 10]: contract.HYPER_FIELDS per member
    seeds,  # int64 [T]: uint32 seeds (read only when STOCHASTIC)
    p_like, g_like,  # a param and a grad of the group: their dtypes
    m_qmap, m_tree, m_enc, v_qmap, v_tree, v_enc, x_qmap, x_tree, x_enc,  # fp32 codebooks (backend_triton._adam_kernel)
    BLOCK: tl.constexpr, ROWS: tl.constexpr, M_RATIO: tl.constexpr, AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr, M_BITS: tl.constexpr, V_BITS: tl.constexpr, X_BITS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    ALIGNED: tl.constexpr,  # every param, grad and codes address 16-byte aligned, every row_len a multiple of 16
):
    chunk = chunks + tl.program_id(0).to(tl.int64) * 3
    i = tl.load(chunk)
    row = members + i * 8
    h = hyper + i * 10
    seed = 0
    if STOCHASTIC:
        seed = tl.load(seeds + i).to(tl.uint32)  # in [0, 2**32): the low 32 bits are the seed
    row_len = tl.load(row + 7)
    if ALIGNED:  # here, on the load: a hint on a jit function's argument is lost
        row_len = tl.multiple_of(row_len, 16)
    tb.adam_tile(_pointer(row, p_like.dtype.element_ty, ALIGNED),
                 _pointer(grads + i, g_like.dtype.element_ty, ALIGNED),
                 _pointer(row + 1, tl.uint8, ALIGNED), _pointer(row + 2, tl.float32, False),
                 _pointer(row + 3, tl.uint8, ALIGNED), _pointer(row + 4, tl.float32, False),
                 _pointer(row + 5, tl.uint8, ALIGNED), _pointer(row + 6, tl.float32, False),
                 m_qmap, m_tree, m_enc, v_qmap, v_tree, v_enc, x_qmap, x_tree, x_enc,
                 tl.load(h), tl.load(h + 1), tl.load(h + 2), tl.load(h + 3), tl.load(h + 4), tl.load(h + 5),
                 tl.load(h + 6), tl.load(h + 7), tl.load(h + 8), tl.load(h + 9), seed,
                 tl.load(chunk + 1), tl.load(chunk + 2), row_len,
                 BLOCK, ROWS, M_RATIO, AMSGRAD, MAXIMIZE, M_BITS, V_BITS, X_BITS, STOCHASTIC, ALIGNED)


@triton.jit
def _dense_group_kernel(
    chunks,  # int64 [programs, 3]: (member, first element, elements) of each program's tile
    members,  # int64 [T, 4]: addresses of p, exp_avg, exp_avg_sq, max_exp_avg_sq (fp32 moments)
    grads,  # int64 [T]: addresses of the gradients
    hyper,  # fp32 [T, 10]: contract.HYPER_FIELDS per member (the first 8 are read)
    p_like, g_like,  # a param and a grad of the group: their dtypes
    TILE: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address 16-byte aligned, every member's size a multiple of 16
):
    # backend_torch.adam_math, op for op (IEEE division and sqrt, no FMA: launched without fp fusion)
    chunk = chunks + tl.program_id(0).to(tl.int64) * 3
    i = tl.load(chunk)
    row = members + i * 4
    p_ptr = _pointer(row, p_like.dtype.element_ty, ALIGNED)
    m_ptr = _pointer(row + 1, tl.float32, ALIGNED)
    v_ptr = _pointer(row + 2, tl.float32, ALIGNED)
    h = hyper + i * 10
    first, count = tl.load(chunk + 1), tl.load(chunk + 2)
    if ALIGNED:
        first, count = tl.multiple_of(first, 16), tl.multiple_of(count, 16)
    offs = first + tl.arange(0, TILE)
    mask = tl.arange(0, TILE) < count
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(_pointer(grads + i, g_like.dtype.element_ty, ALIGNED) + offs, mask=mask, other=0.0)
    g = g.to(tl.float32)
    if MAXIMIZE:
        g = -g
    g = g + tl.load(h + 1) * p
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    m = m + tl.load(h + 2) * (g - m)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0) * tl.load(h + 3) + tl.load(h + 4) * (g * g)
    if AMSGRAD:
        x_ptr = _pointer(row + 3, tl.float32, ALIGNED)
        x = tl.maximum(tl.load(x_ptr + offs, mask=mask, other=0.0), v, propagate_nan=tl.PropagateNan.ALL)
        tl.store(x_ptr + offs, x, mask=mask)
        s = tl.math.sqrt_rn(x)
    else:
        s = tl.math.sqrt_rn(v)
    denom = tl.math.div_rn(s, tl.load(h + 7)) + tl.load(h + 5)
    p = p * tl.load(h) + tl.load(h + 6) * tl.math.div_rn(m, denom)
    tl.store(p_ptr + offs, tb.cast_to(p, p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


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


def _refresh_grads(cache: dict, grads: tuple) -> None:
    """The device table of gradient addresses, rewritten when one changed. Under capture it is always
    rewritten, from a pinned buffer that the cache then keeps unchanged for good: the graph's copy replays
    from it (a spare made by the eager call before, since capture allows no pinned allocation). Once a
    graph holds such a copy, its replays may have rewritten the table behind the cache's back: eager calls
    then always rewrite it."""
    key = tuple(g.data_ptr() for g in grads)
    capturing = _capturing(cache["device"])
    if not capturing and cache["device"].type == "cuda" and "spare" not in cache:
        cache["spare"] = torch.empty(len(key), dtype=torch.int64, pin_memory=True)
    if key == cache["grad_key"] and not capturing and not cache["captured"]:
        return
    assert len({g.dtype for g in grads}) == 1, "a group's gradients share one dtype (contract)"
    host = torch.tensor(key, dtype=torch.int64)
    if capturing:
        if "spare" not in cache:
            raise RuntimeError("run one eager step of this group before each CUDA-graph capture of it")
        stage = cache.pop("spare").copy_(host)
        cache["captured"].append(stage)
        cache["grads"].copy_(stage, non_blocking=True)
    else:
        _copy_in(cache["grads"], host)
    cache["grad_key"] = key
    cache["grads_aligned"] = all(address % 16 == 0 for address in key)


def _largest(tensors) -> int:
    """The index of the largest tensor: the member whose param and grad tell the kernel their dtypes (an
    empty one might have no storage to point at)."""
    sizes = [t.numel() for t in tensors]
    return sizes.index(max(sizes))


def _common(members_table: list, sizes: list[int], aligned: list[bool], per_program: int,
            device: torch.device) -> dict:
    """The tables of a group: member addresses; a chunk table per launch (members that take the aligned,
    vectorizing path, and the others); device buffers for what changes per call."""
    launches = []
    for kind in (True, False):
        chunks = _chunk_table([size if ok == kind else 0 for size, ok in zip(sizes, aligned)], per_program)
        if chunks.shape[0]:
            launches.append((_upload(chunks, device), chunks.shape[0], kind))
    return {"device": device, "members": _upload(torch.tensor(members_table, dtype=torch.int64), device),
            "launches": launches, "grad_key": None, "captured": [],
            "grads": torch.empty(len(sizes), dtype=torch.int64, device=device),
            "hyper": torch.empty(len(sizes), 10, dtype=torch.float32, device=device)}


def _members_cache(group, pointers, aligned_at: tuple) -> dict:
    """What every grouped launch needs from its members alone: the member table (``pointers(m)``, then the row
    length), its chunks and launches, the tile shape, and room for the seeds; a row is aligned where its
    columns ``aligned_at`` (the param, the codes and the row length) are multiples of 16."""
    table, blocks, longest = [], [], 1
    for m in group.members:
        n = m.p.numel()
        rows, row_len = layout_rows(n, None if is_flat(n, m.row_len, group.block_size) else m.row_len)
        table.append([*pointers(m), row_len or 16])
        blocks.append((rows, row_len))
        longest = max(longest, row_len)
    block, per_program, warps = tb.tile_shape(group.block_size, longest)
    aligned = [all(row[k] % 16 == 0 for k in aligned_at) for row in table]
    cache = _common(table, [rows * num_blocks(length, block) for rows, length in blocks], aligned, per_program,
                    group.members[0].p.device)
    cache.update(block=block, per_program=per_program, warps=warps, like=_largest(m.p for m in group.members),
                 seeds=torch.empty(len(table), dtype=torch.int64, device=cache["device"]))
    return cache


def _adam_pointers(m) -> list:
    pairs = tuple(zip(m.codes, m.absmax))
    pairs += (pairs[1],) * (3 - len(pairs))  # without amsgrad: exp_avg_sq's (never read)
    return [m.p.data_ptr(), *(t.data_ptr() for pair in pairs for t in pair)]


def _step_cache(group: StepGroup) -> dict:
    """What the launch needs from the members alone, built once per group."""
    cache = group.cache.get(_KEY)
    if cache is None:
        cache = group.cache[_KEY] = _members_cache(group, _adam_pointers, (0, 1, 3, 5, 7))  # p, codes, row_len
    return cache


def _ready(group, cache_of) -> tuple[dict, torch.Tensor] | None:
    """A group's cache (``cache_of(group)``) with this call's gradient addresses in its table, and its hyper
    where the kernel reads it; None when there is nothing to launch."""
    if not group.grads:
        return None
    cache = cache_of(group)
    if not cache["launches"]:
        return None
    _refresh_grads(cache, group.grads)
    return cache, _readable(group.hyper, cache["hyper"])


def adam_step_group(group: StepGroup) -> None:
    """One launch steps every member (two where some rows are not multiples of 16, or an address not
    16-byte aligned: those take the unvectorized path); bit for bit ``backend_torch.adam_step_group``."""
    ready = _ready(group, _step_cache)
    if ready is None:
        return
    cache, hyper = ready
    seeds = hyper if group.seeds is None else _readable(group.seeds, cache["seeds"])
    amsgrad = len(group.bits) == 3
    books = tuple(group.codebooks) + (() if amsgrad else (group.codebooks[1],))  # x: never read without amsgrad
    widths = tuple(group.bits) + (() if amsgrad else (group.bits[1],))
    trees = [memo.by_tensor(tb.search_tree, cb.thresholds) for cb in books]
    for chunks, programs, aligned in cache["launches"]:
        _step_group_kernel[(programs,)](
            chunks, cache["members"], cache["grads"], hyper, seeds, group.members[cache["like"]].p,
            group.grads[cache["like"]],
            *(t for cb, tree in zip(books, trees) for t in (cb.qmap, tree, cb.encode)),
            BLOCK=cache["block"], ROWS=cache["per_program"], M_RATIO=group.ratio, AMSGRAD=amsgrad,
            MAXIMIZE=group.maximize, M_BITS=widths[0], V_BITS=widths[1], X_BITS=widths[2],
            STOCHASTIC=group.seeds is not None, ALIGNED=aligned and cache["grads_aligned"], num_warps=cache["warps"],
            enable_fp_fusion=False)


def _dense_cache(group: DenseGroup) -> dict:
    cache = group.cache.get(_KEY)
    if cache is None:
        assert len({len(moments) for moments in group.moments}) == 1, "one amsgrad flag per group (contract)"
        table = [[p.data_ptr(), *(t.data_ptr() for t in moments), *([0] * (3 - len(moments)))]
                 for p, moments in zip(group.params, group.moments)]
        aligned = [all(a % 16 == 0 for a in row) and p.numel() % 16 == 0 for row, p in zip(table, group.params)]
        cache = _common(table, [p.numel() for p in group.params], aligned, _TILE, group.params[0].device)
        cache["like"] = _largest(group.params)
        group.cache[_KEY] = cache
    return cache


def adam_dense_group(group: DenseGroup) -> None:
    """One launch steps every member (two where some are not 16-aligned); bit for bit
    ``backend_torch.adam_dense_group``."""
    ready = _ready(group, _dense_cache)
    if ready is None:
        return
    cache, hyper = ready
    for chunks, programs, aligned in cache["launches"]:
        _dense_group_kernel[(programs,)](
            chunks, cache["members"], cache["grads"], hyper, group.params[cache["like"]], group.grads[cache["like"]],
            TILE=_TILE,
            AMSGRAD=len(group.moments[0]) == 3, MAXIMIZE=group.maximize, ALIGNED=aligned and cache["grads_aligned"],
            num_warps=4, enable_fp_fusion=False)


# The one-state step (SGD, Lion, Muon): the same chunk table over members with one state each.

@triton.jit
def _momentum_group_kernel(
    chunks,  # int64 [programs, 3]: (member, first block, blocks) of each program's tile
    members,  # int64 [T, 8]: addresses of p, the state's codes, its absmax (then 4 unused); row_len
    grads,  # int64 [T]: addresses of the gradients
    outs,  # int64 [T]: addresses of the fp32 outs (read only when HAS_OUT)
    hyper,  # fp32 [T, 8]: contract.MOMENTUM_FIELDS per member
    seeds,  # int64 [T]: uint32 seeds (read only when STOCHASTIC)
    p_like, g_like,  # a param and a grad of the group: their dtypes
    qmap, tree, enc,  # fp32 codebooks (backend_triton._momentum_kernel)
    BLOCK: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr, MAXIMIZE: tl.constexpr, UPDATE: tl.constexpr,
    HAS_OUT: tl.constexpr, STOCHASTIC: tl.constexpr,
    ALIGNED: tl.constexpr,  # every param, grad, out and codes address 16-byte aligned, every row_len a multiple of 16
):
    chunk = chunks + tl.program_id(0).to(tl.int64) * 3
    i = tl.load(chunk)
    row = members + i * 8
    h = hyper + i * 8
    seed = 0
    if STOCHASTIC:
        seed = tl.load(seeds + i).to(tl.uint32)
    row_len = tl.load(row + 7)
    if ALIGNED:
        row_len = tl.multiple_of(row_len, 16)
    p_ptr = _pointer(row, p_like.dtype.element_ty, ALIGNED)
    out_ptr = p_ptr.to(tl.pointer_type(tl.float32))  # never written without HAS_OUT
    if HAS_OUT:
        out_ptr = _pointer(outs + i, tl.float32, ALIGNED)
    tb.momentum_tile(p_ptr, _pointer(grads + i, g_like.dtype.element_ty, ALIGNED), out_ptr,
                     _pointer(row + 1, tl.uint8, ALIGNED), _pointer(row + 2, tl.float32, False), qmap, tree, enc,
                     tl.load(h), tl.load(h + 1), tl.load(h + 2), tl.load(h + 3), tl.load(h + 4), tl.load(h + 5),
                     tl.load(h + 6), tl.load(h + 7), seed, tl.load(chunk + 1), tl.load(chunk + 2), row_len,
                     BLOCK, ROWS, BITS, MAXIMIZE, UPDATE, HAS_OUT, STOCHASTIC, ALIGNED)


def _momentum_cache(group: MomentumGroup) -> dict:
    """What the launch needs from the members alone, built once per group (as ``_step_cache``)."""
    cache = group.cache.get(_KEY)
    if cache is not None:
        return cache
    pointers = lambda m: [m.p.data_ptr(), m.codes[0].data_ptr(), m.absmax[0].data_ptr(), 0, 0, 0, 0]  # noqa: E731
    cache = _members_cache(group, pointers, (0, 1, 7))  # p, codes, row_len
    device, n = cache["device"], len(group.members)
    cache.update(hyper=torch.empty(n, 8, dtype=torch.float32, device=device),
                 outs=torch.zeros(n, dtype=torch.int64, device=device), out_key=None, outs_aligned=True)
    group.cache[_KEY] = cache
    return cache


def _refresh_outs(cache: dict, outs: tuple) -> None:
    """The device table of the outs' addresses, rewritten when one changed (not under capture: a captured
    step writes the outs its eager step wrote)."""
    key = tuple(o.data_ptr() for o in outs)
    if key == cache["out_key"]:
        return
    if _capturing(cache["device"]):
        raise RuntimeError("a captured grouped one-state step writes the outs of the eager step before it")
    _copy_in(cache["outs"], torch.tensor(key, dtype=torch.int64))
    cache["out_key"] = key
    cache["outs_aligned"] = all(address % 16 == 0 for address in key)


def momentum_step_group(group: MomentumGroup) -> None:
    """One launch steps every member (two where some rows are not multiples of 16, or an address not
    16-byte aligned); bit for bit ``momentum_torch.momentum_step_group``."""
    ready = _ready(group, _momentum_cache)
    if ready is None:
        return
    cache, hyper = ready
    has_out = bool(group.outs)
    if has_out:
        _refresh_outs(cache, group.outs)
    seeds = hyper if group.seeds is None else _readable(group.seeds, cache["seeds"])
    cb = group.codebooks
    tree = memo.by_tensor(tb.search_tree, cb.thresholds)
    for chunks, programs, aligned in cache["launches"]:
        _momentum_group_kernel[(programs,)](
            chunks, cache["members"], cache["grads"], cache["outs"], hyper, seeds, group.members[cache["like"]].p,
            group.grads[cache["like"]], cb.qmap, tree, cb.encode,
            BLOCK=cache["block"], ROWS=cache["per_program"], BITS=group.bits, MAXIMIZE=group.maximize,
            UPDATE=group.update, HAS_OUT=has_out, STOCHASTIC=group.seeds is not None,
            ALIGNED=aligned and cache["grads_aligned"] and (not has_out or cache["outs_aligned"]),
            num_warps=cache["warps"], enable_fp_fusion=False)


# The one step (contract.Group / Dense, ckptq.kernels.registry): the rules the kernels above implement.

def accepts_step(group) -> bool:
    return legacy_groups.adam_group(group) is not None or legacy_groups.momentum_group(group) is not None


def step(group) -> None:
    legacy = legacy_groups.adam_group(group)
    if legacy is not None:
        adam_step_group(legacy)
    else:
        momentum_step_group(legacy_groups.momentum_group(group))


def accepts_dense(group) -> bool:
    return legacy_groups.adam_dense(group) is not None


def dense(group) -> None:
    adam_dense_group(legacy_groups.adam_dense(group))
