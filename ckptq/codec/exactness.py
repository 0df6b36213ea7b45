"""Whether a state can be stored low-bit without damage, or why it is kept exact: the checks ``convert``'s
plan (``ckptq.codec.plan``) and the optimizers' state import (``ckptq.optim.state_io``) share. A tensor is
kept exact below ``min_size`` elements, sharing storage with another tensor, repeating its bytes, holding
NaN/Inf or values beyond fp32, or as a second moment or max-norm with negative values (its sqrt would be
NaN); Adam's first moment is stored as a ratio to its second moment only where that ratio fits fp32."""

from __future__ import annotations

import math

import torch

from . import roles, views
from ..errors import InputError

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")
_FP32_MAX = torch.finfo(torch.float32).max
NOT_A_MOMENT, FACTORED = "not a moment", "factored statistics (small)"
# Why a state is kept exact; the first ones are ordinary, the rest are reported as warnings (the data would
# have been damaged).
ORDINARY = (NOT_A_MOMENT, FACTORED, "below min_size", "shares storage")
_RATIO_CHUNK = 1 << 22


def exact_reason(key: str, t: torch.Tensor, role: str | None, min_size: int, shared: set,
                 factored: bool = False) -> str | None:
    """Why state ``key`` (of ``role``; None: not a moment) is kept exact, or None: it is stored low-bit."""
    if t.is_meta:
        raise InputError(f"state {key!r} is a meta tensor (shape only, no data); the checkpoint cannot be converted")
    if role is None or (role == roles.ADAM and key not in ADAM_MOMENTS):
        return FACTORED if factored else NOT_A_MOMENT
    if t.layout != torch.strided:
        return f"a {str(t.layout).removeprefix('torch.')} tensor, not a dense one"
    if not views.is_quantizable(t, min_size):
        return "below min_size"
    if views.repeats_bytes(t):  # quantizing it would write more than the input holds
        return "a view that repeats its bytes (stride 0 or overlapping)"
    if views.storage_key(t) in shared:
        return "shares storage"
    lo, hi = (float(v) for v in torch.aminmax(t.detach().reshape(-1)))  # one pass; NaN propagates
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "holds NaN/Inf"
    if max(-lo, hi) > _FP32_MAX:
        return "holds values beyond float32"
    if lo < 0 and (key in SECOND_MOMENTS if role == roles.ADAM else role in roles.NON_NEGATIVE):
        what = "max-norm" if role == roles.MAX_NORM else "second moment"
        return f"negative {what} (a {what} is >= 0)"
    return None


def unsafe_moments(dense: dict) -> str | None:
    """Why fp32 Adam moments {key: tensor or DTensor} cannot be stored 8-bit without damage (this rank's
    shard of a DTensor), or None: NaN/Inf, values beyond fp32, a negative second moment."""
    for key, t in dense.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.numel() and key in ADAM_MOMENTS:
            reason = exact_reason(key, local, roles.ADAM, 1, set())
            if reason:
                return f"{key} {reason}"
    return None


def ratio_fits(m: torch.Tensor, v: torch.Tensor, eps: float) -> bool:
    """Whether every |m| / (sqrt(v) + eps) is finite in fp32 (sqrt(v) + eps >= eps bounds it at once)."""
    if m.numel() == 0:
        return True
    absmax = float(m.detach().abs().amax())
    if absmax / eps <= _FP32_MAX / 2:
        return True
    mf, vf = m.detach().reshape(-1), v.detach().reshape(-1)
    for s in range(0, mf.numel(), _RATIO_CHUNK):
        r = mf[s : s + _RATIO_CHUNK].double().abs() / (vf[s : s + _RATIO_CHUNK].double().sqrt() + eps)
        if bool((r > _FP32_MAX / 2).any()):
            return False
    return True
