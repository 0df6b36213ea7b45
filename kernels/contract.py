"""What every backend implementation of an operation takes, and the little they share.

``ckptq.ops`` declares the operations (blockwise quantize, dequantize, the fused 8-bit Adam step),
validates their inputs and picks the backend once; the backend modules beside this one
(``backend_torch``: the PyTorch reference, ``backend_native``: the C CPU kernels, ``backend_triton``:
the Triton CUDA kernels) then receive flat, contiguous, already-checked tensors and plain flags, with
identical signatures::

    quantize(src, thresholds, block_size, sqrt, codes, absmax, bits) -> None
        src         [n] float (float32/bfloat16/float16; the PyTorch backend takes any float dtype)
        thresholds  fp32 [2**bits - 1] ascending: midpoints of the codebook (see ``midpoints``)
        codes       uint8 [code_bytes(n, bits)] out;  absmax  fp32 [num_blocks(n, block_size)] out
    dequantize(codes, absmax, qmap, block_size, sqrt, out, fresh, bits) -> None
        qmap        fp32 [2**bits] codebook;  out  fp32 [n] out (``fresh``: newly allocated memory)
    adam_step(p, g, states, h, flags) -> None
        p [n] param (updated in place), g [n] grad, states: 2 or 3 ``StepState`` (exp_avg, exp_avg_sq,
        max_exp_avg_sq), each with its own code width, h fp32 [10] (``HYPER_FIELDS``), flags: ``StepFlags``

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


MIX32 = (0x7FEB352D, 0x846CA68B)  # the multipliers of mix32


def _mul_mod32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32), in 16-bit halves of c: no product leaves int64 when x is a
    tensor."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def mix32(x):
    """An integer hash of 32-bit x with full avalanche (C. Wellons' "lowbias32", 2018): three xor-shifts
    and two multiplications mod 2**32. x: a Python int or an int64 tensor (elementwise), in [0, 2**32).
    The kernels' random numbers (the PyTorch reference computes them with this); also seeds the step
    (``ckptq.ops.step_seed``)."""
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


def group_shape(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte group of ``bits``-bit codes: (1, 1), (4, 3), (2, 1), (4, 1)."""
    return {8: (1, 1), 6: (4, 3), 4: (2, 1), 2: (4, 1)}[bits]


def midpoints(qmap: torch.Tensor) -> torch.Tensor:
    """Decision thresholds between neighbouring codebook entries: fp32 [len(qmap) - 1]."""
    q = qmap.to(torch.float32)
    return (q[:-1] + q[1:]) / 2.0
