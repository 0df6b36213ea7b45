"""Quantized optimizer states as plain dicts.

A quantized state is a ``dict`` (so that ``torch.load(weights_only=True)`` accepts it, and so that it
sits under PyTorch's own state key, e.g. ``state[0]["exp_avg"]``)::

    {"ckptq": "blockwise",      # marks the dict; the codec name
     "bits": 8,
     "codes": uint8 [numel],    # one code per element, flat, C order
     "absmax": float32 [ceil(numel / block_size)],
     "qmap": float32 [256],     # the codebook, sorted ascending
     "block_size": 256,
     "transform": "none" | "sqrt",
     "shape": (d0, d1, ...),    # the original tensor's shape
     "dtype": "float32"}        # the original tensor's dtype

Which codebook and transform a state gets is decided by its role (the state key), see ``POLICIES``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import codebooks, codec
from .errors import FormatError

CODEC = "blockwise"
SUPPORTED_BITS = (8,)


# Codebooks by name; files record the values, so a name only decides what new files get.
CODEBOOKS = {
    "dynamic-signed": functools.partial(codebooks.dynamic_map, True),
    "dynamic-unsigned": functools.partial(codebooks.dynamic_map, False),
    "power-signed-2.5": functools.partial(codebooks.power_map, True, 2.5),
    "power-unsigned-3": functools.partial(codebooks.power_map, False, 3.0),
}


@dataclass(frozen=True)
class Policy:
    codebook: str  # a key of CODEBOOKS
    transform: str  # one of codec.TRANSFORMS

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


def policy_for(key: str) -> Policy:
    return POLICIES.get(key, DEFAULT_POLICY)


def is_qstate(obj) -> bool:
    return isinstance(obj, dict) and obj.get("ckptq") == CODEC and "codes" in obj


def quantize_state(
    t: torch.Tensor, key: str, block_size: int = codec.DEFAULT_BLOCK_SIZE, backend: str = "auto"
) -> dict:
    """Quantize one optimizer state tensor under the policy for its state key."""
    pol = policy_for(key)
    qmap = pol.qmap().to(t.device)
    codes, absmax = codec.quantize_blockwise(t, qmap, block_size, pol.transform, backend)
    return {
        "ckptq": CODEC,
        "bits": 8,
        "codes": codes,
        "absmax": absmax,
        "qmap": qmap,
        "block_size": block_size,
        "transform": pol.transform,
        "shape": tuple(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
    }


def check_qstate(q: dict) -> None:
    """Raise FormatError if ``q`` uses a codec or bit width this version cannot decode."""
    if q.get("ckptq") != CODEC or q.get("bits") not in SUPPORTED_BITS:
        raise FormatError(
            f"quantized state uses codec {q.get('ckptq')!r} with {q.get('bits')} bits, which this ckptq "
            f"cannot decode (it reads {CODEC!r} with {SUPPORTED_BITS} bits); upgrade ckptq"
        )
    if q.get("transform") not in codec.TRANSFORMS:
        raise FormatError(f"quantized state uses transform {q.get('transform')!r}; upgrade ckptq")


def dequantize_state(q: dict, backend: str = "auto") -> torch.Tensor:
    """Back to a dense tensor of the original shape and dtype."""
    check_qstate(q)
    flat = codec.dequantize_blockwise(q["codes"], q["absmax"], q["qmap"], q["block_size"], q["transform"], backend)
    return flat.view(tuple(q["shape"])).to(getattr(torch, q["dtype"]))


def state_nbytes(q: dict) -> int:
    return q["codes"].numel() + 4 * q["absmax"].numel()
