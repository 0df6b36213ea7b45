"""Import an optimizer state dict into ``ckptq.optim``'s 8-bit Adam: validate everything first, then
build the new state (qstates copied as stored, fp32 moments quantized as ``ckptq convert`` does:
``qstate.quantize_state``, exp_avg as a ratio by ``qstate.quantize_ratio``).

``torch.optim.Optimizer.load_state_dict`` cannot be reused: it casts every floating tensor to the
parameter's dtype (uint8 codes would become floats) and turns strings nested in state dicts into
generator reprs.
"""

from __future__ import annotations

import torch

from . import ops, qstate, sharded
from .adam import MOMENT_KEYS
from .errors import FormatError, StateMismatchError, UsageError

def import_state_dict(opt, state_dict: dict):
    """Return ``(state {param: dict}, param_groups)`` for ``opt``; raises before ``opt`` changes."""
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list) or "state" not in state_dict:
        raise StateMismatchError("not an optimizer state dict: expected keys 'state' and 'param_groups'")
    if len(saved_groups) != len(opt.param_groups):
        raise StateMismatchError(
            f"state dict has {len(saved_groups)} param groups but the optimizer has {len(opt.param_groups)}; "
            "build the optimizer with the same groups as the one that was saved"
        )
    id_map, group_of = {}, {}
    for i, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        if len(group["params"]) != len(saved["params"]):
            raise StateMismatchError(
                f"param group {i} has {len(group['params'])} parameters but the state dict's has "
                f"{len(saved['params'])}; pass the same parameters in the same order"
            )
        id_map.update(zip(saved["params"], group["params"]))
        group_of.update((pid, {**group, **saved}) for pid in saved["params"])
    state = {}
    for pid, saved_state in state_dict["state"].items():
        if pid not in id_map:
            raise StateMismatchError(f"state dict has state for parameter id {pid!r}, which no param group lists")
        state[id_map[pid]] = _import_param_state(opt, id_map[pid], pid, saved_state, group_of[pid])
    groups = [{**saved, "params": group["params"]} for group, saved in zip(opt.param_groups, saved_groups)]
    return state, groups


def _import_param_state(opt, p: torch.Tensor, pid, saved: dict, group: dict) -> dict:
    unknown = set(saved) - {"step", *MOMENT_KEYS}
    if unknown or "exp_avg" not in saved or "exp_avg_sq" not in saved:
        raise StateMismatchError(
            f"state of parameter {pid} has keys {sorted(saved)}, expected step/exp_avg/exp_avg_sq"
            "[/max_exp_avg_sq] as torch.optim.Adam(W) writes them; convert other optimizers' state first"
        )
    for key in MOMENT_KEYS:
        if key in saved:
            _check_shape(p, pid, key, saved[key])
    moments = {k: saved[k] for k in MOMENT_KEYS if k in saved}
    step = float(saved.get("step", 0))
    out = {"step": torch.tensor(step, dtype=torch.float32)}
    if _steppable(moments):
        out.update({k: _copy_qstate(v, p.device) for k, v in moments.items()})
        return out
    quantized = opt._quantized(p) or any(qstate.is_qstate(v) for v in moments.values())
    dense = {k: v.to(device=p.device, dtype=torch.float32) for k, v in _decoded(moments, pid).items()}
    out.update(opt._quantize_moments(dense, group, step) if quantized else {k: v.clone() for k, v in dense.items()})
    return out


def _steppable(moments: dict) -> bool:
    """Whether qstates can be stepped as stored: one block size (one fused step), sqrt second moments,
    a plain or ratio first moment whose divisor is exp_avg_sq. Anything else is requantized."""
    if not all(qstate.is_qstate(v) for v in moments.values()):
        return False
    m = moments["exp_avg"]
    return (
        len({v["block_size"] for v in moments.values()}) == 1
        and all(v["transform"] == "sqrt" for k, v in moments.items() if k != "exp_avg")
        and (m["transform"] == "none" or (m.get("divisor") == "exp_avg_sq" and isinstance(m.get("eps"), float)))
    )


def _decoded(moments: dict, pid) -> dict:
    try:
        return qstate.dequantize_states(moments)
    except (FormatError, KeyError) as exc:
        raise StateMismatchError(f"state of parameter {pid}: {exc}") from exc


def _copy_qstate(value: dict, device) -> dict:
    q = dict(value)
    for name in ("codes", "absmax", "qmap"):
        q[name] = value[name].to(device).clone()  # our steps write codes in place: never share them
    if not sharded.is_dtensor(q["codes"]):  # a DTensor keeps the parameter's shape (ckptq.sharded)
        q["codes"] = q["codes"].reshape(-1)
    q["shape"] = tuple(value["shape"])
    return q


def _check_shape(p: torch.Tensor, pid, key: str, value) -> None:
    if qstate.is_qstate(value):
        qstate.check_qstate(value)
        try:
            ops.check_quantized(value["codes"], value["absmax"], value["qmap"], value["block_size"])
        except (UsageError, KeyError) as e:
            raise StateMismatchError(f"state {key!r} of parameter {pid} is malformed: {e}") from None
        shape, n_codes = tuple(value["shape"]), value["codes"].numel()
    elif isinstance(value, torch.Tensor):
        shape, n_codes = tuple(value.shape), value.numel()
    else:
        raise StateMismatchError(f"state {key!r} of parameter {pid} is a {type(value).__name__}, not a tensor")
    if shape != tuple(p.shape) or n_codes != p.numel():
        raise StateMismatchError(
            f"state {key!r} of parameter {pid} has shape {shape} but the parameter has shape {tuple(p.shape)}; "
            "pass the parameters in the order the optimizer was saved with"
        )
