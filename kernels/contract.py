"""What every backend implementation of an operation takes, and the little they share.

``ckptq.codec.ops`` declares the operations (blockwise quantize, dequantize, the fused 8-bit Adam step),
validates their inputs and picks the backend once; the backend modules beside this one
(``backend_torch``: the PyTorch reference, ``backend_native``: the C CPU kernels, ``backend_triton``:
the Triton CUDA kernels) then receive flat, contiguous, already-checked tensors and plain flags, with
identical signatures::

    quantize(src, thresholds, block_size, sqrt, codes, absmax, bits, row_len) -> None
        src         [n] float (float32/bfloat16/float16; the PyTorch backend takes any float dtype)
        thresholds  fp32 [2**bits - 1] ascending: midpoints of the codebook (see ``midpoints``)
        codes       uint8 [layout_bytes(n, row_len, bits)] out
        absmax      fp32 [layout_blocks(n, row_len, block_size)] out
    dequantize(codes, absmax, qmap, block_size, sqrt, out, fresh, bits, row_len) -> None
        qmap        fp32 [2**bits] codebook;  out  fp32 [n] out (``fresh``: newly allocated memory)
    adam_step(p, g, states, h, flags) -> None
        p [n] param (updated in place), g [n] grad, states: 2 or 3 ``StepState`` (exp_avg, exp_avg_sq,
        max_exp_avg_sq), each with its own code width, h fp32 [10] (``HYPER_FIELDS``), flags: ``StepFlags``
    adam_step_group(group) -> None
        ``StepGroup``: many parameters in one call; the same result, bit for bit, as ``adam_step`` on each
        member in turn with its own row of ``group.hyper`` and its own seed
    adam_dense_group(group) -> None
        ``DenseGroup``: the Adam(W) step of parameters whose moments are plain fp32 tensors, many in one
        call; the same result as ``backend_torch.adam_dense_step`` on each
    momentum_step(p, g, state, h, out, flags) -> None
        the step of a one-state optimizer (SGD, Lion, Muon): p [n], g [n], one ``StepState``, h fp32 [8]
        (``MOMENTUM_FIELDS``), out fp32 [n] or None (d, for ``UPDATE_NONE``), flags: ``MomentumFlags``
    momentum_step_group(group) -> None
        ``MomentumGroup``: the same, many parameters in one call (``momentum_steps`` says what it equals; the reference: ``momentum_torch``)

Rows (``row_len``, format version 3): the n elements are ``rows = n // row_len`` rows of ``row_len``
elements (a parameter of shape [d0, d1, ...] has rows = d0 and row_len = d1 * d2 * ...; 1-D tensors, and
every state of format versions 1 and 2, are one row: ``row_len = n``, the "flat" layout). Blocks never
cross a row: row r holds ``blocks_per_row = ceil(row_len / block_size)`` blocks, block j covering the
row's elements [j * block_size, min((j + 1) * block_size, row_len)); the last block of a row may be
short, and its scale covers the elements it has. Each row's codes start on a byte: row r occupies code
bytes [r * row_bytes, (r + 1) * row_bytes) with ``row_bytes = code_bytes(row_len, bits)``, laid out as
below, the bits past its last code 0. absmax holds ``rows * blocks_per_row`` scales, row-major. So rows
shard with dim 0 of their parameter (FSDP2), and when row_len is a multiple of the block size the layout
is exactly the flat layout of the same n elements (every backend may take that path).

Code layout (``bits``, the code width: 8, 6, 4 or 2): the codes form one little-endian bit stream,
element i in bits [i * bits, (i + 1) * bits) of it, byte k holding stream bits 8k .. 8k + 7 (lowest
first); bits past the last code are 0. So 8 bits: one code per byte; 4 bits: element 2i in the low nibble
of byte i, 2i + 1 in its high nibble; 2 bits: four codes per byte; 6 bits: four codes per 3 bytes (a
24-bit little-endian word c0 | c1 << 6 | c2 << 12 | c3 << 18). Block sizes are multiples of 4, so every
block starts on a byte. Rounding: code = #{j : t[j] < y} (``lut``); a NaN y gets the top code,
2**bits - 1. In one step the moments may have different widths (``StepState.bits``).

Stochastic rounding (the step's new codes of the first and second moment when ``StepFlags.seed`` is
set; states under 8 bits use it; max_exp_avg_sq always rounds to nearest): with q the encode codebook, c
the code above and K = 2**bits, lo = clamp(c - (y < q[c]), 0, K - 1); code = K - 1 if lo == K - 1, else
lo + (u * (q[lo + 1] - q[lo]) < y - q[lo]) in fp32 (each product and difference rounded once: no
division, no FMA). One hash per element serves both moments: h = mix32(i mod 2**32 XOR seed), i the
element's index in the parameter; u = (h >> 16) * 2**-16 for the first moment and (h & 0xFFFF) * 2**-16
for the second (16 bits of probability each). A y on a codebook entry keeps its code, a NaN gets the top
one; E[q[code]] = y otherwise (up to fp32 rounding). ``mix32`` is the integer hash below (every backend
computes it on uint32 lanes).

Nothing in this package imports from ``ckptq`` above it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Parameter/gradient/input dtypes the C and Triton kernels read natively, with the C kernels' enum value
# (cpu_kernels.c: F32 = 0, BF16 = 1, F16 = 2). Other float dtypes are converted or go to the reference.
KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# The scalars of one Adam step, host-computed in float64 and rounded once to fp32 so that every backend
# sees the same values: fp32 [10] in this order. decay = 1 - lr*wd for AdamW (else 1), l2 = wd for Adam
# (else 0), neg_step_size = -lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t); decode_eps / encode_eps:
# eps' of the ratio transform the first moment's codes were written with / are written with now.
HYPER_FIELDS = ("decay", "l2", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "neg_step_size", "bc2_sqrt",
                "decode_eps", "encode_eps")


class StepState(NamedTuple):
    """One quantized moment as the step kernels see it (all flat, contiguous, on the param's device)."""

    codes: torch.Tensor  # uint8 [code_bytes(n, bits)], rewritten in place
    absmax: torch.Tensor  # fp32 [num_blocks(n, block_size)], rewritten in place
    qmap: torch.Tensor  # fp32 [2**bits]: the codebook the stored codes refer to
    thresholds: torch.Tensor  # fp32 [2**bits - 1]: midpoints of the codebook the new codes are written with
    encode: torch.Tensor  # fp32 [2**bits]: that codebook (stochastic rounding reads its entries)
    bits: int = 8  # code width of this state: 8, 6, 4 or 2


class StepFlags(NamedTuple):
    block_size: int  # one quantization block size for every state of the param
    ratio: bool  # exp_avg's stored codes are ratios m / (sqrt(v) + decode_eps); else plain values
    maximize: bool
    seed: int | None = None  # uint32: the moments' new codes round stochastically with it (else nearest)
    row_len: int | None = None  # elements per row of the layout (None: one row of all n elements)


class StepCodebooks(NamedTuple):
    """One moment's codebooks in a ``StepGroup``, shared by all its members (fp32, on their device)."""

    qmap: torch.Tensor  # [2**bits]: the codebook the stored codes refer to
    thresholds: torch.Tensor  # [2**bits - 1]: midpoints of ``encode``
    encode: torch.Tensor  # [2**bits]: the codebook the new codes are written with


class GroupMember(NamedTuple):
    """One parameter of a ``StepGroup``: its flat param and its moments' codes and scales (each laid out in
    rows of ``row_len``), all contiguous, on the group's device, rewritten in place."""

    p: torch.Tensor  # [n]
    codes: tuple  # 2 or 3 uint8 [layout_bytes(n, row_len, bits[k])]: exp_avg, exp_avg_sq[, max_exp_avg_sq]
    absmax: tuple  # as many fp32 [layout_blocks(n, row_len, block_size)]
    row_len: int | None  # None: the flat layout (one row of all n elements)


class StepGroup(NamedTuple):
    """Parameters stepped in one call: one device, one param dtype and one grad dtype, one code width and
    one set of codebooks per moment, one block size and one set of flags. Per member: its row of ``hyper``
    and its seed. ``cache`` is the caller's dict for this group (same members, same state tensors): a
    backend may keep what it derives from them there (pointer tables...); grads, hyper and seeds change
    from call to call."""

    members: tuple  # GroupMember
    grads: tuple  # [n] per member, the param's dtype or another KERNEL_DTYPE (one for the group)
    hyper: torch.Tensor  # fp32 [len(members), 10] (HYPER_FIELDS), on the host or on the group's device
    seeds: torch.Tensor | None  # int64 [len(members)] in [0, 2**32) (same place as hyper); None: nearest
    codebooks: tuple  # StepCodebooks per moment
    bits: tuple  # code width per moment
    block_size: int
    ratio: bool
    maximize: bool
    cache: dict


class DenseGroup(NamedTuple):
    """Parameters with plain fp32 moments stepped in one call (one device, dtypes, flags)."""

    params: tuple  # [n] each, updated in place
    grads: tuple
    moments: tuple  # per member (exp_avg, exp_avg_sq[, max_exp_avg_sq]): fp32 [n], updated in place
    hyper: torch.Tensor  # fp32 [len(params), 10]; only the first 8 fields are read
    maximize: bool
    cache: dict


# The scalars of one step of a one-state optimizer (SGD, Lion, Muon: ``momentum_step``), host-computed in
# float64 and rounded once to fp32: g' = (maximize ? -g : g) + l2 * p; the state m becomes
# m_new = m * keep + take * g'; the direction d = (m * c_old + m_new * c_new) + g' * c_grad (m the decoded
# old state); and, for the updates that apply it, p = p * decay + neg_lr * d (``UPDATE_LINEAR``) or
# p * decay + neg_lr * sign(d) (``UPDATE_SIGN``, sign(0) = 0, sign(NaN) = NaN). Each product and sum rounded
# once, in this order, no FMA. SGD: keep = momentum, take = 1 - dampening (0 and 1 at its first step:
# buf = g'), c_new = 1 (nesterov: c_new = momentum, c_grad = 1); Lion: keep = beta2, take = 1 - beta2,
# c_old = beta1, c_grad = 1 - beta1; Muon: keep = momentum, take = 1 - momentum, c_new = 1 (nesterov:
# c_new = momentum, c_grad = 1 - momentum), its update applied outside (Newton-Schulz needs the whole d).
MOMENTUM_FIELDS = ("l2", "keep", "take", "c_old", "c_new", "c_grad", "decay", "neg_lr")
UPDATE_NONE, UPDATE_LINEAR, UPDATE_SIGN = 0, 1, 2  # d written to ``out`` / applied / its sign applied


class MomentumFlags(NamedTuple):
    block_size: int
    maximize: bool
    update: int  # UPDATE_NONE, UPDATE_LINEAR or UPDATE_SIGN
    seed: int | None = None  # uint32: m_new's codes round stochastically with it (u: the hash's high half)
    row_len: int | None = None


class MomentumGroup(NamedTuple):
    """Parameters of a one-state optimizer stepped in one call (as ``StepGroup``, with one state per member:
    ``GroupMember.codes`` and ``.absmax`` hold one tensor each). ``outs``: per member an fp32 [n] that
    receives d (``UPDATE_NONE``), else ()."""

    members: tuple  # GroupMember
    grads: tuple
    outs: tuple
    hyper: torch.Tensor  # fp32 [len(members), 8] (MOMENTUM_FIELDS), on the host or on the group's device
    seeds: torch.Tensor | None  # int64 [len(members)] in [0, 2**32); None: nearest
    codebooks: StepCodebooks
    bits: int
    block_size: int
    maximize: bool
    update: int
    cache: dict


def momentum_steps(group: MomentumGroup):
    """A ``MomentumGroup`` as per-parameter ``momentum_step`` calls (p, g, state, hyper row, out, flags), in
    member order: a grouped step must equal these, bit for bit."""
    cb = group.codebooks
    for i, (m, g) in enumerate(zip(group.members, group.grads)):
        state = StepState(m.codes[0], m.absmax[0], cb.qmap, cb.thresholds, cb.encode, group.bits)
        seed = None if group.seeds is None else int(group.seeds[i])
        out = group.outs[i] if group.outs else None
        yield m.p, g, state, group.hyper[i], out, MomentumFlags(group.block_size, group.maximize, group.update, seed,
                                                                m.row_len)


def member_steps(group: StepGroup):
    """A ``StepGroup`` as the per-parameter calls it stands for, in member order: (p, grad, states, hyper
    row, flags) for ``adam_step`` of any backend; a grouped step must equal these calls, bit for bit."""
    for i, (m, g) in enumerate(zip(group.members, group.grads)):
        states = tuple(StepState(c, a, cb.qmap, cb.thresholds, cb.encode, bits)
                       for c, a, cb, bits in zip(m.codes, m.absmax, group.codebooks, group.bits))
        seed = None if group.seeds is None else int(group.seeds[i])
        yield m.p, g, states, group.hyper[i], StepFlags(group.block_size, group.ratio, group.maximize, seed, m.row_len)


# ---- The one step of every optimizer (``rules``): k low-bit states, a parameter, its gradient, a rule ----
#
# Per element: decode each state slot (qmap[code] * absmax of its block, then its transform: ``SQRT`` squares
# the stored value, ``RATIO`` multiplies it by (its divisor slot's stored value + decode_eps)), apply the
# rule (``rules.RULES[group.rule].math``), encode each slot's new value (``SQRT``: its IEEE square root;
# ``RATIO``: value / (the divisor's new stored value + encode_eps)), requantize per block: a new scale from
# the block's largest magnitude, codes to nearest or, for seeded slots of a group with seeds, stochastically.
# Slot j's uniform: the high half of h = mix32(i mod 2**32 XOR seed) for j = 0, the low half for j = 1, the
# high half of mix32(h) for j = 2 (the Adam step's two moments keep the draws they always had).
NONE, SQRT, RATIO = 0, 1, 2  # slot transforms (the C kernels' values)
TRANSFORM_NAMES = {"none": NONE, "sqrt": SQRT, "ratio": RATIO}


class Slot(NamedTuple):
    """One low-bit state of a ``Group``, as all its members store it (codebooks fp32, on their device)."""

    qmap: torch.Tensor  # [2**bits]: the codebook the stored codes refer to
    thresholds: torch.Tensor  # [2**bits - 1]: midpoints of ``encode``
    encode: torch.Tensor  # [2**bits]: the codebook the new codes are written with
    bits: int
    decode: int = NONE  # the stored codes' transform
    encode_as: int = NONE  # the new codes' transform (a plain first moment of an old file becomes a ratio)
    divisor: int = -1  # RATIO: the slot (a SQRT one) whose stored value it is relative to
    seeded: bool = True  # rounds stochastically when the group has seeds (Adam's max_exp_avg_sq: never)


class Group(NamedTuple):
    """Parameters stepped in one call by one rule: one device, param dtype, grad dtype, block size, set of
    slots (code widths, codebooks, transforms) and flag word. Per member: its row of ``hyper``, its seed, and
    (rules that write a direction) its ``out``. ``cache``: as ``StepGroup``'s."""

    rule: str  # a ``rules.RULES`` key
    flags: int  # ``rules.MAXIMIZE`` | the rule's switches
    members: tuple  # GroupMember, one codes/absmax pair per slot
    grads: tuple  # [n] per member
    outs: tuple  # fp32 [n] per member where the rule writes its direction (``rules.writes_direction``), else ()
    hyper: torch.Tensor  # fp32 [len(members), len(rule.fields)], on the host or on the group's device
    seeds: torch.Tensor | None  # int64 [len(members)] in [0, 2**32); None: every slot to nearest
    slots: tuple  # Slot
    block_size: int
    cache: dict


class Dense(NamedTuple):
    """Parameters whose states are plain fp32 tensors, stepped in one call by one rule (the same math, no
    codec): one device, param dtype, grad dtype, flag word."""

    rule: str
    flags: int
    params: tuple  # [n] each, updated in place (unless the rule writes a direction)
    grads: tuple
    states: tuple  # per member: fp32 [n] per state slot, updated in place
    outs: tuple
    hyper: torch.Tensor  # fp32 [len(params), len(rule.fields)]
    cache: dict


def slot_uniforms(h, slot: int):
    """Slot ``slot``'s stochastic rounding uniforms from the hashes h (int64 tensor in [0, 2**32)): fp32 in
    [0, 1), 16 bits of probability (see above)."""
    if slot == 2:
        h = mix32(h)
    half = (h >> 16) if slot != 1 else (h & 0xFFFF)
    return half.to(torch.float32) * 2.0**-16


MIX32 = (0x7FEB352D, 0x846CA68B)  # the multipliers of mix32


def _mul_mod32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32), in 16-bit halves of c: no product leaves int64 when x is a
    tensor."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def mix32(x):
    """An integer hash of 32-bit x with full avalanche (C. Wellons' "lowbias32", 2018): three xor-shifts
    and two multiplications mod 2**32. x: a Python int or an int64 tensor (elementwise), in [0, 2**32).
    The kernels' random numbers (the PyTorch reference computes them with this); also seeds the step
    (``ckptq.codec.ops.step_seed``)."""
    x = x ^ (x >> 16)
    x = _mul_mod32(x, MIX32[0])
    x = x ^ (x >> 15)
    x = _mul_mod32(x, MIX32[1])
    return x ^ (x >> 16)


