"""Quantizing optimizer states and decoding them: the one moment quantizer every part of ckptq uses
(convert, info, the optimizer's init and ``load_state_dict``, the DCP planners and folders, DeepSpeed,
the integrations), on top of the blockwise operations of ``ckptq.codec.ops``.

A state is quantized on its own (``quantize_state``: the codebook and transform of its key and width,
``ckptq.codec.policy``) or, for a first moment, as the ratio to its exact second moment
(``quantize_ratio``; ``ckptq.codec.qstate`` says why). New states use the row layout; states of older files
keep the flat one, which decodes the same way. Large tensors are worked through in chunks of whole rows
(or of whole blocks of one row), so temporaries stay bounded.
"""

from __future__ import annotations

import torch

from ..errors import FormatError, UsageError
from ..format.dtypes import dtype_name, float_dtype_from_name
from ..kernels.contract import is_flat, layout_blocks, layout_bytes, layout_rows
from . import ops
from .dtensor import is_dtensor
from .policy import DEFAULT_BLOCK_SIZE, RATIO_TRANSFORM, policy_for, ratio_policy
from .qstate import QState, is_qstate, layout_shapes, row_len_of

_CHUNK = 1 << 22  # elements per chunk (a multiple of every block size): bounded temporaries


def _spans(n: int, row_len: int | None, block_size: int):
    """(start, stop, row length) of chunks of about _CHUNK elements: whole blocks of one flat run, or whole
    rows (row length as given) where rows are not whole blocks."""
    if is_flat(n, row_len, block_size):
        for start in range(0, n, _CHUNK):
            yield start, min(start + _CHUNK, n), None
        return
    rows, length = layout_rows(n, row_len)
    per = max(1, _CHUNK // length)
    for r0 in range(0, rows, per):
        yield r0 * length, min(rows, r0 + per) * length, length


def _offsets(start: int, sub: int | None, bits: int, block_size: int) -> tuple[int, int]:
    """The code byte and the scale where a span of ``_spans`` starts."""
    return layout_bytes(start, sub, bits), layout_blocks(start, sub, block_size)


def _empty_parts(shape, bits: int, block_size: int, layout: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    codes_shape, absmax_shape = layout_shapes(shape, bits, block_size, layout)
    return (torch.empty(codes_shape, dtype=torch.uint8, device=device),
            torch.empty(absmax_shape, dtype=torch.float32, device=device))


def quantize_state(t: torch.Tensor, key: str, block_size: int = DEFAULT_BLOCK_SIZE, backend: str = "auto",
                   bits: int = 8, layout: str = "rows", role: str | None = None) -> dict:
    """Quantize one optimizer state tensor under the policy for its role, or its Adam state key (dict form),
    with codes of ``bits`` bits (8, 4 or 2: ``policy.convert_width`` says which a state of a converted file gets)."""
    pol = policy_for(key, ops.check_bits(bits), role)
    qmap = pol.qmap().to(t.device)
    codes, absmax = ops.quantize_blockwise(t, qmap, block_size, pol.transform, backend, bits,
                                           row_len=row_len_of(t.shape, layout))
    codes_shape, absmax_shape = layout_shapes(t.shape, bits, block_size, layout)
    return QState(codes.view(codes_shape), absmax.view(absmax_shape), qmap, block_size, pol.transform,
                  tuple(t.shape), dtype_name(t.dtype), bits, layout=layout).to_dict()


def quantize_ratio(m: torch.Tensor, v: torch.Tensor, eps: float, block_size: int = DEFAULT_BLOCK_SIZE,
                   backend: str = "auto", divisor_key: str = "exp_avg_sq", bits: int = 8, layout: str = "rows") -> dict:
    """Quantize a first moment ``m`` as r = m / (sqrt(v) + eps), ``v`` its exact second moment (dict form),
    with codes of ``bits`` bits (8, 6 or 4)."""
    if m.numel() != v.numel():
        raise FormatError(f"ratio state has {m.numel()} elements but its divisor {v.numel()}")
    qmap = ratio_policy(ops.check_bits(bits)).qmap().to(m.device)
    flat, vflat = m.detach().reshape(-1), v.detach().reshape(-1)
    n, row_len = flat.numel(), row_len_of(m.shape, layout)
    codes, absmax = _empty_parts(m.shape, bits, block_size, layout, m.device)
    buf = torch.empty(min(_CHUNK, n) or 1, dtype=torch.float32, device=m.device)
    for start, stop, sub in _spans(n, row_len, block_size):
        r = ops.ieee_sqrt_into(vflat[start:stop], buf[: stop - start]).add_(eps)  # sqrt(v) + eps, in place
        torch.div(flat[start:stop], r, out=r)  # r = m / (sqrt(v) + eps): IEEE division, m promoted to fp32
        c, a = ops.quantize_blockwise(r, qmap, block_size, "none", backend, bits, row_len=sub)
        at, scale_at = _offsets(start, sub, bits, block_size)
        codes.view(-1)[at : at + c.numel()], absmax.view(-1)[scale_at : scale_at + a.numel()] = c, a
    return QState(codes, absmax, qmap, block_size, RATIO_TRANSFORM, tuple(m.shape), dtype_name(m.dtype), bits,
                  eps=float(eps), divisor=divisor_key, layout=layout).to_dict()


def quantize_as(t: torch.Tensor, key: str, block_size: int, bits: int, divisor: tuple | None = None,
                backend: str = "auto", layout: str = "rows", role: str | None = None) -> dict:
    """The one moment quantizer behind every writer: state ``t`` (key ``key``, of ``role``) on its own, or,
    with ``divisor`` = (its second moment's key, that exact tensor, eps'), as the ratio to it."""
    if divisor is None:
        return quantize_state(t, key, block_size, backend, bits, layout, role)
    divisor_key, v, eps = divisor
    return quantize_ratio(t, v.to(t.device), eps, block_size, backend, divisor_key, bits, layout)


def _decode(q: QState, backend: str, span: tuple | None = None, transform: str | None = None) -> torch.Tensor:
    """The stored values, fp32 (sqrt undone unless ``transform`` says otherwise): all of them, or those of
    ``span`` (start, stop, row length) from ``_spans``."""
    start, stop, sub = span or (0, q.numel, q.row_len)
    at, scale_at = _offsets(start, sub, q.bits, q.block_size)
    codes = q.codes.reshape(-1)[at : at + layout_bytes(stop - start, sub, q.bits)]
    absmax = q.absmax.reshape(-1)[scale_at : scale_at + layout_blocks(stop - start, sub, q.block_size)]
    transform = transform or ("none" if q.is_ratio else q.transform)
    try:
        return ops.dequantize_blockwise(codes, absmax, q.qmap, q.block_size, transform, backend, bits=q.bits,
                                        numel=stop - start, row_len=sub)
    except UsageError as exc:
        raise FormatError(f"quantized state is malformed: {exc}") from None


def _to_dense(flat: torch.Tensor, q: QState) -> torch.Tensor:
    return flat.view(tuple(q.shape)).to(float_dtype_from_name(q.dtype, "quantized state"))


def _whole(q: dict | None) -> dict | None:
    if q is None or not is_dtensor(q.get("codes")):
        return q
    return {**q, "codes": q["codes"].full_tensor(), "absmax": q["absmax"].full_tensor()}


def dequantize_state(q: dict, backend: str = "auto", divisor: dict | None = None) -> torch.Tensor:
    """Back to a dense tensor of the original shape and dtype. A ratio state needs its ``divisor``
    (the sibling qstate named by ``q["divisor"]``); :func:`dequantize_states` finds it for you. A qstate placed
    like a DTensor parameter (``ckptq.codec.sharded``) is gathered first: the whole tensor, on every rank."""
    q, divisor = _whole(q), _whole(divisor)
    qs = QState.from_dict(q)
    if not qs.is_ratio:
        return _to_dense(_decode(qs, backend), qs)
    if divisor is None or not is_qstate(divisor):
        raise FormatError(f"a ratio state needs its divisor {qs.divisor!r} to decode; pass the param's whole state")
    v = QState.from_dict(divisor)
    if v.numel != qs.numel or v.row_len != qs.row_len or v.transform != "sqrt":
        raise FormatError(f"ratio state of shape {list(qs.shape)} ({qs.layout}) and its divisor of shape "
                          f"{list(v.shape)} ({v.layout}, {v.transform}) do not pair; the state is corrupt")
    r = torch.empty(qs.numel, dtype=torch.float32, device=qs.codes.device)
    for start, stop, sub in _spans(qs.numel, qs.row_len, qs.block_size):
        part = _decode(qs, backend, (start, stop, sub))
        s = _decode(v, backend, (start, stop, sub), transform="none")  # sqrt(v) as stored
        r[start:stop] = part.mul_(s.add_(qs.eps))  # m = r * (s_q + eps')
    return _to_dense(r, qs)


def dequantize_states(pstate: dict, backend: str = "auto") -> dict:
    """A param's state dict with every qstate decoded (ratio states through their sibling divisor)."""
    out = dict(pstate)
    for key, value in pstate.items():
        if is_qstate(value):
            out[key] = dequantize_state(value, backend, pstate.get(value.get("divisor")))
    return out


def count_qstates(obj) -> int:
    """How many quantized states a loaded object holds, anywhere inside its dicts and lists."""
    if is_qstate(obj):
        return 1
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(count_qstates(v) for v in values)


def decode_qstates(obj, backend: str = "auto") -> None:
    """Decode, in place, every quantized state inside a loaded object (dicts and lists) to a dense tensor,
    ratio states through their sibling: what an fp32 optimizer loads."""
    if isinstance(obj, dict):
        if any(is_qstate(v) for v in obj.values()):
            obj.update(dequantize_states(obj, backend))
        values = obj.values()
    else:
        values = obj if isinstance(obj, (list, tuple)) else ()
    for v in values:
        decode_qstates(v, backend)
