"""The operations, declared once: blockwise quantize, dequantize, the fused 8-bit Adam step and the one-state
step (SGD, Lion, Muon).

Every operation takes the code width ``bits``: 8 (one code per byte, 256-entry codebooks), 6, 4 or 2
(packed codes, 2**bits-entry codebooks; layout in ``kernels/contract.py``). Every backend serves
each, and the step takes a width per moment.

Each public function here validates its inputs once, resolves the backend once, and hands flat,
contiguous, already-checked tensors to one backend implementation in ``ckptq.kernels`` (signatures in
``kernels/contract.py``):

    torch   ckptq.kernels.backend_torch   the PyTorch reference; any device, any float dtype, any codebook
    native  ckptq.kernels.backend_native  C for the CPU (cpu_kernels.c, built on first use)
    triton  ckptq.kernels.backend_triton  Triton for CUDA (on the CPU only under TRITON_INTERPRET=1)

``backend="auto"`` is Triton on CUDA, C on the CPU where it builds, else PyTorch. All three give the
same bits. Where the C kernels cannot take a call (a float64 tensor, a codebook without a code table)
the reference serves it, with the same results.

DTensor parameters (FSDP2) are stepped on their local shards: the backends only ever see plain local
tensors. Other tensor subclasses are refused with a UsageError.

Why plain Python dispatch and not ``torch.library`` custom ops: the step mutates up to eight tensors in
place and its states carry codebooks and a block layout that DTensor's sharding propagation cannot
express (blocks must not straddle a shard), so the optimizer works on local shards explicitly, as
torchao's low-bit optimizers do; the C path runs chunks on a thread pool through ctypes, which a custom
op would wrap without gain; and nothing in ckptq traces these calls with torch.compile. A custom-op
declaration can be added over these functions without changing them if that changes.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Sequence

import torch

from ..errors import UsageError
from .defaults import DEFAULT_BLOCK_SIZE, check_block_size
from .dtensor import is_dtensor
from ..kernels import contract, cpu_runtime, memo, registry
from ..kernels.ieee import ieee_sqrt, ieee_sqrt_into
from ..kernels.contract import (KERNEL_DTYPES, StepFlags, StepState, code_bytes, is_flat, layout_blocks, layout_bytes,
                                midpoints, num_blocks)

BACKENDS = ("auto", "torch", "native", "triton")  # the one place that knows which backends exist
TRANSFORMS = ("none", "sqrt")
SUPPORTED_BITS = contract.WIDTHS  # code widths; a 2**bits-entry codebook

__all__ = ["quantize_blockwise", "dequantize_blockwise", "adam8bit_step", "adam_dense_step", "momentum_step", "StepInput",
           "resolve_backend", "midpoints", "num_blocks", "code_bytes", "ieee_sqrt", "ieee_sqrt_into"]


class StepInput(NamedTuple):
    """One quantized moment of a param for ``adam8bit_step``."""

    codes: torch.Tensor  # uint8 [code_bytes(n, bits)], flat and contiguous: rewritten in place
    absmax: torch.Tensor  # fp32 [ceil(n / block_size)], contiguous: rewritten in place
    qmap: torch.Tensor  # the codebook the stored codes refer to
    encode_qmap: torch.Tensor  # the codebook the new codes are written with


def check_bits(bits: int) -> int:
    if type(bits) is not int or bits not in SUPPORTED_BITS:
        raise UsageError(f"{bits}-bit codes are not supported; use bits={' or '.join(map(str, SUPPORTED_BITS))}")
    return bits


def check_codebook(qmap: torch.Tensor, bits: int = 8) -> None:
    """UsageError unless ``qmap`` is a 1-D float tensor of 2**bits entries."""
    if not isinstance(qmap, torch.Tensor) or not qmap.is_floating_point() or qmap.shape != (2**bits,):
        got = f"{qmap.dtype} {tuple(qmap.shape)}" if isinstance(qmap, torch.Tensor) else type(qmap).__name__
        raise UsageError(f"codebook must be a float tensor of {2**bits} entries, got {got}")


def check_row_len(n: int, row_len: int | None) -> int | None:
    """``row_len`` (None: one row) if it tiles n elements into whole rows, else UsageError."""
    if row_len is None:
        return None
    if isinstance(row_len, bool) or not isinstance(row_len, int) or row_len < 1 or n % row_len:
        raise UsageError(f"row length {row_len!r} does not divide the {n} elements into whole rows; pass the "
                         "product of the tensor's dims after the first")
    return row_len


def check_quantized(codes, absmax, qmap, block_size: int, bits: int = 8, numel: int | None = None,
                    row_len: int | None = None) -> int:
    """UsageError unless codes are uint8 and hold ``numel`` codes of ``bits`` bits (default: as many as
    fit) in rows of ``row_len`` (None: one row; ``kernels/contract.py``), absmax holds one float scale
    per block of each row on the same device, and ``qmap`` is a codebook of 2**bits entries: what every
    dequantize path relies on. Returns the element count."""
    check_block_size(block_size)
    check_bits(bits)
    check_codebook(qmap, bits)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise UsageError(f"codes must be a uint8 tensor, got {getattr(codes, 'dtype', type(codes).__name__)}")
    n = codes.numel() * 8 // bits if numel is None else numel
    check_row_len(n, row_len)
    if layout_bytes(n, row_len, bits) != codes.numel():
        raise UsageError(f"{codes.numel()} bytes of codes cannot hold {n} {bits}-bit codes in rows of "
                         f"{row_len or n} ({layout_bytes(n, row_len, bits)} bytes); pass the element count and "
                         "row length of the quantized tensor")
    n_blocks = layout_blocks(n, row_len, block_size)
    if not isinstance(absmax, torch.Tensor) or not absmax.is_floating_point() or absmax.numel() != n_blocks:
        raise UsageError(
            f"absmax must be float with {n_blocks} entries for {n} codes in blocks of {block_size}, "
            f"got {getattr(absmax, 'dtype', type(absmax).__name__)} with {getattr(absmax, 'numel', lambda: '?')()}; "
            "pass the absmax that quantize_blockwise returned"
        )
    if absmax.device != codes.device:
        raise UsageError(f"codes are on {codes.device} but absmax is on {absmax.device}; move them together")
    return n


def _check_transform(transform: str) -> bool:
    if transform not in TRANSFORMS:
        raise UsageError(f"transform {transform!r} is not one of {', '.join(TRANSFORMS)}")
    return transform == "sqrt"


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> ``triton`` on CUDA, ``native`` (the C kernels) on the CPU when they could be built,
    else ``torch``. An explicit choice that cannot run raises UsageError saying why."""
    if backend not in BACKENDS:
        raise UsageError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if device.type == "cuda":
            return "triton"
        return "native" if device.type == "cpu" and _native().available() else "torch"
    if backend == "native":
        if device.type != "cpu":
            raise UsageError(f"backend 'native' runs on the CPU, not on {device}; use 'auto'")
        if not _native().available():
            raise UsageError(f"backend 'native' is unavailable: {_native().why_unavailable()}")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UsageError(f"backend 'triton' runs on CUDA, not on {device}; use 'auto'")
    return backend