def num_blocks(n: int, block_size: int) -> int:
    return (n + block_size - 1) // block_size


WIDTHS = (8, 6, 4, 2)  # the code widths of the layout above


def code_bytes(n: int, bits: int) -> int:
    """Bytes that hold n codes of ``bits`` bits (8: one per byte, 6: four per 3 bytes, 4: two per byte,
    2: four per byte)."""
    return (n * bits + 7) // 8


def layout_rows(n: int, row_len: int | None) -> tuple[int, int]:
    """(rows, row_len) of n elements laid out in rows of ``row_len`` (None: one row)."""
    if row_len is None or n == 0:
        return (1 if n else 0), n
    return n // row_len, row_len


def layout_bytes(n: int, row_len: int | None, bits: int) -> int:
    """Code bytes of n elements in rows of ``row_len``: each row starts on a byte."""
    rows, length = layout_rows(n, row_len)
    return rows * code_bytes(length, bits)


def layout_blocks(n: int, row_len: int | None, block_size: int) -> int:
    """Scales of n elements in rows of ``row_len``: blocks never cross a row."""
    rows, length = layout_rows(n, row_len)
    return rows * num_blocks(length, block_size)


def is_flat(n: int, row_len: int | None, block_size: int) -> bool:
    """Whether rows of ``row_len`` are laid out exactly as one row of n (no short block inside)."""
    rows, length = layout_rows(n, row_len)
    return rows <= 1 or length % block_size == 0


