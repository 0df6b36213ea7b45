"""Import a state dict into ``ckptq.optim``'s one-state optimizers (``SGD8bit``, ``Lion8bit``, ``Muon8bit``):
everything validated first, then the new state built: qstates copied as stored where the optimizer steps them
as they are (its code width, a signed plain codebook, one layout), any other qstate decoded and requantized,
fp32 state (the torch counterpart's) quantized as ``ckptq convert`` does, a bitsandbytes one-state optimizer's
state decoded first (``ckptq.codec.foreign``).

``torch.optim.Optimizer.load_state_dict`` cannot be reused (``ckptq.optim.state_io`` says why). The way back
is ``ckptq.optim.to_torch_state_dict``, which decodes any qstate: torch's SGD and Muon and lion-pytorch's Lion
load its output and step.
"""

from __future__ import annotations

import torch

from ..codec import dtensor, foreign, policy, qstate, roles
from ..errors import ArgumentError, InputError, StateMismatchError
from .state_io import _check_shape, _copy_qstate, _decoded, check_saved_group, step_tensor
from .validate import check_param_state, step_value


def import_state_dict(opt, state_dict) -> tuple[dict, list]:
    """Return ``(state {param: dict}, param_groups)`` for ``opt``; raises before ``opt`` changes."""
    groups_saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(groups_saved, list) or not isinstance(state_dict.get("state"), dict):
        raise StateMismatchError("not an optimizer state dict: expected keys 'state' (a dict) and 'param_groups'")
    if len(groups_saved) != len(opt.param_groups):
        raise StateMismatchError(f"state dict has {len(groups_saved)} param groups but the optimizer has "
                                 f"{len(opt.param_groups)}; build the optimizer with the same groups as the one saved")
    saved_groups = [dict(g) if isinstance(g, dict) else g for g in groups_saved]  # foreign state may add entries
    state_in = _decoded_foreign(state_dict["state"], saved_groups)
    groups, id_map, group_of = [], {}, {}
    for i, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        new = _import_group(opt, i, group, saved)
        groups.append(new)
        id_map.update(zip(saved["params"], group["params"]))
        group_of.update((pid, new) for pid in saved["params"])
    state = {}
    for pid, saved in state_in.items():
        if pid not in id_map:
            if isinstance(pid, int):
                raise StateMismatchError(f"state dict has state for parameter id {pid!r}, which no param group lists")
            state[pid] = saved
            continue
        if not isinstance(saved, dict):
            raise StateMismatchError(f"state of parameter {pid} is a {type(saved).__name__}, not a dict")
        imported = _import_param_state(opt, id_map[pid], pid, saved, group_of[pid])
        if imported:
            state[id_map[pid]] = imported
    return state, groups


def _decoded_foreign(state: dict, groups: list) -> dict:
    """bitsandbytes' one-state form decoded to its torch counterpart's (entries its groups lack added)."""
    group_of = {pid: g for g in groups if isinstance(g, dict) and isinstance(g.get("params"), (list, tuple))
                for pid in g["params"]}
    out = dict(state)
    for pid, pstate in state.items():
        if foreign.kind(pstate) is None:
            continue
        try:
            out[pid] = foreign.to_torch_state(pstate, group_of.get(pid, {}))
        except InputError as e:
            raise StateMismatchError(f"state of parameter {pid}: {e}") from None
    return out


def _import_group(opt, i: int, group: dict, saved) -> dict:
    where = check_saved_group(i, group, saved)
    new = {**opt.defaults, **{k: v for k, v in saved.items() if k in opt.defaults or k == "param_names"},
           "params": group["params"]}
    if "param_names" in group and "param_names" not in saved:
        new["param_names"] = group["param_names"]
    if isinstance(new.get("betas"), list):
        new["betas"] = tuple(new["betas"])
    try:
        opt._check_group(new, where)
    except ArgumentError as e:
        raise StateMismatchError(str(e)) from None
    return new


def _import_param_state(opt, p: torch.Tensor, pid, saved: dict, group: dict) -> dict:
    key = opt.state_key
    unknown = set(saved) - {"step", key}
    if unknown:
        raise StateMismatchError(f"state of parameter {pid} has keys {sorted(map(str, saved))}, expected {key!r} "
                                 f"[and 'step'] as {type(opt).__name__}'s torch counterpart writes them; is this "
                                 "another optimizer's state?")
    check_param_state(pid, saved)
    value = saved.get(key)
    if value is None:  # torch's SGD without momentum keeps momentum_buffer None
        return {}
    _check_shape(p, pid, key, value)
    out = {"step": step_tensor(step_value(pid, saved.get("step", 0)), p, {})}
    if _steppable(value, opt):
        out[key] = _copy_qstate(value, p)
        return out
    dense = _decoded({key: value}, pid)[key] if qstate.is_qstate(value) else value
    dense = dtensor.distribute_like(dense.to(device=dtensor.local(p).device, dtype=torch.float32,
                                             memory_format=torch.contiguous_format), p)
    quantize = opt.quantized(p) or (qstate.is_qstate(value) and (not dtensor.is_dtensor(p) or dtensor.shardable(p)))
    if quantize and not bool(torch.isfinite(dtensor.local(dense)).all()):
        raise StateMismatchError(f"state {key!r} of parameter {pid} holds NaN or Inf values; low-bit state cannot "
                                 "keep them: load an intact state dict (or delete this parameter's state)")
    out[key] = opt.quantize(dense) if quantize else dense.clone()
    return out


def _steppable(value, opt) -> bool:
    """Whether a qstate steps as stored: the optimizer's width and block size, the role's codebook, plain values,
    rows (a DTensor parameter's follow its shards)."""
    if not qstate.is_qstate(value):
        return False
    codebook = policy.ROLE_POLICIES[opt.bits][roles.FIRST].qmap()
    qmap = value["qmap"]
    return (value["bits"] == opt.bits and value["block_size"] == opt.block_size and value["transform"] == "none"
            and value.get("layout", "flat") == "rows" and isinstance(qmap, torch.Tensor) and qmap.shape == codebook.shape
            and torch.equal(qmap.detach().cpu().float(), codebook))
