"""The PyTorch backend: the reference of every operation, and the path wherever C and Triton are not.

Signatures and contract in ``contract``. Blockwise 8-bit quantization after Dettmers et al., "8-bit
Optimizers via Block-wise Quantization" (ICLR 2022): a flat tensor is cut into blocks of ``block_size``
values (the last may be short), each divided by its absmax (an fp32 scale), and each normalized value
rounded to the nearest codebook entry under the rounding contract of ``lut``. An all-zero block gets
absmax 0 and the code of 0; the ``sqrt`` transform stores sqrt(x) (second moments) and decodes s * s.

The Adam step follows ``torch.optim.AdamW`` / ``Adam`` (single-tensor path) and torchao's
``single_param_adam``: per block it decodes the second moment (s = qmap[code] * absmax, v = s * s) and
the first (m = r * (s + eps') for ratio codes, qmap[code] * absmax for plain ones), runs the update in
fp32 (``adam_math``), and requantizes with new block scales: v as sqrt(v), m as the ratio
r = m / (sqrt(v) + eps_new) with the new exact v. The C and Triton kernels equal this bit for bit.

Narrower codes (``bits`` 6, 4, 2) are computed exactly as 8-bit ones, on a codebook of 2**bits entries,
then packed (``pack_codes``, layout in ``contract``); decoding and the step unpack them first.
"""

from __future__ import annotations

import torch

from . import cpu_runtime, lut
from .ieee import ieee_sqrt, ieee_sqrt_into  # noqa: F401 (ieee_sqrt_into: re-exported for codec.ops)
from .contract import (DenseGroup, StepFlags, StepGroup, StepState, code_bytes, is_flat, layout_rows, member_steps,
                       mix32, num_blocks, pack_codes, pack_rows, reference_codes, unpack_codes, unpack_rows)

STEP_CHUNK = 1 << 18  # elements per chunk of the step (whole blocks for every block size): 1 MB temporaries


def _as_fp32(src: torch.Tensor, buf: torch.Tensor, sqrt: bool) -> torch.Tensor:
    """src: [n] any float dtype -> fp32 [n], sqrt applied; uses buf [n] unless src can be used as is."""
    if sqrt:
        return ieee_sqrt_into(src, buf)
    return buf.copy_(src) if src.dtype != torch.float32 else src


def _absmax_rows(blocks: torch.Tensor, out: torch.Tensor, nonnegative: bool = False) -> None:
    """out[i] = max |blocks[i, :]| for blocks [nb, B], NaN if the row holds one. Two reductions beat abs() +
    amax (no full temp), and sqrt outputs (``nonnegative``: >= 0, -0.0 or NaN) need only the max; abs_
    turns a -0.0 from an all-zero block into the +0.0 that abs().amax gives."""
    torch.amax(blocks, dim=1, out=out)
    if not nonnegative:
        torch.maximum(out, torch.amin(blocks, dim=1).neg_(), out=out)
    out.abs_()


def lookup_codes(y: torch.Tensor, table: lut.CodeTable, codes: torch.Tensor, ws: cpu_runtime.Workspace) -> None:
    """codes [n] uint8 = #{t < y} for y fp32 [n], via the code table (see ``lut``)."""
    n = y.numel()
    idx = torch.bitwise_right_shift(y.view(torch.int32), 16, out=ws.idx[:n]).add_(lut.SIGN_FLIP)
    torch.index_select(table.base, 0, idx, out=codes)
    thr = torch.index_select(table.thr, 0, idx, out=ws.x[:n])
    codes.add_(torch.gt(y, thr, out=ws.gt[:n]))


def _quantize_span(src, codes, absmax, thresholds, table, block_size, sqrt, ws) -> None:
    """Quantize src [n] into codes [n] and absmax [ceil(n / B)] (views of the outputs); n <= chunk."""
    n = src.numel()
    x = _as_fp32(src, ws.x[:n], sqrt)
    if table is None:
        codes[:], absmax[:] = reference_codes(x, thresholds, block_size)
        return
    full = n - n % block_size
    nb = full // block_size
    if nb:
        blocks = x[:full].view(nb, block_size)
        _absmax_rows(blocks, absmax[:nb], nonnegative=sqrt)
        safe = torch.where(absmax[:nb] > 0, absmax[:nb], 1.0)
        y = torch.div(blocks, safe[:, None], out=ws.y[:full].view(nb, block_size)).view(-1)
        lookup_codes(y, table, codes[:full], ws)
    if full < n:  # the tensor's last, short block
        codes[full:], absmax[nb:] = reference_codes(x[full:], thresholds, block_size)


