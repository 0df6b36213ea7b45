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
     "dtype": "float32",        # the original tensor's dtype
     "layout": "rows"}          # blocks along rows (format 3); absent: "flat" (formats 1 and 2)

In the row layout (``kernels/contract.py``, "Rows") a tensor of shape [d0, d1, ...] is d0 rows of
d1 * d2 * ... elements (a 1-D tensor is one row): codes are uint8 [d0, code_bytes(row, bits)], absmax fp32
[d0, ceil(row / block_size)], and blocks never cross a row, so the state shards with dim 0 of its
parameter (FSDP2) and reshards to any world size bit for bit. The flat layout of older files is one row
of all elements: codes [code_bytes(numel, bits)], absmax [ceil(numel / block_size)].

plus, for ``transform == "ratio"``: ``"eps": float`` and ``"divisor": "exp_avg_sq"`` (a sibling key). In the
state of a capturable optimizer ``eps`` is a 0-dim float64 tensor on the device (its ``state_dict()``
exports the float).
In code it is a ``QState``; ``QState.from_dict`` validates a dict and ``to_dict`` writes one.

Which codebook and transform a state gets is decided by its role (the state key): ``ckptq.codec.policy``.
Quantizing and decoding states: ``ckptq.codec.quant``.

The ratio transform (first moments). What training needs from the two moments is the update
u = m_hat / (sqrt(v_hat) + eps). Quantizing m and v independently, m's error is divided by sqrt(v):
a small sqrt(v) in a block whose m absmax is large turns a small m error into a large u error. So m is
stored as r = m / (sqrt(v) + eps') (exact v), and decoded as m_q = r_q * (s_q + eps'), where s_q is
the *decoded* sqrt-domain value of the sibling second moment (``divisor``). With eps' = eps *
sqrt(1 - beta2^step), the update computed from the decoded states is m_q / (s_q + eps') ~ r_q: v's
quantization error cancels out of the update, which only carries r's own 8-bit error. Measured on a 400-step
checkpoint (tools/bench/fidelity.py): worst tensor update error 1.04% instead of 1.82% with independent
power maps, bitsandbytes 6.7%. r is bounded (|m_hat| / sqrt(v_hat) <= ~1 for Adam), so a mild power map
suits it.
"""


from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..errors import FormatError
from .views import repeats_bytes
from ..kernels.contract import WIDTHS, code_bytes, num_blocks
from .defaults import LAYOUTS, RATIO_TRANSFORM, TRANSFORMS

CODEC = "blockwise"
SUPPORTED_BITS = WIDTHS
_REQUIRED = ("bits", "codes", "absmax", "qmap", "block_size", "transform", "shape", "dtype")


@dataclass
class QState:
    """One quantized tensor: what the dict form above holds, as a type. ``to_dict``/``from_dict`` convert."""

    codes: torch.Tensor  # uint8: [rows, row_bytes] (layout "rows") or [code_bytes(numel, bits)] ("flat")
    absmax: torch.Tensor  # fp32: [rows, blocks per row] or [ceil(numel / block_size)]
    qmap: torch.Tensor  # fp32 [2**bits] codebook, ascending
    block_size: int
    transform: str  # one of TRANSFORMS
    shape: tuple
    dtype: str  # the original tensor's dtype name, e.g. "float32"
    bits: int = 8
    eps: float | None = None  # ratio states: eps' of the transform
    divisor: str | None = None  # ratio states: the sibling state key of the second moment
    layout: str = "flat"  # "rows" (format 3) or "flat" (formats 1 and 2)

    def __post_init__(self):
        if self.is_ratio and (not _is_eps(self.eps) or not isinstance(self.divisor, str)):
            raise FormatError(f"ratio state has eps {self.eps!r} and divisor {self.divisor!r}; it is corrupt")
        if self.layout not in LAYOUTS:
            raise FormatError(f"quantized state has layout {str(self.layout)[:20]!r}; upgrade ckptq")
        for part in ("codes", "absmax", "qmap"):  # decoding reads them element by element
            t = getattr(self, part)
            if isinstance(t, torch.Tensor) and repeats_bytes(t):
                raise FormatError(f"quantized state's {part} repeat their bytes (a stride-0 or overlapping view "
                                  f"of shape {list(t.shape)}); it is crafted or corrupt")

    @property
    def is_ratio(self) -> bool:
        return self.transform == RATIO_TRANSFORM

    @property
    def row_len(self) -> int | None:
        """Elements per row of the layout; None: one row of all elements."""
        return row_len_of(self.shape, self.layout)

    def to_dict(self) -> dict:
        d = {"ckptq": CODEC, "bits": self.bits, "codes": self.codes, "absmax": self.absmax, "qmap": self.qmap,
             "block_size": self.block_size, "transform": self.transform, "shape": tuple(self.shape), "dtype": self.dtype}
        if self.is_ratio:
            d |= {"eps": float(self.eps), "divisor": self.divisor}
        if self.layout != "flat":
            d["layout"] = self.layout
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


def _is_eps(eps) -> bool:
    """A ratio's eps': a number, or the 0-dim float tensor a capturable optimizer step keeps on the device."""
    if isinstance(eps, torch.Tensor):
        return eps.dim() == 0 and eps.is_floating_point()
    return isinstance(eps, (int, float))


def row_len_of(shape, layout: str = "rows") -> int | None:
    """The row length of a tensor of ``shape`` in ``layout``: the product of its dims after the first for
    a tensor of 2 or more dims in the row layout; None (one row) otherwise."""
    if layout != "rows" or len(shape) < 2:
        return None
    n = 1
    for d in shape[1:]:
        n *= int(d)
    return n


def layout_shapes(shape, bits: int, block_size: int, layout: str = "rows") -> tuple[tuple, tuple]:
    """(codes shape, absmax shape) of a state of ``shape`` in ``layout``: [rows, row_bytes] and [rows, blocks per
    row] for the row layout (a 1-D or 0-D tensor is one row), flat 1-D ones otherwise."""
    n = 1
    for d in shape:
        n *= int(d)
    if layout != "rows":
        return (code_bytes(n, bits),), (num_blocks(n, block_size),)
    length = row_len_of(shape, layout) or n
    rows = (int(shape[0]) if len(shape) >= 2 else 1) if n else 0
    return (rows, code_bytes(length, bits)), (rows, num_blocks(length, block_size))


def is_qstate(obj) -> bool:
    return isinstance(obj, dict) and obj.get("ckptq") == CODEC and "codes" in obj


def check_qstate(q: dict) -> None:
    """Raise FormatError if ``q`` uses a codec, bit width, transform or layout this version cannot decode."""
    if q.get("ckptq") != CODEC or q.get("bits") not in SUPPORTED_BITS:
        raise FormatError(
            f"quantized state uses codec {q.get('ckptq')!r} with {q.get('bits')} bits, which this ckptq "
            f"cannot decode (it reads {CODEC!r} with {SUPPORTED_BITS} bits); upgrade ckptq"
        )
    if q.get("transform") not in TRANSFORMS:
        raise FormatError(f"quantized state uses transform {q.get('transform')!r}; upgrade ckptq")
    if q.get("layout", "flat") not in LAYOUTS:
        raise FormatError(f"quantized state uses layout {str(q.get('layout'))[:20]!r}; upgrade ckptq")


def state_nbytes(q: dict) -> int:
    return QState.from_dict(q).nbytes
