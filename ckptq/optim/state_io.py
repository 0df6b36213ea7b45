"""Import an optimizer state dict into ``ckptq.optim``'s 8-bit Adam: validate everything first, then
build the new state (qstates copied as stored, fp32 moments quantized as ``ckptq convert`` does:
``quant.quantize_state``, exp_avg as a ratio by ``quant.quantize_ratio``).

``torch.optim.Optimizer.load_state_dict`` cannot be reused: it casts every floating tensor to the
parameter's dtype (uint8 codes would become floats) and turns strings nested in state dicts into
generator reprs.

The way back: ``to_torch_state_dict`` decodes an 8-bit state dict for ``torch.optim.Adam(W)``, and
``expand_on_load`` makes a torch optimizer's ``load_state_dict`` do it itself.
"""

from __future__ import annotations

import math
import warnings

import torch

from ..codec import dtensor, ops, plan, qstate, quant
from . import args as optim_args
from ..codec.policy import MOMENT_KEYS
from ..errors import ArgumentError, FormatError, StateMismatchError, UsageError
from .args import GROUP_FLAGS, IMPL_FLAGS
from .validate import check_param_state, step_value

def import_state_dict(opt, state_dict: dict):
    """Return ``(state {param: dict}, param_groups)`` for ``opt``; raises before ``opt`` changes."""
    saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(saved_groups, list) or not isinstance(state_dict.get("state"), dict):
        raise StateMismatchError("not an optimizer state dict: expected keys 'state' (a dict) and 'param_groups'")
    if len(saved_groups) != len(opt.param_groups):
        raise StateMismatchError(
            f"state dict has {len(saved_groups)} param groups but the optimizer has {len(opt.param_groups)}; "
            "build the optimizer with the same groups as the one that was saved"
        )
    groups = [_import_group(i, group, saved) for i, (group, saved) in enumerate(zip(opt.param_groups, saved_groups))]
    id_map, group_of = {}, {}
    for group, saved in zip(groups, saved_groups):
        id_map.update(zip(saved["params"], group["params"]))
        group_of.update((pid, group) for pid in saved["params"])
    state = {}
    for pid, saved_state in state_dict["state"].items():
        if pid not in id_map and not isinstance(pid, int):
            state[pid] = saved_state  # state not assigned to a parameter travels as-is, as in torch
            continue
        if pid not in id_map:
            raise StateMismatchError(f"state dict has state for parameter id {pid!r}, which no param group lists")
        if not isinstance(saved_state, dict):
            raise StateMismatchError(f"state of parameter {pid} is a {type(saved_state).__name__}, not a dict")
        state[id_map[pid]] = _import_param_state(opt, id_map[pid], pid, saved_state, group_of[pid])
    return state, groups


def check_saved_group(i: int, group: dict, saved) -> str:
    """StateMismatchError unless saved group ``i`` is a dict with a 'params' list of hashable ids, as many as the
    optimizer's group ``group`` has; returns how messages name it."""
    where = f"param group {i} of the state dict"
    if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
        raise StateMismatchError(f"{where} has no 'params' list of parameter ids; it is not an optimizer state dict")
    for j, pid in enumerate(saved["params"]):
        try:
            hash(pid)
        except TypeError:
            raise StateMismatchError(f"{where} lists a {type(pid).__name__} ({pid!r:.40}) as parameter id {j} of its "
                                     "'params'; ids are ints as optimizer.state_dict() writes them") from None
    if len(group["params"]) != len(saved["params"]):
        raise StateMismatchError(
            f"param group {i} has {len(group['params'])} parameters but the state dict's has "
            f"{len(saved['params'])}; pass the same parameters in the same order"
        )
    return where


def _import_group(i: int, group: dict, saved) -> dict:
    """The group to install for saved group ``i``: saved values, flags an older torch did not save filled
    as torch fills them, torch's implementation flags and ``params`` (and ``param_names`` when the saved
    group has none) kept from the optimizer's group ``group``. Checked like a constructor argument."""
    where = check_saved_group(i, group, saved)
    new = {**GROUP_FLAGS, **saved, "params": group["params"]}
    new.update({k: group[k] for k in IMPL_FLAGS if k in group})
    if "param_names" in group and "param_names" not in saved:
        new["param_names"] = group["param_names"]
    try:
        optim_args.check_group(new, where)
        optim_args.check_params(group["params"], f"param group {i}")
    except ArgumentError as e:
        raise StateMismatchError(str(e)) from None
    return new


