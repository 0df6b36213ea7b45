"""Other libraries' 8-bit Adam state, read into torch's fp32 form: ckptq as the bridge between them.

bitsandbytes (``AdamW8bit``/``Adam8bit``): per parameter ``{"step": int, "state1", "state2", "qmap1",
"qmap2", "absmax1", "absmax2"}`` (blockwise: value = qmap[code] * absmax[i // block]) or ``max1``/``max2``
(one scale per tensor), flat in releases before 0.45 and nested under ``__bnb_optimizer_quant_state__``
since; ``state1``/``state2`` are fp32 tensors for parameters below its ``min_8bit_size`` (and in its 32-bit
optimizers). ``state1`` is Adam's first moment and ``state2`` its second, both stored as they are (no sqrt).
Its one-state optimizers (Lion8bit, PagedLion8bit, Lion32bit, SGD8bit, RMSprop8bit, Adagrad8bit) hold only
``state1``, read into the state key of their torch (or lion-pytorch) counterpart (``_one_state``).

torchao (``torchao.optim.AdamW8bit``/``4bit``/``Fp8``): ``exp_avg``/``exp_avg_sq`` are tensor subclasses
(``OptimState8bit``...) whose ``dequantize()`` gives the fp32 values; loading such a file needs torchao
and ``--trust`` (torch.load refuses the classes otherwise).

torchao's 8-bit and 4-bit states are ckptq's blockwise codes under other names: value = qmap[code] *
scale[i // block_size], codes flat in C order (``OptimState8bit``: one per byte; ``OptimState4bit``: two
per byte, element 2i in the high nibble where ckptq keeps it in the low one). ``torchao_qstate`` and
``torchao_state`` move a state between the two forms without changing a bit: what the framework
integrations store for a torchao optimizer, readable without torchao and resumed exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from . import checkpoint, policy, qstate
from .views import unbacked
from ..errors import InputError

BNB_NESTED = "__bnb_optimizer_quant_state__"
_BNB_KEYS = {"state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2", "max1", "max2", "new_max1", "new_max2",
             "unorm_vec"}


def kind(pstate: Any) -> str | None:
    """"bitsandbytes", "torchao" or None for one parameter's optimizer state."""
    if not isinstance(pstate, dict):
        return None
    if isinstance(pstate.get(BNB_NESTED), dict) or "state1" in pstate:
        return "bitsandbytes"
    if any(is_torchao(v) for v in pstate.values()):
        return "torchao"
    return None