# The row layout where rows are not whole blocks (``contract``, "Rows"): the codec and the step on a
# [rows, row_len] view, each row's whole blocks and its short last block as blocks of their own. Slow and
# plain on purpose; where rows are whole blocks the layout is the flat one and the flat paths run.

def _row_parts(row_len: int, block_size: int):
    """(columns, width) of a row's whole blocks and of its short last block, as they exist."""
    full = row_len - row_len % block_size
    parts = [(slice(0, full), block_size)] if full else []
    return parts + ([(slice(full, row_len), row_len - full)] if full < row_len else [])


def _row_blocks(t: torch.Tensor, cols: slice, width: int) -> torch.Tensor:
    """[rows, row_len] -> the columns ``cols`` as blocks [rows * (cols / width), width] (a copy)."""
    return t[:, cols].reshape(-1, width)


def _quantize_rows(x: torch.Tensor, thresholds, block_size: int, codes, absmax, bits: int, row_len: int) -> None:
    """x fp32 [n] (transform applied) -> codes [rows * row_bytes], absmax [rows * blocks_per_row]."""
    rows, length = layout_rows(x.numel(), row_len)
    x2 = x.view(rows, length)
    c = torch.empty(rows, length, dtype=torch.uint8, device=x.device)
    a = absmax.view(rows, num_blocks(length, block_size))
    for cols, width in _row_parts(length, block_size):
        part_codes, part_absmax = reference_codes(_row_blocks(x2, cols, width).reshape(-1), thresholds, width)
        c[:, cols] = part_codes.view(rows, -1)
        a[:, cols.start // block_size : num_blocks(cols.stop, block_size)] = part_absmax.view(rows, -1)
    codes.view(rows, -1).copy_(pack_rows(c, bits))


def _dequantize_rows(codes, absmax, qmap, block_size: int, out, bits: int, row_len: int) -> None:
    """out fp32 [n] = qmap[code] * absmax[row, column // block_size] (no transform)."""
    rows, length = layout_rows(out.numel(), row_len)
    c = unpack_rows(codes.view(rows, -1), length, bits).to(torch.int64)
    scale_index = torch.arange(length, device=codes.device) // block_size
    scales = absmax.view(rows, -1)[:, scale_index]  # [rows, row_len]
    out.view(rows, length).copy_(qmap[c] * scales)


def _chunk(device: torch.device) -> int:
    return cpu_runtime.CPU_CHUNK if device.type == "cpu" else cpu_runtime.DEVICE_CHUNK


def quantize(src, thresholds, block_size: int, sqrt: bool, codes, absmax, bits: int = 8, row_len=None) -> None:
    """Blockwise quantize (contract in ``contract``), in chunks of whole blocks on the CPU pool; rows that are
    not whole blocks through ``rows``."""
    if not is_flat(src.numel(), row_len, block_size):
        x = ieee_sqrt(src) if sqrt else src.to(torch.float32)
        _quantize_rows(x, thresholds, block_size, codes, absmax, bits, row_len)
        return
    table = lut.code_table(thresholds)
    n, chunk = src.numel(), _chunk(src.device)

    def span(start: int, stop: int) -> None:
        ws = cpu_runtime.workspace(src.device, min(chunk, n))
        dst = codes[start:stop] if bits == 8 else torch.empty(stop - start, dtype=torch.uint8, device=src.device)
        _quantize_span(src[start:stop], dst, absmax[start // block_size : num_blocks(stop, block_size)],
                       thresholds, table, block_size, sqrt, ws)
        if bits != 8:  # chunks are whole blocks: they start on a byte
            pack_codes(dst, codes[code_bytes(start, bits) : code_bytes(stop, bits)], bits)

    cpu_runtime.for_each_chunk(span, n, chunk, src.device)


def quantize_rows(x: torch.Tensor, thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 blocks [nb, B] (transform applied) -> (codes uint8 [nb, B], absmax fp32 [nb]) on x's device and
    thread, through the code table where the codebook has one: the building block of the step."""
    nb, block = x.shape
    table = lut.code_table(thresholds)
    if table is None or x.numel() > cpu_runtime.CPU_CHUNK:
        codes, absmax = reference_codes(x.reshape(-1), thresholds, block)
        return codes.view(nb, block), absmax
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(nb, dtype=torch.float32, device=x.device)
    _quantize_span(x.reshape(-1), codes.view(-1), absmax, thresholds, table, block, False,
                   cpu_runtime.workspace(x.device, cpu_runtime.CPU_CHUNK))
    return codes, absmax


def _gather_codes(codes: torch.Tensor, qmap: torch.Tensor, out: torch.Tensor, ws: cpu_runtime.Workspace) -> None:
    """out [n] = qmap[codes] for codes uint8 [n]; two codes per gather on the CPU when aligned."""
    n = codes.numel()
    if codes.device.type == "cpu" and n % 2 == 0 and codes.storage_offset() % 2 == 0:
        idx = ws.idx[: n // 2].copy_(codes.view(torch.int16)).bitwise_and_(0xFFFF)  # sign-extended -> 0..65535
        torch.index_select(lut.pair_table(qmap), 0, idx, out=out.view(torch.float64))
        return
    idx = ws.idx[:n].copy_(codes)  # index_select takes int32 indices: no int64 temporary
    torch.index_select(qmap, 0, idx, out=out)


def _gather_nibbles(packed: torch.Tensor, qmap: torch.Tensor, out: torch.Tensor, ws: cpu_runtime.Workspace) -> None:
    """out [n] = qmap[code] for the n 4-bit codes in ``packed``; one gather per byte (two codes) where out
    can be viewed as float64 pairs."""
    n = out.numel()
    even = n - n % 2
    if out.storage_offset() % 2 == 0:
        idx = ws.idx[: even // 2].copy_(packed[: even // 2])
        torch.index_select(lut.nibble_pair_table(qmap), 0, idx, out=out[:even].view(torch.float64))
        if n % 2:
            out[-1:].copy_(qmap[(packed[-1:] & 15).to(torch.int64)])
        return
    torch.index_select(qmap, 0, unpack_codes(packed, n, 4).to(torch.int32), out=out)


def dequantize(codes, absmax, qmap, block_size: int, sqrt: bool, out, fresh: bool, bits: int = 8,
               row_len=None) -> None:
    """out = qmap[codes] * absmax[block], squared for ``sqrt`` (contract in ``contract``)."""
    n, chunk = out.numel(), _chunk(codes.device)
    if not is_flat(n, row_len, block_size):
        _dequantize_rows(codes, absmax, qmap, block_size, out, bits, row_len)
        if sqrt:
            out.mul_(out)
        return

    def span(start: int, stop: int) -> None:
        ws = cpu_runtime.workspace(codes.device, min(chunk, n))
        o = out[start:stop]
        stored = codes[code_bytes(start, bits) : code_bytes(stop, bits)]
        if bits == 8:
            _gather_codes(stored, qmap, o, ws)
        elif bits == 4:
            _gather_nibbles(stored, qmap, o, ws)
        else:
            torch.index_select(qmap, 0, unpack_codes(stored, stop - start, bits).to(torch.int32), out=o)
        a = absmax[start // block_size : num_blocks(stop, block_size)]
        full = (stop - start) - (stop - start) % block_size
        o[:full].view(-1, block_size).mul_(a[: full // block_size, None])
        if full < stop - start:
            o[full:].mul_(a[full // block_size])
        if sqrt:
            o.mul_(o)  # v * v in fp32, as the kernels do

    cpu_runtime.for_each_chunk(span, n, chunk, codes.device)


def adam_math(p, g, m, v, vmax, h, maximize: bool):
    """One Adam(W) update on fp32 tensors of one shape; ``h``: fp32 [>= 8] (``contract.HYPER_FIELDS``) on
    their device (``on_device``).
    Returns ``(p, m, v, vmax)``; ``vmax`` is None without amsgrad. Decoupled decay (AdamW) is
    ``h[0] = 1 - lr*wd``, L2 decay (Adam) is ``h[1] = wd``; the unused one is the identity (x*1, x+0*p)."""
    if maximize:
        g = -g
    g = g + h[1] * p
    m = m + h[2] * (g - m)  # torch's lerp(m, g, 1 - beta1) for weights < 0.5
    v = v * h[3] + h[4] * (g * g)
    if vmax is not None:
        vmax = torch.maximum(vmax, v)
    denom = ieee_sqrt(v if vmax is None else vmax) / h[7] + h[5]
    p = p * h[0] + h[6] * (m / denom)
    return p, m, v, vmax


def on_device(h: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The step's scalars on the tensors' device. Not left on the host: CUDA divides by a CPU scalar as a
    multiplication by its reciprocal (ATen's div_true kernel), which is not the IEEE division of the
    contract (an H200 run of the Triton Adam step's test, now tests/kernels/test_step_adam.py, found the reference
    1 ulp off there)."""
    return h if h.device == device else h.to(device)


def uniforms(first, n: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The stochastic rounding's u (``contract``) of elements first .. first + n - 1 (or of the element
    indices ``first``, an int64 tensor of n) for the first and the second moment: two fp32 [n] in [0, 1),
    the high and low halves of one hash per element."""
    index = first.reshape(-1) if isinstance(first, torch.Tensor) else \
        torch.arange(first, first + n, dtype=torch.int64, device=device)
    h = mix32((index & 0xFFFFFFFF) ^ seed)
    return (h >> 16).to(torch.float32) * 2.0**-16, (h & 0xFFFF).to(torch.float32) * 2.0**-16  # exact in fp32


def stochastic_codes(x: torch.Tensor, absmax: torch.Tensor, nearest: torch.Tensor, qmap: torch.Tensor,
                     u: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding (``contract``) of x fp32 [nb, B] (transform applied) with its block scales
    absmax [nb] and round-to-nearest codes [nb, B] on the codebook qmap, given uniforms u fp32 [nb, B] in
    [0, 1) (the step's: ``uniforms``). Returns the codes, uint8 [nb, B]."""
    top = qmap.numel() - 1
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    y = x / safe[:, None]  # the same IEEE division as the nearest code's
    c = nearest.to(torch.int64)
    lo = (c - (y < qmap[c]).to(torch.int64)).clamp_(0, top)
    up = u * (qmap[(lo + 1).clamp(max=top)] - qmap[lo]) < y - qmap[lo]  # P(up) = (y - q[lo]) / gap
    return torch.where(lo == top, top, lo + up.to(torch.int64)).to(torch.uint8)


def _decode_rows(s: StepState) -> torch.Tensor:
    """codes uint8 [nb, B], absmax fp32 [nb] -> qmap[code] * absmax, fp32 [nb, B] (no transform)."""
    return s.qmap[s.codes.to(torch.int64)] * s.absmax[:, None]


def step_rows(p, g, h, states: tuple[StepState, ...], ratio: bool, maximize: bool, seed: int | None = None,
              first: int = 0):
    """The fused step on whole blocks: p, g [nb, B] (any float dtype), states with codes [nb, B]; p[0, 0] is
    element ``first`` of the parameter. Returns (p fp32 [nb, B], ((codes, absmax), ...)): the new values, in
    the order of ``states``; with a ``seed`` the first and second moments' codes are rounded stochastically.
    ``first`` may also be an int64 tensor [nb, B] of the elements' indices (rows of the row layout)."""
    m_state, v_state, *x_state = states
    s = _decode_rows(v_state)  # sqrt(v) as stored
    m = _decode_rows(m_state)
    if ratio:
        m = m * (s + h[8])  # m = r * (s_q + eps'), in this order (ckptq.qstate decodes the same way)
    vmax = None
    if x_state:
        vmax = _decode_rows(x_state[0])
        vmax = vmax * vmax
    p32, m, v, vmax = adam_math(p.float(), g.float(), m, s * s, vmax, h, maximize)
    s = ieee_sqrt(v)  # exact fp32 v: the new divisor of the ratio
    r = m / (s + h[9])
    new, us = (), uniforms(first, r.numel(), seed, r.device) if seed is not None else (None, None)
    for x, state, u in ((r, m_state, us[0]), (s, v_state, us[1])):
        codes, absmax = quantize_rows(x, state.thresholds)
        if u is not None:
            codes = stochastic_codes(x, absmax, codes, state.encode, u.view(x.shape))
        new += ((codes, absmax),)
    if vmax is not None:
        new += (quantize_rows(ieee_sqrt(vmax), x_state[0].thresholds),)
    return p32, new


def _step_span(p, g, h, states, flags: StepFlags, lo: int, hi: int, width: int) -> None:
    """Step elements [lo, hi) as rows of ``width`` (whole blocks, or one short last block), in place."""
    rows, b0 = (hi - lo) // width, lo // flags.block_size
    # lo is a block boundary: every state's codes start on a byte there
    stored = [s.codes[code_bytes(lo, s.bits) : code_bytes(hi, s.bits)] for s in states]
    codes = [unpack_codes(c, hi - lo, s.bits) for c, s in zip(stored, states)]
    views = tuple(s._replace(codes=c.view(rows, width), absmax=s.absmax[b0 : b0 + rows]) for s, c in zip(states, codes))
    p_new, new = step_rows(p[lo:hi].view(rows, width), g[lo:hi].view(rows, width), h, views, flags.ratio,
                           flags.maximize, flags.seed, lo)
    p[lo:hi].view(rows, width).copy_(p_new)
    for view, out, (new_codes, absmax) in zip(views, stored, new):
        pack_codes(new_codes.reshape(-1), out, view.bits)
        view.absmax.copy_(absmax)


def _adam_step_rows(p, g, states: tuple[StepState, ...], h, flags: StepFlags) -> None:
    """The fused step on the row layout: each row's whole blocks, then its short last block, as blocks."""
    n_rows, length = layout_rows(p.numel(), flags.row_len)
    p2, g2 = p.view(n_rows, length), g.view(n_rows, length)
    codes = [unpack_rows(s.codes.view(n_rows, -1), length, s.bits).clone() for s in states]
    absmax = [s.absmax.view(n_rows, -1) for s in states]
    index = torch.arange(p.numel(), dtype=torch.int64, device=p.device).view(n_rows, length)
    for cols, width in _row_parts(length, flags.block_size):
        b0, b1 = cols.start // flags.block_size, num_blocks(cols.stop, flags.block_size)
        views = tuple(s._replace(codes=_row_blocks(c, cols, width), absmax=a[:, b0:b1].reshape(-1))
                      for s, c, a in zip(states, codes, absmax))
        p_new, new = step_rows(_row_blocks(p2, cols, width), _row_blocks(g2, cols, width), h, views, flags.ratio,
                               flags.maximize, flags.seed, _row_blocks(index, cols, width))
        p2[:, cols] = p_new.view(n_rows, -1).to(p.dtype)
        for c, a, (new_codes, new_absmax) in zip(codes, absmax, new):
            c[:, cols] = new_codes.view(n_rows, -1)
            a[:, b0:b1] = new_absmax.view(n_rows, -1)
    for s, c in zip(states, codes):
        s.codes.view(n_rows, -1).copy_(pack_rows(c, s.bits))


def adam_step(p, g, states: tuple[StepState, ...], h, flags: StepFlags) -> None:
    """The fused 8-bit Adam(W) step in chunks of whole blocks (contract in ``contract``). A short last
    block is stepped on its own as [1, length]: padding would take part in the block's math."""
    block, h = flags.block_size, on_device(h, p.device)
    if not is_flat(p.numel(), flags.row_len, block):
        with torch.no_grad():
            _adam_step_rows(p, g, states, h, flags)
        return

    def run(start: int, end: int) -> None:
        full = start + (end - start) // block * block
        with torch.no_grad():  # grad mode is per thread: pool workers run without it, as step() does
            if full > start:
                _step_span(p, g, h, states, flags, start, full, block)
            if end > full:
                _step_span(p, g, h, states, flags, full, end, end - full)

    cpu_runtime.for_each_chunk(run, p.numel(), STEP_CHUNK, p.device)


def adam_dense_step(p, g, exp_avg, exp_avg_sq, max_exp_avg_sq, h, maximize: bool) -> None:
    """The same update for parameters whose moments are plain fp32 tensors, in place."""
    h = on_device(h, p.device)
    p32, m, v, vmax = adam_math(p.float(), g.float(), exp_avg, exp_avg_sq, max_exp_avg_sq, h, maximize)
    p.copy_(p32)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if max_exp_avg_sq is not None:
        max_exp_avg_sq.copy_(vmax)


def adam_step_group(group: StepGroup) -> None:
    """The group's members stepped one after another: what every backend's grouped step must equal."""
    for call in member_steps(group):
        adam_step(*call)


def adam_dense_group(group: DenseGroup) -> None:
    """``adam_dense_step`` on each member, one after another."""
    for p, g, moments, h in zip(group.params, group.grads, group.moments, group.hyper):
        exp_avg, exp_avg_sq, *vmax = moments
        adam_dense_step(p, g, exp_avg, exp_avg_sq, vmax[0] if vmax else None, h, group.maximize)