def _import_param_state(opt, p: torch.Tensor, pid, saved: dict, group: dict) -> dict:
    unknown = set(saved) - {"step", *MOMENT_KEYS}
    if unknown or "exp_avg" not in saved or "exp_avg_sq" not in saved:
        raise StateMismatchError(
            f"state of parameter {pid} has keys {sorted(saved)}, expected step/exp_avg/exp_avg_sq"
            "[/max_exp_avg_sq] as torch.optim.Adam(W) writes them; convert other optimizers' state first"
        )
    check_param_state(pid, saved)
    p = torch.view_as_real(p) if p.is_complex() else p  # complex parameters keep real-view state, as step does
    moments = {k: _float_eps(_real_view(saved[k])) for k in MOMENT_KEYS if k in saved}
    for key, value in moments.items():
        _check_shape(p, pid, key, value)
    step = step_value(pid, saved.get("step", 0))
    out = {"step": step_tensor(step, p, group)}
    rows_fit = not dtensor.is_dtensor(p) or dtensor.shardable(p)  # else this rank's part is no whole rows: fp32
    if rows_fit and _steppable(moments, getattr(opt, "bits", 8), dtensor.is_dtensor(p)):
        out.update({k: _copy_qstate(v, p) for k, v in moments.items()})
        return out
    quantized = opt._quantized(p) or (rows_fit and any(qstate.is_qstate(v) for v in moments.values()))
    dense = {k: dtensor.distribute_like(v.to(device=p.device, dtype=torch.float32, memory_format=torch.contiguous_format),
                                        p) for k, v in _decoded(moments, pid).items()}
    unsafe = plan.unsafe_moments(dense) if quantized else None
    if unsafe:  # 8 bits would turn finite values into NaN/Inf: keep this parameter's state fp32, and say so
        warnings.warn(f"ckptq: state of parameter {pid}: {unsafe}; kept in fp32", RuntimeWarning, stacklevel=4)
    out.update(opt._quantize_moments(dense, group, step) if quantized and not unsafe
               else {k: v.clone(memory_format=torch.contiguous_format) for k, v in dense.items()})
    return out


def step_tensor(step: float, p: torch.Tensor, group: dict) -> torch.Tensor:
    """A parameter's step count as the optimizer keeps it: 0-dim fp32, on the CPU (as torch's Adam), or on
    the parameter's device when its group is capturable (as torch's capturable Adam)."""
    return torch.tensor(step, dtype=torch.float32, device=p.device if group.get("capturable") else "cpu")


def with_float_eps(state_dict: dict) -> dict:
    """``state_dict`` with each qstate's eps' a float where a capturable step keeps a 0-dim tensor (the
    parameters' state dicts concerned are copied; the optimizer's own state is left as it is)."""
    state = state_dict.get("state")
    for pid, pstate in list(state.items()) if isinstance(state, dict) else ():
        if isinstance(pstate, dict) and any(_tensor_eps(v) for v in pstate.values()):
            state[pid] = {k: {**v, "eps": float(v["eps"])} if _tensor_eps(v) else v for k, v in pstate.items()}
    return state_dict


def _tensor_eps(value) -> bool:
    return qstate.is_qstate(value) and isinstance(value.get("eps"), torch.Tensor)


def _float_eps(value):
    """A ratio qstate with its eps' as a float (validated: a number, or a capturable optimizer's 0-dim
    tensor), as the format holds it; anything else as it is."""
    if qstate.is_qstate(value) and "eps" in value and not isinstance(value["eps"], float):
        return {**value, "eps": float(value["eps"])}
    return value


def _real_view(value):
    """torch's Adam(W) keeps complex moments for complex parameters; ckptq keeps their real view."""
    return torch.view_as_real(value) if isinstance(value, torch.Tensor) and value.is_complex() else value


def _steppable(moments: dict, bits: int, dtensor: bool = False) -> bool:
    """Whether qstates can be stepped as stored: the optimizer's code width, one block size and one layout
    (one fused step; a DTensor parameter's in rows, which follow its shards), sqrt second moments, a plain
    or ratio first moment whose divisor is exp_avg_sq. Anything else is requantized (so an 8-bit state
    loads into a 4-bit optimizer and the other way round, and a ``convert --bits 4`` file's 6 + 2 layout
    into the 4-bit optimizer's 4 + 4: ``policy.convert_width``)."""
    if not all(qstate.is_qstate(v) for v in moments.values()):
        return False
    m = moments["exp_avg"]
    layouts = {v.get("layout", "flat") for v in moments.values()}
    return (
        len(layouts) == 1 and (not dtensor or layouts == {"rows"})
        and all(v["bits"] == bits for v in moments.values())
        and len({v["block_size"] for v in moments.values()}) == 1
        and all(v["transform"] == "sqrt" for k, v in moments.items() if k != "exp_avg")
        and (m["transform"] == "none" or (m.get("divisor") == "exp_avg_sq" and isinstance(m.get("eps"), float)))
    )


def _decoded(moments: dict, pid) -> dict:
    try:
        return quant.dequantize_states(moments)
    except (FormatError, KeyError) as exc:
        raise StateMismatchError(f"state of parameter {pid}: {exc}") from exc