def is_torchao(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and type(t).__module__.startswith("torchao") and hasattr(t, "dequantize")


def _dense(t) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta


def _backed(t: torch.Tensor, name: str) -> None:
    """InputError unless each element of ``t`` (bitsandbytes' ``name``) has bytes of its own: a zero-stride
    or overlapping view claims elements that no input bytes back (3 KB claiming 2**32 codes), and decoding
    it would allocate in proportion to the claim. Checked before anything is allocated for it."""
    why = unbacked(t)
    if why is not None:
        raise InputError(f"bitsandbytes {name} is {why}: {t.numel()} values in {t.untyped_storage().nbytes()} bytes; "
                         "bitsandbytes saves no such tensor, the state dict is damaged or crafted")


def _bnb_moment(q: dict, i: int, numel: int) -> torch.Tensor:
    """bitsandbytes' state{i} decoded to fp32 (``numel`` values, as state1); every tensor it reads is checked
    first (dense, its own bytes, its shape), so that what is allocated is in proportion to the input's bytes."""
    codes = q.get(f"state{i}")
    if not _dense(codes) or codes.numel() != numel:
        got = f"a {codes.layout} tensor of {codes.numel()}" if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise InputError(f"bitsandbytes state{i} is not a dense tensor of {max(numel, 1)} values as state1 (got {got}); "
                         "the state dict is damaged")
    _backed(codes, f"state{i}")
    if codes.dtype != torch.uint8:
        return _checked(codes.float(), i)
    qmap, absmax = q.get(f"qmap{i}"), q.get(f"absmax{i}", q.get(f"max{i}"))
    if not _dense(qmap) or qmap.numel() != 256 or not _dense(absmax) or absmax.numel() < 1:
        raise InputError(f"bitsandbytes 8-bit state{i} lacks its qmap{i}/absmax{i} (dense, 256 entries and one scale "
                         "per block); the state dict is damaged")
    if qmap.dim() != 1:
        raise InputError(f"bitsandbytes qmap{i} has shape {tuple(qmap.shape)}; it is one row of 256 values (the "
                         "codebook), the state dict is damaged")
    _backed(absmax, f"absmax{i}")
    block = _block_size(numel, absmax.numel(), i)
    return _checked(_decoded(codes.reshape(-1), qmap.float(), absmax.float().reshape(-1), block), i)


_CHUNK = 1 << 22  # codes decoded at a time: a multiple of every block size but a whole tensor's (one scale)


def _decoded(codes: torch.Tensor, qmap: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """qmap[code] * scales[i // block] for every code, fp32, a chunk at a time: the output and one chunk's
    indices are all that is allocated."""
    out = torch.empty(codes.numel(), dtype=torch.float32)
    for start in range(0, codes.numel(), _CHUNK):
        end = min(start + _CHUNK, codes.numel())
        values = qmap[codes[start:end].long()]
        first, last = start // block, (end - 1) // block
        whole = (last - first) * block  # the chunk's full blocks; the last one may be cut short
        values[:whole].view(-1, block).mul_(scales[first:last, None])
        values[whole:].mul_(scales[last])
        out[start:end] = values
    return out


def _checked(values: torch.Tensor, i: int) -> torch.Tensor:
    """A moment decoded from bitsandbytes' state{i} (qmap{i}[code] * absmax{i} at 8 bits): finite, and a
    second moment (i = 2) >= 0, as its codebook and scales make it; else InputError naming them."""
    what = f"bitsandbytes state{i} decodes (qmap{i}[code] * absmax{i}) to"
    if not torch.isfinite(values).all():
        raise InputError(f"{what} NaN or infinite values; the state dict is damaged")
    if i == 2 and (values < 0).any():
        raise InputError(f"{what} negative values, where state2 is a second moment; the state dict is damaged")
    return values


def _block_size(numel: int, n_blocks: int, i: int) -> int:
    """The power of two B with ceil(numel / B) == n_blocks (256 since bitsandbytes 0.44, 2048 before; unique
    when n_blocks > 1); one block, the whole tensor, for ``max{i}`` states."""
    if n_blocks == 1:
        return max(numel, 1)
    for b in (2**k for k in range(5, 17)):
        if -(-numel // b) == n_blocks:
            return b
    raise InputError(f"bitsandbytes state{i}: {n_blocks} scales for {numel} values fit no block size; it is damaged")


def _bnb_step(step) -> torch.Tensor:
    try:
        return torch.tensor(float(step.item() if isinstance(step, torch.Tensor) else step), dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise InputError(f"bitsandbytes state has step {type(step).__name__} {str(step)[:40]!r}, not a number; the state "
                         "dict is damaged") from None


def _one_state(group: dict) -> tuple[str, dict]:
    """(the torch state key of a bitsandbytes one-state optimizer's ``state1``, the param-group entries its
    torch counterpart needs). bitsandbytes saves no optimizer name; its ``Optimizer1State`` passes them as
    ``betas`` and ``eps``: (momentum, dampening) and 0 for SGD8bit (which requires momentum; its kernel
    ignores dampening), (beta1, beta2) and 0 for Lion, (alpha, momentum) and eps for RMSprop8bit (which
    requires momentum 0), (0, 0) and eps for Adagrad8bit."""
    betas, eps = group.get("betas", (0.0, 0.0)), _group_number(group, "eps", group.get("eps", 0.0))
    b1, b2 = (_group_number(group, "betas", b) for b in betas) if isinstance(betas, (list, tuple)) and len(betas) == 2 \
        else (0.0, 0.0)
    if eps == 0.0:
        if b2 == 0.0:
            return "momentum_buffer", {"momentum": b1, "dampening": 0.0, "nesterov": False}
        return "exp_avg", {}  # Lion: lion-pytorch reads lr, betas and weight_decay, as bitsandbytes saves them
    if b1 == 0.0 and b2 == 0.0:
        return "sum", {"lr_decay": 0.0, "initial_accumulator_value": 0.0}
    return "square_avg", {"alpha": b1, "momentum": b2, "centered": False}


def _group_number(group: dict, name: str, value) -> float:
    """A param group's number as bitsandbytes saves it (a float, an int, a one-element tensor); InputError
    naming it for anything else."""
    try:
        if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.numel() != 1):
            raise TypeError
        return float(value.item() if isinstance(value, torch.Tensor) else value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise InputError(f"bitsandbytes param group has {name} {type(value).__name__} {str(value)[:40]}, not a "
                         "number; the state dict is damaged") from None


def _from_bnb(pstate: dict, group: dict) -> dict:
    """One parameter's bitsandbytes state in its torch counterpart's form; ``group`` (its param group) gets
    the entries that counterpart needs, where it lacks them."""
    q = pstate[BNB_NESTED] if isinstance(pstate.get(BNB_NESTED), dict) else pstate
    numel = q["state1"].numel() if _dense(q.get("state1")) else -1
    out = {k: v for k, v in pstate.items() if k != BNB_NESTED and k not in _BNB_KEYS}
    out["step"] = _bnb_step(pstate.get("step", 0))
    if "state2" not in q and _dense(q.get("state1")):
        key, entries = _one_state(group)
        for name, value in entries.items():
            group.setdefault(name, value)
        out[key] = _bnb_moment(q, 1, numel).reshape(q["state1"].shape)
        return out
    if _dense(q.get("state2")) and _dense(q.get("state1")) and q["state1"].dim() >= 1 and q["state1"].shape[0] == 2 \
            and q["state1"].shape[1:] == q["state2"].shape:
        return {**out, **_from_ademamix(q)}
    out["exp_avg"] = _bnb_moment(q, 1, numel).reshape(q["state1"].shape)
    out["exp_avg_sq"] = _bnb_moment(q, 2, numel).reshape(q["state1"].shape)
    return out


def _from_ademamix(q: dict) -> dict:
    """bitsandbytes' AdEMAMix: ``state1`` stacks the fast and the slow EMA ([2, *shape], each half with its own
    row of ``absmax1`` at 8 bits), ``state2`` the second moment; as AdEMAMix8bit's keys."""
    shape, n = q["state2"].shape, q["state2"].numel()
    halves = []
    for k in range(2):
        half = {"state1": q["state1"][k], "qmap1": q.get("qmap1")}
        for name in ("absmax1", "max1"):
            scales = q.get(name)
            if _dense(scales) and scales.dim() >= 1 and scales.shape[0] == 2:
                half[name] = scales[k]
            elif scales is not None and q["state1"].dtype == torch.uint8:
                raise InputError(f"bitsandbytes AdEMAMix {name} has shape {tuple(getattr(scales, 'shape', ()))}, not "
                                 "one row of scales per EMA ([2, blocks]); the state dict is damaged")
        halves.append(_bnb_moment(half, 1, n).reshape(shape).clone())  # fp32 halves: views of one storage
    return {"exp_avg": halves[0], "exp_avg_slow": halves[1], "exp_avg_sq": _bnb_moment(q, 2, n).reshape(shape)}


def _from_torchao(pstate: dict) -> dict:
    out = {}
    for k, v in pstate.items():
        out[k] = _torchao_decoded(v, k) if is_torchao(v) else v
    return out


def _torchao_parts(t: torch.Tensor, key: str) -> dict:
    """The tensors a torchao state is made of (codes, scale, qmap), each checked to hold bytes of its own, the
    codes as many values as the state claims (two per byte at 4 bits): what its ``dequantize`` allocates is
    then in proportion to them. InputError otherwise."""
    try:
        names = t.__tensor_flatten__()[0]
        parts = {n: getattr(t, n) for n in names}
    except Exception:  # noqa: BLE001 -- a subclass of another make: said in one line
        raise InputError(f"torchao state {key} ({type(t).__name__}) does not list its parts") from None
    for name, part in parts.items():
        why = unbacked(part) if _dense(part) else "not a dense tensor"
        if why is not None:
            raise InputError(f"torchao state {key}: its {name} is {why}; torchao saves no such tensor, the state "
                             "dict is damaged or crafted")
    codes = parts.get("codes")
    per_byte = 2 if type(t).__name__ == "OptimState4bit" else 1
    if codes is None or codes.numel() * per_byte != t.numel():
        held = "no codes" if codes is None else f"{codes.numel() * per_byte} codes"
        raise InputError(f"torchao state {key} ({type(t).__name__}) claims {t.numel()} values and holds {held}; "
                         "the state dict is damaged or crafted")
    return parts


def _torchao_decoded(t: torch.Tensor, key: str) -> torch.Tensor:
    _torchao_parts(t, key)
    try:
        return t.dequantize().float()
    except (RuntimeError, ValueError, IndexError, TypeError) as e:  # torchao's code, on parts that do not fit
        raise InputError(f"torchao state {key} ({type(t).__name__}) does not decode ({str(e)[:120]}); the state "
                         "dict is damaged or crafted") from None


def to_torch_state(pstate: Any, group: dict | None = None) -> dict | None:
    """One parameter's bitsandbytes/torchao state in its torch counterpart's fp32 form (Adam's ``step``,
    ``exp_avg``, ``exp_avg_sq``; a one-state optimizer's key, with the entries its counterpart needs added
    to ``group``), or None if it is neither's. InputError if it is damaged."""
    k = kind(pstate)
    if k is None:
        return None
    return _from_bnb(pstate, {} if group is None else group) if k == "bitsandbytes" else _from_torchao(pstate)


def to_torch(obj: Any) -> int:
    """Rewrite, in place, every bitsandbytes/torchao per-parameter state inside ``obj``'s optimizer state
    dicts into its torch counterpart's fp32 form (``to_torch_state``: Adam's ``step``, ``exp_avg``, ``exp_avg_sq``;
    a one-state optimizer's ``_one_state``). Returns how many."""
    n = 0
    for found in checkpoint.find_optimizers(obj):
        state = found.state_dict["state"]
        groups = checkpoint.groups_by_param(found.state_dict, "/".join(map(str, found.path)) or "<root>")
        for pid, pstate in list(state.items()):
            try:
                converted = to_torch_state(pstate, groups.get(pid, {}))
            except InputError as e:
                raise InputError(f"optimizer at {'/'.join(map(str, found.path)) or '<root>'}, parameter {str(pid)[:40]}: "
                                 f"{e}") from None
            if converted is not None:
                state[pid] = converted
                n += 1
    return n


_TORCHAO_BITS = {"OptimState8bit": 8, "OptimState4bit": 4}


def torchao_bits(t: Any) -> int | None:
    """The code width of a torchao optimizer state (8 or 4; its fp8 state: 8), None for anything else."""
    if not is_torchao(t):
        return None
    return _TORCHAO_BITS.get(type(t).__name__, 8)


def _swap_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes between torchao's packing and ckptq's (the same swap both ways)."""
    return (codes << 4) | (codes >> 4)


def torchao_qstate(t: Any) -> dict | None:
    """torchao's ``OptimState8bit``/``OptimState4bit`` as a ckptq qstate dict with the same codes, scales
    and codebook (it decodes to the same fp32 values, bit for bit); None for any other tensor, torchao's
    ``OptimStateFp8`` included, and for block sizes ckptq does not store (``policy.BLOCK_SIZES``)."""
    bits = _TORCHAO_BITS.get(type(t).__name__) if is_torchao(t) else None
    if bits is None or t.block_size not in policy.BLOCK_SIZES:
        return None
    _torchao_parts(t, "state")
    codes = t.codes.reshape(-1)
    codes = _swap_nibbles(codes) if bits == 4 else codes
    return qstate.QState(codes, t.scale.float(), t.qmap, t.block_size, "none", tuple(t.shape),
                         str(t.dtype).removeprefix("torch."), bits).to_dict()


def torchao_state(q: dict, like: torch.Tensor | None = None) -> torch.Tensor | None:
    """The torchao state that qstate ``q`` holds exactly (``torchao_qstate`` undone), or None when ``q``
    is not in torchao's layout (codebook, width, no transform) or, given ``like`` (the zero state the
    optimizer makes for the parameter), not in ``like``'s class, block size, codebook and shape."""
    s = qstate.QState.from_dict(q)
    cls = _torchao_classes().get(s.bits)
    if cls is None or s.transform != "none":
        return None
    if like is not None:
        if not (type(like) is cls and like.block_size == s.block_size and tuple(like.shape) == tuple(s.shape)
                and torch.equal(like.qmap.cpu(), s.qmap.cpu())):
            return None
        signed, device, dtype = like.signed, like.device, like.dtype
    else:
        maps = {sign: cls.zeros(s.block_size, sign, s.block_size).qmap for sign in (True, False)}
        signed = next((sign for sign, qmap in maps.items() if torch.equal(qmap, s.qmap.cpu())), None)
        if signed is None:
            return None
        device, dtype = s.codes.device, getattr(torch, s.dtype)
    codes, scale, qmap = s.codes.to(device), s.absmax.to(device), s.qmap.to(device)
    if s.bits == 8:
        return cls(codes.reshape(tuple(s.shape)), scale, qmap, signed, dtype=dtype)
    return cls(_swap_nibbles(codes), scale, qmap, signed, tuple(s.shape), dtype=dtype)


def _torchao_classes() -> dict:
    """torchao's state classes by code width, imported only when a torchao state is at hand (torchao 0.11
    moved them from ``torchao.prototype.low_bit_optim`` to ``torchao.optim``)."""
    try:
        from torchao.optim import subclass_4bit, subclass_8bit
    except ImportError:
        from torchao.prototype.low_bit_optim import subclass_4bit, subclass_8bit
    return {8: subclass_8bit.OptimState8bit, 4: subclass_4bit.OptimState4bit}


def torchao_to_qstates(obj: Any) -> int:
    """Replace, in place, each torchao state in ``obj``'s optimizer state dicts that has a
    ``torchao_qstate`` by it; returns how many. Others (``OptimStateFp8``) stay as they are."""
    n = 0
    for found in checkpoint.find_optimizers(obj):
        for pstate in found.state_dict["state"].values():
            if kind(pstate) != "torchao":
                continue
            for key, value in pstate.items():
                q = torchao_qstate(value)
                if q is not None:
                    pstate[key] = q
                    n += 1
    return n
