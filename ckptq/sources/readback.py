"""Comparing a written output with what was meant, before its original is deleted (``--replace``); the
sources read both sides (``ckptq.sources.single``).

A converted file is checked against its source: every stored tensor's checksum, every exact tensor bit for
bit, and every 8-bit state re-quantized from the source with the parameters the file records (codes,
scales and codebook must be identical: quantization is deterministic). An expanded file is loaded with
``torch.load(weights_only=True)`` and compared bit for bit with the decoding of its source. Only then,
with the output's folder entry made durable (``fsync`` of the folder), is the original removed
(``ckptq.sources.original``).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ..codec import policy, qstate, quant
from ..format import files
from ..errors import FormatError, InputError, ReadbackError, UsageError


@contextmanager
def discarding(outputs: list[str]) -> Iterator[None]:
    """An output that fails its check is removed (it is known bad); the original stays."""
    try:
        yield
    except (FormatError, InputError):
        for p in outputs:
            files.remove_path(p)
        raise


def check_converted(want: Any, got: Any, where: str) -> None:
    """ReadbackError unless ``got`` (a converted output as read, states still quantized) is what convert
    meant to write from ``want`` (the source's contents): exact tensors bit for bit, every low-bit state
    equal to ``want``'s tensor re-quantized with the parameters ``got`` records."""
    _compare(want, got, "", where)


def check_expanded(want: Any, got: Any, where: str) -> None:
    """ReadbackError unless ``got`` (an expanded output as torch.load reads it) holds exactly ``want`` (the
    source's contents decoded; lazily read tensors are produced one at a time)."""
    _compare(want, got, "", where)


def _mismatch(where: str, path: str, what: str) -> ReadbackError:
    return ReadbackError(f"{where} does not read back as written ({path or '<root>'}: {what}); it was removed "
                         "and the original kept")


def _compare(want: Any, got: Any, path: str, where: str, siblings: dict | None = None) -> None:
    if qstate.is_qstate(got) and isinstance(want, torch.Tensor):
        want = _requantize(want, got, path, where, siblings)
    want = _materialize(want)
    if isinstance(want, torch.Tensor):
        if not (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
                and _same_bytes(want, got)):
            raise _mismatch(where, path, "tensor differs")
    elif isinstance(want, dict):
        if not isinstance(got, dict) or list(map(str, want)) != list(map(str, got)):
            raise _mismatch(where, path, "keys differ")
        for (k, w), g in zip(want.items(), got.values()):
            _compare(w, g, f"{path}/{k}", where, want)
    elif isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            raise _mismatch(where, path, "sequence differs")
        for i, (w, g) in enumerate(zip(want, got)):
            _compare(w, g, f"{path}/{i}", where)
    elif not (want == got or (isinstance(want, float) and isinstance(got, float) and math.isnan(want) and math.isnan(got))):
        raise _mismatch(where, path, f"{str(want)[:40]!r} != {str(got)[:40]!r}")


def _requantize(t: torch.Tensor, q: dict, path: str, where: str, siblings: dict | None) -> dict:
    """What convert meant to store for source tensor ``t``, with the parameters the file records."""
    key = path.rsplit("/", 1)[-1]
    if q.get("transform") != policy.RATIO_TRANSFORM:
        return quant.quantize_state(t, key, q["block_size"], bits=q.get("bits", 8), layout=q.get("layout", "flat"),
                                    role=_role_of(q, key))
    v = (siblings or {}).get(q.get("divisor"))
    if not isinstance(v, torch.Tensor):
        raise _mismatch(where, path, "ratio state without its second moment in the source")
    return quant.quantize_ratio(t, v, q["eps"], q["block_size"], divisor_key=q["divisor"], bits=q.get("bits", 8),
                                layout=q.get("layout", "flat"))


def _role_of(q: dict, key: str) -> str | None:
    """The role whose codebook and transform the file records for a state stored on its own (SGD's momentum is
    written by its role, Adam's states by their key): None (the key's policy) when that one matches or none
    does, so that a codebook no policy has still reads back as differing."""
    bits, qmap = q.get("bits", 8), q.get("qmap")
    if not isinstance(qmap, torch.Tensor):
        return None
    for role in (None, *policy.ROLE_POLICIES.get(bits, {})):
        try:
            pol = policy.policy_for(key, bits, role)
        except UsageError:
            continue
        if pol.transform == q.get("transform") and torch.equal(pol.qmap(), qmap.detach().to("cpu", torch.float32)):
            return role
    return None


def _materialize(x: Any) -> Any:
    """A ``torch_stream.LazyTensor`` (a lazily read expand input) as the tensor it stands for."""
    storage = getattr(x, "storage", None)
    if hasattr(storage, "produce"):
        return storage.produce().reshape(-1).as_strided(x.shape, x.stride, x.offset)
    return x


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included)."""
    return torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8),
                       b.detach().contiguous().reshape(-1).view(torch.uint8))
