"""Quantized optimizer states: the ``QState`` type, its dict form, and which codebook each role gets.

In checkpoints and in optimizer state a quantized state is a ``dict`` (so that ``torch.load(weights_only=True)`` accepts it, and so that it
sits under PyTorch's own state key, e.g. ``state[0]["exp_avg"]``)::

    {"ckptq": "blockwise",      # marks the dict; the codec name
     "bits": 8,                 # the code width: 8, 6, 4 or 2
     "codes": uint8 [numel],    # one code per element, flat, C order (narrower: packed, [ceil(numel * bits / 8)])
     "absmax": float32 [ceil(numel / block_size)],
     "qmap": float32 [256],     # the codebook, sorted ascending ([2**bits])
     "block_size": 256,
     "transform": "none" | "sqrt" | "ratio",
     "shape": (d0, d1, ...),    # the original tensor's shape
     "dtype": "float32"}        # the original tensor's dtype

plus, for ``transform == "ratio"``: ``"eps": float`` and ``"divisor": "exp_avg_sq"`` (a sibling key).
In code it is a ``QState``; ``QState.from_dict`` validates a dict and ``to_dict`` writes one.

Which codebook and transform a state gets is decided by its role (the state key), see ``POLICIES``.

The ratio transform (first moments). What training needs from the two moments is the update
u = m_hat / (sqrt(v_hat) + eps). Quantizing m and v independently, m's error is divided by sqrt(v):
a small sqrt(v) in a block whose m absmax is large turns a small m error into a large u error. So m is
stored as r = m / (sqrt(v) + eps') (exact v), and decoded as m_q = r_q * (s_q + eps'), where s_q is
the *decoded* sqrt-domain value of the sibling second moment (``divisor``). With eps' = eps *
sqrt(1 - beta2^step), the update computed from the decoded states is m_q / (s_q + eps') ~ r_q: v's
quantization error cancels out of the update, which only carries r's own 8-bit error. Measured on a 400-step
checkpoint (tools/fidelity.py): worst tensor update error 1.04% instead of 1.82% with independent
power maps, bitsandbytes 6.7%. r is bounded (|m_hat| / sqrt(v_hat) <= ~1 for Adam), so a mild power map
suits it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from . import codebooks, ops
from ..errors import FormatError, UsageError

CODEC = "blockwise"
SUPPORTED_BITS = ops.SUPPORTED_BITS


# Codebooks by name; files record the values, so a name only decides what new files get.
CODEBOOKS = {
    "dynamic-signed": functools.partial(codebooks.dynamic_map, True),
    "dynamic-unsigned": functools.partial(codebooks.dynamic_map, False),
    "power-signed-2.5": functools.partial(codebooks.power_map, True, 2.5),
    "power-unsigned-3": functools.partial(codebooks.power_map, False, 3.0),
    "power-signed-1.5": functools.partial(codebooks.power_map, True, 1.5),
    "4bit-power-signed-1.5": functools.partial(codebooks.power_map, True, 1.5, 4),
    "4bit-geometric-1.3": functools.partial(codebooks.geometric_map, 4, 1.3),
    "4bit-lloyd-gaussian": codebooks.lloyd_gaussian_map,
    "6bit-lloyd-gaussian": codebooks.lloyd_gaussian_map_6bit,
    "2bit-geometric-3": functools.partial(codebooks.geometric_map, 2, 3.0),
}
RATIO_TRANSFORM = "ratio"
TRANSFORMS = ops.TRANSFORMS + (RATIO_TRANSFORM,)
_REQUIRED = ("bits", "codes", "absmax", "qmap", "block_size", "transform", "shape", "dtype")


@dataclass
class QState:
    """One quantized tensor: what the dict form above holds, as a type. ``to_dict``/``from_dict`` convert."""

    codes: torch.Tensor  # uint8 [code_bytes(numel, bits)], flat
    absmax: torch.Tensor  # fp32 [ceil(numel / block_size)]
    qmap: torch.Tensor  # fp32 [2**bits] codebook, ascending
    block_size: int
    transform: str  # one of TRANSFORMS
    shape: tuple
    dtype: str  # the original tensor's dtype name, e.g. "float32"
    bits: int = 8
    eps: float | None = None  # ratio states: eps' of the transform
    divisor: str | None = None  # ratio states: the sibling state key of the second moment

    def __post_init__(self):
        if self.is_ratio and (not isinstance(self.eps, (int, float)) or not isinstance(self.divisor, str)):
            raise FormatError(f"ratio state has eps {self.eps!r} and divisor {self.divisor!r}; it is corrupt")

    @property
    def is_ratio(self) -> bool:
        return self.transform == RATIO_TRANSFORM

    def to_dict(self) -> dict:
        d = {"ckptq": CODEC, "bits": self.bits, "codes": self.codes, "absmax": self.absmax, "qmap": self.qmap,
             "block_size": self.block_size, "transform": self.transform, "shape": tuple(self.shape), "dtype": self.dtype}
        if self.is_ratio:
            d |= {"eps": float(self.eps), "divisor": self.divisor}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QState":
        """FormatError if ``d`` is not a quantized state this version can decode."""
        check_qstate(d)
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise FormatError(f"quantized state lacks {', '.join(missing)}; it is corrupt or incomplete")
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def replace(self, **changes) -> "QState":
        return dataclasses.replace(self, **changes)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.absmax.numel()


@dataclass(frozen=True)
class Policy:
    codebook: str  # a key of CODEBOOKS
    transform: str  # one of TRANSFORMS

    def qmap(self) -> torch.Tensor:
        return CODEBOOKS[self.codebook]()


# Chosen by the Adam *update* error u = m_hat / (sqrt(v_hat) + eps) (tools/fidelity.py, figures in
# README): an element's share of ||u|| does not shrink with its magnitude, so small entries of a
# block need relative precision, and large ones most of the codes.
# Second moments are stored as sqrt(v) on an unsigned power map (sqrt(v)/absmax = (k/255)**3): a
# block whose v spans 2k decades needs only k decades of codebook, small entries keep their precision
# and only values below ~1e-15 of the block's absmax v collapse to 0 (the zero-point problem of Li et
# al., NeurIPS 2023). First moments and other states use a signed power map ((k/127)**2.5).
POLICIES = {
    "exp_avg": Policy("power-signed-2.5", "none"),
    "exp_avg_sq": Policy("power-unsigned-3", "sqrt"),
    "max_exp_avg_sq": Policy("power-unsigned-3", "sqrt"),
}
DEFAULT_POLICY = Policy("power-signed-2.5", "none")
# exp_avg when its sibling exp_avg_sq is quantized too: stored relative to it (see the module docstring)
RATIO_POLICY = Policy("power-signed-1.5", RATIO_TRANSFORM)
RATIO_PAIRS = {"exp_avg": "exp_avg_sq"}  # state key -> the divisor's state key

# 4-bit states (16-entry codebooks, AdamW4bit's), chosen the same way; figures in README. The update
# error is the ratio's own rounding error, so the ratio gets the codebook of least squared error for
# block-normalized Gaussian values (codebooks.LLOYD_GAUSSIAN_128). Second moments keep the sqrt transform
# on 1.3**(k - 15): the step rounds them stochastically, and on (k/15)**3 (gaps of 8x near 0, a level at
# 0) that put small elements' sqrt(v) a factor of several off; equal 30% gaps and no zero kept resumed
# training within 0.1% of fp32 on three seeds, where (k/15)**3 reached 0.102% (tools/resume_fidelity.py).
POLICIES_4BIT = {
    "exp_avg": Policy("4bit-power-signed-1.5", "none"),
    "exp_avg_sq": Policy("4bit-geometric-1.3", "sqrt"),
    "max_exp_avg_sq": Policy("4bit-geometric-1.3", "sqrt"),
}
# 2-bit states: only second moments that divide a 6-bit ratio in a converted file get them (``convert_width``).
POLICY_2BIT = Policy("2bit-geometric-3", "sqrt")
# By code width: (policies by state key, the policy of other keys); 6 bits holds ratios only.
PLAIN_POLICIES = {8: (POLICIES, DEFAULT_POLICY), 4: (POLICIES_4BIT, Policy("4bit-power-signed-1.5", "none")),
                  2: ({}, POLICY_2BIT)}
RATIO_POLICIES = {8: RATIO_POLICY, 6: Policy("6bit-lloyd-gaussian", RATIO_TRANSFORM),
                  4: Policy("4bit-lloyd-gaussian", RATIO_TRANSFORM)}


def policy_for(key: str, bits: int = 8) -> Policy:
    """The policy of a state stored on its own (not as a ratio) with codes of ``bits`` bits."""
    if bits not in PLAIN_POLICIES:
        raise UsageError(f"{bits}-bit codes hold ratio states only; store {key!r} with 8, 4 or 2 bits")
    table, default = PLAIN_POLICIES[bits]
    return table.get(key, default)


def ratio_policy(bits: int = 8) -> Policy:
    if bits not in RATIO_POLICIES:
        raise UsageError(f"ratio states take 8, 6 or 4 bits, not {bits}")
    return RATIO_POLICIES[bits]


def convert_width(bits: int, key: str, ratio: bool = False, divisor: bool = False) -> int:
    """The code width ``ckptq convert`` gives a state under a budget of ``bits`` per value (``ops.BUDGETS``):
    8 bits, every state 8. 4 bits: a first moment stored as a ratio (``ratio``) 6 and the second moment it
    divides (``divisor``) 2, which keeps 8 bits per parameter for the pair; any other state 4.

    Why 6 + 2 in a file: the update error a checkpoint carries is the ratio's own rounding error (v's
    cancels out), and at 4 bits per value no code brings it below 6.25% (a Gaussian's rate-distortion
    bound); 6 bits reach 2.3-2.6% where 4 gave 9-10% (bitsandbytes 8-bit: 3.0-6.7%; tools/fidelity.py).

    Why not in training: the 4-bit optimizer requantizes its state at every step, and sqrt(v) on 4 levels
    cannot follow v (README): rounded to nearest, each element's level freezes where the first steps put
    it (from scratch: mean loss +4.4% over the last 100 of 400 steps), rounded stochastically it resumed
    at +0.15% of fp32's loss, where 4 + 4 stays within 0.07%. So ``AdamW4bit`` keeps 4 + 4 and
    requantizes a 6 + 2 file on load (``ckptq.optim_io``)."""
    if ops.check_budget(bits) == 8:
        return 8
    if ratio:
        return 6
    return 2 if divisor and key in RATIO_PAIRS.values() else 4


def budget_of(widths) -> int | None:
    """The budget (``ops.BUDGETS``) that states of these code widths were written under: 8 when all are 8,
    4 when none is; None for none or a mix."""
    widths = set(widths)
    if widths == {8}:
        return 8
    return 4 if widths and 8 not in widths else None


def is_qstate(obj) -> bool:
    return isinstance(obj, dict) and obj.get("ckptq") == CODEC and "codes" in obj


def quantize_state(t: torch.Tensor, key: str, block_size: int = ops.DEFAULT_BLOCK_SIZE, backend: str = "auto",
                   bits: int = 8) -> dict:
    """Quantize one optimizer state tensor under the policy for its state key (dict form), with codes of
    ``bits`` bits (8, 4 or 2: ``convert_width`` says which a state of a converted file gets)."""
    pol = policy_for(key, ops.check_bits(bits))
    qmap = pol.qmap().to(t.device)
    codes, absmax = ops.quantize_blockwise(t, qmap, block_size, pol.transform, backend, bits)
    return QState(codes, absmax, qmap, block_size, pol.transform, tuple(t.shape), _dtype_name(t.dtype), bits).to_dict()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# eps' never below this: with eps = 0, an element whose v is 0 (its m is 0 too) would give r = 0/0 = NaN
# and spoil its whole block's scale; a tiny positive eps' gives r = 0 and changes nothing else.
MIN_RATIO_EPS = 1e-30


def ratio_eps(eps: float, beta2: float, step: float) -> float:
    """eps' that makes v's quantization error cancel out of the update at ``step`` (see above)."""
    value = float(eps) * (1.0 - float(beta2) ** float(step)) ** 0.5 if step > 0 else float(eps)
    return max(value, MIN_RATIO_EPS)


def ratio_eps_for(group: dict, step) -> float:
    """eps' for a param from its optimizer param_group (torch's eps/betas defaults) and its step."""
    step = float(step.item() if isinstance(step, torch.Tensor) else (step or 0))
    return ratio_eps(group.get("eps", 1e-8), tuple(group.get("betas", (0.9, 0.999)))[1], step)


_RATIO_CHUNK = 1 << 22  # elements per chunk (a multiple of every block size): bounded temporaries


def _divisor_values(v: QState, start: int, stop: int) -> torch.Tensor:
    """s_q for elements [start, stop): the divisor's decoded sqrt-domain value (not squared), fp32."""
    if v.transform != "sqrt":
        raise FormatError(f"a ratio state's divisor must use the sqrt transform, not {v.transform!r}")
    B = v.block_size
    a = v.absmax[start // B : ops.num_blocks(stop, B)]
    first = start - (start // B) * B  # start - first is a block boundary: an even element, a whole byte
    codes = v.codes.reshape(-1)[ops.code_bytes(start - first, v.bits) : ops.code_bytes(stop, v.bits)]
    s = ops.dequantize_blockwise(codes, a, v.qmap, B, "none", bits=v.bits, numel=stop - start + first)
    return s[first:]


def quantize_ratio(m: torch.Tensor, v: torch.Tensor, eps: float, block_size: int = ops.DEFAULT_BLOCK_SIZE,
                   backend: str = "auto", divisor_key: str = "exp_avg_sq", bits: int = 8) -> dict:
    """Quantize a first moment ``m`` as r = m / (sqrt(v) + eps), ``v`` its exact second moment (dict form),
    with codes of ``bits`` bits (8, 6 or 4)."""
    if m.numel() != v.numel():
        raise FormatError(f"ratio state has {m.numel()} elements but its divisor {v.numel()}")
    vflat = v.detach().reshape(-1)
    qmap = ratio_policy(ops.check_bits(bits)).qmap().to(m.device)
    flat = m.detach().reshape(-1)
    codes = torch.empty(ops.code_bytes(flat.numel(), bits), dtype=torch.uint8, device=m.device)
    absmax = torch.empty(ops.num_blocks(flat.numel(), block_size), dtype=torch.float32, device=m.device)
    buf = torch.empty(min(_RATIO_CHUNK, flat.numel()), dtype=torch.float32, device=m.device)
    for start in range(0, flat.numel(), _RATIO_CHUNK):
        stop = min(start + _RATIO_CHUNK, flat.numel())
        r = ops.ieee_sqrt_into(vflat[start:stop], buf[: stop - start]).add_(eps)  # sqrt(v) + eps, in place
        torch.div(flat[start:stop], r, out=r)  # r = m / (sqrt(v) + eps): IEEE division, m promoted to fp32
        c, a = ops.quantize_blockwise(r, qmap, block_size, "none", backend, bits)
        first = ops.code_bytes(start, bits)  # start is a multiple of _RATIO_CHUNK: a whole byte
        codes[first : first + c.numel()], absmax[start // block_size : start // block_size + a.numel()] = c, a
    return QState(codes, absmax, qmap, block_size, RATIO_TRANSFORM, tuple(m.shape), _dtype_name(m.dtype), bits,
                  eps=float(eps), divisor=divisor_key).to_dict()


def check_qstate(q: dict) -> None:
    """Raise FormatError if ``q`` uses a codec, bit width or transform this version cannot decode."""
    if q.get("ckptq") != CODEC or q.get("bits") not in SUPPORTED_BITS:
        raise FormatError(
            f"quantized state uses codec {q.get('ckptq')!r} with {q.get('bits')} bits, which this ckptq "
            f"cannot decode (it reads {CODEC!r} with {SUPPORTED_BITS} bits); upgrade ckptq"
        )
    if q.get("transform") not in TRANSFORMS:
        raise FormatError(f"quantized state uses transform {q.get('transform')!r}; upgrade ckptq")


def _decode(q: QState, backend: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The stored values, flat fp32 (sqrt transform undone; a ratio state's raw ratios)."""
    try:
        return ops.dequantize_blockwise(q.codes, q.absmax, q.qmap, q.block_size,
                                        "none" if q.is_ratio else q.transform, backend, out, q.bits, q.numel)
    except UsageError as exc:
        raise FormatError(f"quantized state is malformed: {exc}") from None


def _to_dense(flat: torch.Tensor, q: QState) -> torch.Tensor:
    dtype = getattr(torch, q.dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise FormatError(f"quantized state names dtype {q.dtype!r}, not a floating-point dtype; it is corrupt")
    return flat.view(tuple(q.shape)).to(dtype)


def dequantize_state(q: dict, backend: str = "auto", divisor: dict | None = None) -> torch.Tensor:
    """Back to a dense tensor of the original shape and dtype. A ratio state needs its ``divisor``
    (the sibling qstate named by ``q["divisor"]``); :func:`dequantize_states` finds it for you."""
    qs = QState.from_dict(q)
    r = _decode(qs, backend)
    if not qs.is_ratio:
        return _to_dense(r, qs)
    if divisor is None or not is_qstate(divisor):
        raise FormatError(f"a ratio state needs its divisor {qs.divisor!r} to decode; pass the param's whole state")
    v = QState.from_dict(divisor)
    if v.numel != r.numel():
        raise FormatError(f"ratio state has {r.numel()} elements but its divisor {v.numel}")
    for start in range(0, r.numel(), _RATIO_CHUNK):
        stop = min(start + _RATIO_CHUNK, r.numel())
        r[start:stop].mul_(_divisor_values(v, start, stop).add_(qs.eps))  # m = r * (s_q + eps')
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


def state_nbytes(q: dict) -> int:
    return QState.from_dict(q).nbytes