def group_shape(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte group of ``bits``-bit codes: (1, 1), (4, 3), (2, 1), (4, 1)."""
    return {8: (1, 1), 6: (4, 3), 4: (2, 1), 2: (4, 1)}[bits]


def midpoints(qmap: torch.Tensor) -> torch.Tensor:
    """Decision thresholds between neighbouring codebook entries: fp32 [len(qmap) - 1]."""
    q = qmap.to(torch.float32)
    return (q[:-1] + q[1:]) / 2.0


# The contract written out plainly: rounding to a codebook, and the bit-stream layout of codes, flat and in
# rows. The PyTorch backend builds on these, and the C and Triton kernels equal them.

def reference_codes(x: torch.Tensor, thresholds: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rounding contract written out plainly. x: fp32 [n] (transform already applied).
    Returns codes uint8 [n] and absmax fp32 [ceil(n / block_size)]."""
    n = x.numel()
    nb = num_blocks(n, block_size)
    blocks = torch.nn.functional.pad(x, (0, nb * block_size - n)).view(nb, block_size)  # zeros never win absmax
    absmax = blocks.abs().amax(dim=1)  # [nb]
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    y = blocks / safe[:, None]  # IEEE division, as the kernels do
    codes = torch.searchsorted(thresholds, y, right=False, out_int32=True)  # #{t < y}
    return codes.view(-1)[:n].to(torch.uint8), absmax


def pack_codes(codes: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """out uint8 [code_bytes(n, bits)] = codes uint8 [n] (each below 2**bits) packed as ``contract`` lays
    them out: each group of whole-byte codes (``group_shape``) as one little-endian word."""
    if bits == 8:
        out.copy_(codes)
        return
    g, w = group_shape(bits)
    c = torch.nn.functional.pad(codes, (0, -codes.numel() % g)).view(-1, g).to(torch.int32)
    word = c[:, 0].clone()
    for k in range(1, g):
        word |= c[:, k] << (bits * k)
    packed = torch.stack([(word >> (8 * j)) & 255 for j in range(w)], dim=1).view(-1)
    out.copy_(packed[: out.numel()])  # the bytes past code_bytes(n) hold only zero padding


def unpack_codes(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The n codes (uint8 [n]) that ``pack_codes`` packed into ``packed``."""
    if bits == 8:
        return packed[:n]
    g, w = group_shape(bits)
    b = torch.nn.functional.pad(packed, (0, -packed.numel() % w)).view(-1, w).to(torch.int32)
    word = b[:, 0].clone()
    for j in range(1, w):
        word |= b[:, j] << (8 * j)
    codes = torch.stack([(word >> (bits * k)) & (2**bits - 1) for k in range(g)], dim=1).view(-1)
    return codes[:n].to(torch.uint8)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes uint8 [rows, row_len] (each below 2**bits) -> uint8 [rows, code_bytes(row_len, bits)], each row
    packed on its own as ``backend_torch.pack_codes`` packs a flat stream (zero bits after its last code)."""
    rows, length = codes.shape
    if bits == 8:
        return codes.contiguous()
    g, w = group_shape(bits)
    padded = torch.nn.functional.pad(codes, (0, -length % g))  # whole groups per row: zero codes
    out = torch.empty(rows * padded.shape[1] * bits // 8, dtype=torch.uint8, device=codes.device)
    pack_codes(padded.reshape(-1), out, bits)
    return out.view(rows, -1)[:, : code_bytes(length, bits)]


def unpack_rows(packed: torch.Tensor, row_len: int, bits: int) -> torch.Tensor:
    """The inverse of ``pack_rows``: uint8 [rows, code_bytes(row_len, bits)] -> codes uint8 [rows, row_len]."""
    rows = packed.shape[0]
    if bits == 8:
        return packed
    g, w = group_shape(bits)
    padded_len = row_len + (-row_len % g)
    wide = torch.nn.functional.pad(packed, (0, padded_len * bits // 8 - packed.shape[1]))
    return unpack_codes(wide.reshape(-1), rows * padded_len, bits).view(rows, padded_len)[:, :row_len]