def _copy_qstate(value: dict, p: torch.Tensor) -> dict:
    """A copy of a steppable qstate on ``p``'s device (our steps write codes in place: never share them),
    its codes and scales in their layout's shapes; for a DTensor ``p`` placed like it: a qstate saved by one
    process (or by another world size) gives each rank its rows, bit for bit."""
    q = dict(value)
    q["shape"] = tuple(value["shape"])
    for name in ("codes", "absmax", "qmap"):  # contiguous copies: the kernels view them flat
        q[name] = value[name].to(p.device).clone(memory_format=torch.contiguous_format)
    if dtensor.is_dtensor(q["codes"]):
        return q
    codes, absmax = qstate.layout_shapes(q["shape"], q["bits"], q["block_size"], q.get("layout", "flat"))
    q["codes"], q["absmax"] = q["codes"].reshape(codes), q["absmax"].reshape(absmax)
    return dtensor.place_rows(q, p) if dtensor.is_dtensor(p) else q


def _check_shape(p: torch.Tensor, pid, key: str, value) -> None:
    _check_not_meta(pid, key, value)
    if qstate.is_qstate(value):
        qstate.check_qstate(value)
        try:
            shape = tuple(value["shape"])
            numel = math.prod(int(d) for d in shape)
            row_len = qstate.row_len_of(shape, value.get("layout", "flat"))
            n_codes = ops.check_quantized(value["codes"], value["absmax"], value["qmap"], value["block_size"],
                                          value["bits"], numel, row_len)
        except (UsageError, KeyError, TypeError) as e:
            raise StateMismatchError(f"state {key!r} of parameter {pid} is malformed: {e}") from None
    elif isinstance(value, torch.Tensor):
        shape, n_codes = tuple(value.shape), value.numel()
    else:
        raise StateMismatchError(f"state {key!r} of parameter {pid} is a {type(value).__name__}, not a tensor")
    if shape != tuple(p.shape) or n_codes != p.numel():
        raise StateMismatchError(
            f"state {key!r} of parameter {pid} has shape {shape} but the parameter has shape {tuple(p.shape)}; "
            "pass the parameters in the order the optimizer was saved with"
        )


def _check_not_meta(pid, key: str, value) -> None:
    parts = {"": value} if isinstance(value, torch.Tensor) else value if isinstance(value, dict) else {}
    meta = [name for name, t in parts.items() if isinstance(t, torch.Tensor) and t.is_meta]
    if meta:
        fields = f" (its {', '.join(meta)})" if meta != [""] else ""
        raise StateMismatchError(
            f"state {key!r} of parameter {pid} is on the meta device{fields} and has no values; save the optimizer "
            "after its state is materialized (meta tensors carry only shapes)"
        )


def to_torch_state_dict(state_dict: dict, optimizer=None) -> dict:
    """An ``AdamW8bit``/``Adam8bit`` state dict (or ``ckptq.load(path)["optimizer"]``) as
    ``torch.optim.Adam(W)`` loads it: every 8-bit state decoded to an fp32 tensor (exp_avg through its
    ratio), other tensors copied (torch's load keeps same-device tensors as they are, so the two
    optimizers would share them). Given ``optimizer`` (the torch optimizer it is for), the real-view
    states of its complex parameters become complex again, as torch keeps them."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
        raise StateMismatchError("not an optimizer state dict: expected keys 'state' (a dict) and 'param_groups'")
    complex_ids = set()
    if optimizer is not None:
        saved_ids = [pid for g in state_dict.get("param_groups", []) for pid in g.get("params", [])]
        params = [p for g in optimizer.param_groups for p in g["params"]]
        complex_ids = {pid for pid, p in zip(saved_ids, params) if p.is_complex()}
    state = {}
    for pid, saved in state_dict["state"].items():
        state[pid] = _dense_state(pid, saved, pid in complex_ids) if isinstance(saved, dict) else saved
    return {**state_dict, "state": state}


def _dense_state(pid, saved: dict, is_complex: bool) -> dict:
    quantized = any(qstate.is_qstate(v) for v in saved.values())
    if quantized:
        check_param_state(pid, saved)
    decoded = _decoded({k: _float_eps(v) for k, v in saved.items()}, pid) if quantized else saved
    out = {k: v.clone() if isinstance(v, torch.Tensor) and v is saved.get(k) else v for k, v in decoded.items()}
    if is_complex:
        out.update({k: torch.view_as_complex(out[k].contiguous()) for k in MOMENT_KEYS if k in out})
    return out


def expand_on_load(optimizer: torch.optim.Optimizer):
    """Let a torch optimizer (``torch.optim.AdamW``...) load 8-bit state dicts: registers a
    ``load_state_dict`` pre-hook that applies ``to_torch_state_dict``. Without it torch accepts such a
    dict and fails at the first step (``'dict' object has no attribute 'lerp_'``). Returns the hook handle."""
    return optimizer.register_load_state_dict_pre_hook(lambda opt, sd: to_torch_state_dict(sd, opt))