def _implementation(name: str, dtypes: Sequence[torch.dtype] = (), thresholds: Sequence[torch.Tensor] = (),
                    flat: bool = True):
    """The backend module for a resolved name; the reference where the C kernels cannot take the call, or
    where a backend does not lay out rows that are not whole blocks yet (``ROWS``)."""
    reference = impl = registry.backend("torch")
    if name == "triton":
        impl = registry.backend("triton")
    elif name == "native" and all(d in KERNEL_DTYPES for d in dtypes) and all(map(_native().usable, thresholds)):
        impl = _native()
    return impl if flat or getattr(impl, "ROWS", False) else reference


def _native():
    return registry.backend("native")


def _local(t: torch.Tensor, what: str) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 parameters and gradients); a plain tensor as it is."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return t
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            return t.to_local()
    raise UsageError(f"{what} is a {type(t).__name__}; ckptq's kernels take torch.Tensor, Parameter or DTensor")


def _flat(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def quantize_blockwise(x: torch.Tensor, qmap: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE,
                       transform: str = "none", backend: str = "auto", bits: int = 8,
                       row_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (any float dtype and shape) blockwise on the codebook ``qmap``.

    Returns ``(codes, absmax)``: ``codes`` uint8 of shape ``[code_bytes(x.numel(), bits)]`` (8 bits: one
    code per byte; 6, 4, 2 bits: packed, see ``kernels/contract.py``) and ``absmax`` fp32 of shape
    ``[ceil(numel / block_size)]``, both on ``x.device``. ``qmap`` has 2**bits entries. With ``row_len`` the
    elements are laid out in rows of that length (blocks never cross a row, each row's codes start on a
    byte; ``kernels/contract.py``): codes ``[rows * code_bytes(row_len, bits)]``, absmax
    ``[rows * ceil(row_len / block_size)]``.
    ``transform="sqrt"`` stores sqrt(x) (x >= 0). NaN/Inf inputs follow the rounding contract (a NaN
    block's absmax is NaN; NaN codes are 2**bits - 1).
    """
    check_block_size(block_size)
    check_bits(bits)
    check_codebook(qmap, bits)
    sqrt = _check_transform(transform)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise UsageError(f"cannot quantize {getattr(x, 'dtype', type(x).__name__)}; pass a floating-point tensor")
    flat = _flat(_local(x, "the tensor to quantize"))
    n = flat.numel()
    row_len = check_row_len(n, row_len)
    name = resolve_backend(backend, flat.device)
    thresholds = midpoints(qmap.to(flat.device)).contiguous()
    impl = _implementation(name, (flat.dtype,), (thresholds,), is_flat(n, row_len, block_size))
    if impl is not registry.backend("torch") and flat.dtype not in KERNEL_DTYPES:
        flat = flat.to(torch.float32)  # the rounding the reference applies chunk by chunk
    codes = cpu_runtime.new_buffer(layout_bytes(n, row_len, bits), torch.uint8, flat.device)
    absmax = torch.empty(layout_blocks(n, row_len, block_size), dtype=torch.float32, device=flat.device)
    impl.quantize(flat, thresholds, block_size, sqrt, codes, absmax, bits, row_len)
    return codes, absmax


def _output(out: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """``out`` checked as a contiguous fp32 [n] tensor on ``device`` (flattened), or a new one."""
    if out is None:
        return cpu_runtime.new_buffer(n, torch.float32, device)
    if out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous() or out.device != device:
        raise UsageError(f"out must be a contiguous float32 tensor of {n} elements on {device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out.view(-1)


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor,
                         block_size: int = DEFAULT_BLOCK_SIZE, transform: str = "none", backend: str = "auto",
                         out: torch.Tensor | None = None, bits: int = 8, numel: int | None = None,
                         row_len: int | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: fp32 tensor of shape ``[numel]``.

    Value = ``qmap[code] * absmax[block]``, squared afterwards when ``transform == "sqrt"``. ``numel``: the
    number of codes (default: as many as the bytes hold, ``codes.numel() * 8 // bits``: pass it when the
    last byte is not full). ``row_len``: the row length the codes were laid out with (None: one row).
    With ``out`` (a contiguous fp32 tensor of ``numel`` elements on the codes' device) the result is written
    there: reusing a buffer saves the page faults of a fresh allocation.
    """
    if is_dtensor(codes) or is_dtensor(absmax):
        raise UsageError("codes and absmax are DTensors: pass their local shards (ckptq.codec.dtensor.unplace), "
                         "or the whole qstate to ckptq.codec.quant.dequantize_state")
    n = check_quantized(codes, absmax, qmap, block_size, bits, numel, row_len)
    sqrt = _check_transform(transform)
    flat = _flat(codes)
    name = resolve_backend(backend, flat.device)
    qmap = qmap.to(device=flat.device, dtype=torch.float32).contiguous()
    absmax = absmax.to(device=flat.device, dtype=torch.float32).reshape(-1).contiguous()
    fresh = out is None
    out = _output(out, n, flat.device)
    impl = _implementation(name, flat=is_flat(n, row_len, block_size))
    impl.dequantize(flat, absmax, qmap, block_size, sqrt, out, fresh, bits, row_len)
    return out


def _step_states(states: Sequence[StepInput], n: int, block_size: int, device, widths,
                 row_len: int | None = None, counts: tuple = (2, 3)) -> tuple[StepState, ...]:
    """Check each moment against the param (n elements on ``device``, rows of ``row_len``) and build the
    kernels' view (flat codes and scales)."""
    if len(states) not in counts:
        raise UsageError(f"the Adam step takes 2 or 3 moments (exp_avg, exp_avg_sq[, max_exp_avg_sq]), got {len(states)}")
    widths = (widths,) * len(states) if isinstance(widths, int) else tuple(widths)
    if len(widths) != len(states):
        raise UsageError(f"bits names {len(widths)} code widths for {len(states)} moments; give one per moment")
    out = []
    for i, (s, bits) in enumerate(zip(states, widths)):
        check_bits(bits)
        check_codebook(s.encode_qmap, bits)
        want = layout_bytes(n, row_len, bits)
        if not isinstance(s.codes, torch.Tensor) or s.codes.numel() != want or s.codes.device != device:
            raise UsageError(f"moment {i} holds {getattr(s.codes, 'numel', lambda: '?')()} code bytes on "
                             f"{getattr(s.codes, 'device', '?')} but the parameter has {n} elements on {device} "
                             f"({want} bytes at {bits} bits); its state does not belong to this parameter")
        check_quantized(s.codes, s.absmax, s.qmap, block_size, bits, n, row_len)
        if not s.codes.is_contiguous() or s.absmax.dtype != torch.float32 or not s.absmax.is_contiguous():
            raise UsageError(f"moment {i} must hold contiguous uint8 codes and contiguous float32 scales")
        qmap = s.qmap.to(device=device, dtype=torch.float32).contiguous()
        encode = s.encode_qmap.to(device=device, dtype=torch.float32).contiguous()
        out.append(StepState(s.codes.view(-1), s.absmax.view(-1), qmap, memo.by_tensor(midpoints, encode), encode,
                             bits))
    return tuple(out)


def step_seed(step: int, salt: int) -> int:
    """The stochastic rounding seed of one parameter's step: its step count and ``salt`` (its index in the
    optimizer) hashed, so every step and every parameter draws other numbers, the same ones on resume."""
    return contract.mix32(contract.mix32(int(step) & 0xFFFFFFFF) ^ ((int(salt) * 0x9E3779B9) & 0xFFFFFFFF))


def _step_operands(param, grad, block_size: int, seed) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's block size and seed checked, and its param and gradient as local tensors that fit each other."""
    check_block_size(block_size)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32):
        raise UsageError(f"seed must be None or an integer in [0, 2**32), got {seed!r}")
    p, g = _local(param, "the parameter"), _local(grad, "the gradient")
    if not p.is_floating_point() or not g.is_floating_point() or g.numel() != p.numel() or g.device != p.device:
        raise UsageError(f"the gradient ({g.dtype}, {g.numel()} elements on {g.device}) does not fit the parameter "
                         f"({p.dtype}, {p.numel()} elements on {p.device})")
    return p, g


def adam8bit_step(param: torch.Tensor, grad: torch.Tensor, states: Sequence[StepInput], hyper: torch.Tensor, *,
                  block_size: int, ratio: bool, maximize: bool = False, backend: str = "auto",
                  bits: int | Sequence[int] = 8, seed: int | None = None, row_len: int | None = None) -> None:
    """One fused low-bit Adam(W) step on one parameter, in place: the param and each moment's codes/absmax,
    laid out in rows of ``row_len`` (None: one row; ``kernels/contract.py``).
    ``bits``: the code width of every moment, or one per moment (8, 6, 4 or 2; codebooks of 2**bits entries). ``seed`` (an integer
    in [0, 2**32)): exp_avg's and exp_avg_sq's new codes are rounded stochastically, unbiased, with random
    numbers hashed from the seed and each element's index (``ckptq.kernels.contract``); None rounds to nearest.

    ``states``: exp_avg, exp_avg_sq and optionally max_exp_avg_sq (both stored as sqrt(v)); exp_avg's codes
    are ratios m / (sqrt(v) + decode_eps) when ``ratio``, plain values otherwise, and are always written
    back as ratios with encode_eps. ``hyper``: fp32 [10] (``ckptq.kernels.contract.HYPER_FIELDS``).
    """
    p, g = _step_operands(param, grad, block_size, seed)
    if hyper.numel() != len(contract.HYPER_FIELDS):
        raise UsageError(f"hyper must hold {len(contract.HYPER_FIELDS)} values ({', '.join(contract.HYPER_FIELDS)})")
    row_len = check_row_len(p.numel(), row_len)
    kernel_states = _step_states(states, p.numel(), block_size, p.device, bits, row_len)
    name = resolve_backend(backend, p.device)
    impl = _implementation(name, (p.dtype, g.dtype), [s.thresholds for s in kernel_states],
                           is_flat(p.numel(), row_len, block_size))
    data = p.detach()
    flat = data.reshape(-1) if data.is_contiguous() else data.contiguous().view(-1)  # a copy only if strided
    h = hyper.to(device="cpu", dtype=torch.float32).contiguous()  # scalars: the kernels take them from the host
    impl.adam_step(flat, _flat(g), kernel_states, h, StepFlags(block_size, bool(ratio), bool(maximize), seed, row_len))
    if not data.is_contiguous():
        data.copy_(flat.view(data.shape))


def adam_dense_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, hyper: torch.Tensor, *,
                    maximize: bool = False) -> None:
    """The same Adam(W) update for a parameter whose moments are plain fp32 tensors (in place; PyTorch,
    on the param's device). ``hyper``: the first 8 of ``HYPER_FIELDS``."""
    p, g = _local(param, "the parameter"), _local(grad, "the gradient")
    states = [None if t is None else _local(t, "a moment") for t in (exp_avg, exp_avg_sq, max_exp_avg_sq)]
    registry.backend("torch").adam_dense_step(p.detach(), g, *states, hyper, maximize)


def momentum_step(param: torch.Tensor, grad: torch.Tensor, state: StepInput, hyper: torch.Tensor, *,
                  block_size: int, bits: int = 8, update: int = contract.UPDATE_LINEAR, maximize: bool = False,
                  out: torch.Tensor | None = None, seed: int | None = None, row_len: int | None = None,
                  backend: str = "auto") -> None:
    """One low-bit step of a one-state optimizer (SGD's, Muon's momentum; Lion's exp_avg) on one parameter, in
    place: the state's codes and scales, and the param (``update`` UPDATE_LINEAR / UPDATE_SIGN) or ``out``
    (fp32, the param's element count: the direction d, for UPDATE_NONE). ``hyper``: fp32 [8]
    (``kernels/contract.py``, ``MOMENTUM_FIELDS``); ``seed`` as ``adam8bit_step``'s."""
    p, g = _step_operands(param, grad, block_size, seed)
    if hyper.numel() != len(contract.MOMENTUM_FIELDS):
        raise UsageError(f"hyper must hold {len(contract.MOMENTUM_FIELDS)} values "
                         f"({', '.join(contract.MOMENTUM_FIELDS)})")
    if update not in (contract.UPDATE_NONE, contract.UPDATE_LINEAR, contract.UPDATE_SIGN):
        raise UsageError(f"update must be UPDATE_NONE, UPDATE_LINEAR or UPDATE_SIGN, got {update!r}")
    if (out is None) != (update != contract.UPDATE_NONE) or (out is not None and (
            out.dtype != torch.float32 or out.numel() != p.numel() or not out.is_contiguous() or out.device != p.device)):
        raise UsageError("UPDATE_NONE writes the direction into out: a contiguous fp32 tensor of the parameter's "
                         "size on its device (and only UPDATE_NONE takes one)")
    row_len = check_row_len(p.numel(), row_len)
    (kernel_state,) = _step_states([state], p.numel(), block_size, p.device, bits, row_len, counts=(1,))
    impl = momentum_backend(resolve_backend(backend, p.device), (p.dtype, g.dtype), kernel_state.thresholds,
                            is_flat(p.numel(), row_len, block_size))
    data = p.detach()
    flat = data.reshape(-1) if data.is_contiguous() else data.contiguous().view(-1)
    h = hyper.to(device="cpu", dtype=torch.float32).contiguous()
    impl.momentum_step(flat, _flat(g), kernel_state, h, None if out is None else out.view(-1),
                       contract.MomentumFlags(block_size, bool(maximize), update, seed, row_len))
    if not data.is_contiguous():
        data.copy_(flat.view(data.shape))


def momentum_backend(name: str, dtypes: Sequence[torch.dtype], thresholds: torch.Tensor, flat: bool):
    """The backend module of a one-state step: as ``_implementation`` picks, the reference where that backend
    has no one-state kernel."""
    impl = _implementation(name, dtypes, [thresholds], flat)
    return impl if hasattr(impl, "momentum_step") else registry.backend("momentum_torch")
