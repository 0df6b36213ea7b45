"""Import an optimizer state dict into any ``ckptq.optim`` optimizer (the engine's one ``load_state_dict``):
validate everything first, then build the new state: qstates copied as stored where the optimizer steps them
as they are, any other qstate decoded and requantized, fp32 states (its torch counterpart's) quantized as
``ckptq convert`` does (ratio states relative to their exact divisor), bitsandbytes' and torchao's 8-bit forms
decoded first (``ckptq.codec.foreign``).

``torch.optim.Optimizer.load_state_dict`` cannot be reused: it casts every floating tensor to the
parameter's dtype (uint8 codes would become floats) and turns strings nested in state dicts into
generator reprs.

The way back: ``to_torch_state_dict`` decodes a low-bit state dict for the torch optimizer, and
``expand_on_load`` makes a torch optimizer's ``load_state_dict`` do it itself.
"""

from __future__ import annotations

import math
import warnings

import torch

from ..codec import dtensor, foreign, ops, plan, qstate, quant, roles
from ..codec.policy import MOMENT_KEYS
from ..errors import ArgumentError, FormatError, InputError, StateMismatchError, UsageError
from . import args as optim_args
from .args import IMPL_FLAGS
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
    for i, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        check_saved_group(i, group, saved)
    state_in = _decoded_foreign(state_dict["state"], saved_groups)
    _check_keys(opt, state_in)
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
            state[pid] = saved  # state not assigned to a parameter travels as-is, as in torch
            continue
        if not isinstance(saved, dict):
            raise StateMismatchError(f"state of parameter {pid} is a {type(saved).__name__}, not a dict")
        imported = _import_param_state(opt, id_map[pid], pid, saved, group_of[pid])
        if imported:
            state[id_map[pid]] = imported
    return state, groups


def _check_keys(opt, state: dict) -> None:
    """Another optimizer's state is refused by its keys first (before its param groups are found lacking)."""
    known = {"step", *(s.key for s in opt.STATES), *opt.SCALAR_STATES}
    for pid, saved in state.items():
        if isinstance(saved, dict) and isinstance(pid, int):
            unknown = {k for k, v in saved.items() if v is not None} - known
            if unknown:
                raise StateMismatchError(
                    f"state of parameter {pid} has keys {sorted(map(str, saved))}, expected {'/'.join(sorted(known))} "
                    f"as {type(opt).__name__}'s torch counterpart writes them; is this another optimizer's state? "
                    "(convert other optimizers' state first)")


def _decoded_foreign(state: dict, groups: list) -> dict:
    """bitsandbytes' and torchao's 8-bit forms decoded to the torch counterpart's fp32 form (entries the
    groups lack added to them)."""
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


def _import_group(opt, i: int, group: dict, saved: dict) -> dict:
    """The group to install for saved group ``i``: saved values over the optimizer's defaults (what an older
    torch did not save filled in as torch fills it; the class's ``KEPT_ON_LOAD`` keys from ``group``), torch's
    implementation flags and ``params`` (and ``param_names`` when the saved group has none) kept from the
    optimizer's group ``group``. Checked like a constructor argument."""
    where = f"param group {i} of the state dict"
    flags = {k: v for k, v in optim_args.signature_defaults(type(opt)).items()  # flags an older torch did not save,
             if k in opt.defaults and (v is None or isinstance(v, bool))}  # filled as torch fills them
    missing = [k for k in ("params", *opt.defaults) if k not in saved and k not in flags]
    if missing:
        raise StateMismatchError(f"{where} has no {', '.join(map(repr, missing))}; every param group needs them")
    new = {**flags, **{k: group[k] for k in opt.KEPT_ON_LOAD if k in group}, **saved, "params": group["params"]}
    new.update({k: group[k] for k in IMPL_FLAGS if k in group})
    if "param_names" in group and "param_names" not in saved:
        new["param_names"] = group["param_names"]
    for key, value in list(new.items()):
        if key == "betas" and isinstance(value, list):
            new[key] = tuple(value)
    try:
        opt._checked(new, where)
        _check_params(group["params"], f"param group {i}")
    except ArgumentError as e:
        raise StateMismatchError(str(e)) from None
    return new


def _check_params(params, where: str) -> None:
    """Parameters must have storage (not be on ``meta``) to load state for them."""
    for p in params:
        if isinstance(p, torch.Tensor) and p.is_meta:
            raise ArgumentError(
                f"{where} has a parameter on the meta device (shape {tuple(p.shape)}); materialize the model "
                "(e.g. module.to_empty(device=...)) and build the optimizer on its parameters before loading"
            )


def _import_param_state(opt, p: torch.Tensor, pid, saved: dict, group: dict) -> dict:
    declared = opt._declared(group)
    keys = [s.key for s in declared]
    saved = {k: v for k, v in saved.items() if v is not None}  # torch's SGD without momentum keeps None
    extra = opt.SCALAR_STATES
    unknown = set(saved) - {"step", *keys, *extra}
    if unknown:
        raise StateMismatchError(
            f"state of parameter {pid} has keys {sorted(map(str, saved))}, expected {'/'.join(['step', *keys])} as "
            f"{type(opt).__name__}'s torch counterpart writes them; is this another optimizer's state? (convert "
            "other optimizers' state first)")
    check_param_state(pid, saved)
    p = torch.view_as_real(p) if p.is_complex() else p  # complex parameters keep real-view state, as step does
    values = {k: _float_eps(_real_view(saved[k])) for k in keys if k in saved}
    if not values:
        return {}
    by_key = {s.key: s for s in declared}
    always = set(opt.RULE.states(0))  # the states every flag word keeps: present whenever any state is
    lacking = [s.key for s in declared if s.slot_name in always and s.key not in values]
    if lacking:
        raise StateMismatchError(f"state of parameter {pid} has keys {sorted(map(str, saved))} but no "
                                 f"{', '.join(map(repr, lacking))}, which {type(opt).__name__} keeps beside them; load "
                                 f"a complete state dict (or delete state[{pid!r}])")
    for key, value in values.items():
        _check_shape(p, pid, key, value)
        divisor = by_key[key].divisor
        if divisor and divisor not in values:
            raise StateMismatchError(f"state of parameter {pid} has {key!r} but not {divisor!r}, which it is kept "
                                     f"relative to; load a complete state dict (or delete state[{pid!r}])")
    step = step_value(pid, saved.get("step", 0))
    out = {"step": step_tensor(step, p, group)}
    for name, initial in dict(extra).items():  # scalar states (NAdam's mu_product): as saved, else initial
        value = _scalar(pid, name, saved[name]) if name in saved else initial
        out[name] = step_tensor(value, p, group)
    rows_fit = not dtensor.is_dtensor(p) or dtensor.shardable(p)  # else this rank's part is no whole rows: fp32
    if rows_fit and _steppable(opt, values, by_key, dtensor.is_dtensor(p)):
        out.update({k: _copy_qstate(v, p) for k, v in values.items()})
        return out
    quantized = opt._quantized(p) or (rows_fit and any(qstate.is_qstate(v) for v in values.values()))
    dense = {k: dtensor.distribute_like(v.to(device=dtensor.local(p).device, dtype=torch.float32,
                                             memory_format=torch.contiguous_format), p)
             for k, v in _decoded(values, pid).items()}
    unsafe = _unsafe(dense, by_key) if quantized else None
    if unsafe:  # low-bit codes would turn finite values into NaN/Inf: keep this parameter's state fp32, and say so
        warnings.warn(f"ckptq: state of parameter {pid}: {unsafe}; kept in fp32", RuntimeWarning, stacklevel=4)
    if quantized and not unsafe:
        from .spec import quantize_states

        out.update(quantize_states(dense, declared, opt._ratio_eps(group, step), opt.block_size, opt.bits))
    else:
        out.update({k: v.clone(memory_format=torch.contiguous_format) for k, v in dense.items()})
    return out


def _scalar(pid, name: str, value) -> float:
    """A per-parameter scalar state (NAdam's mu_product): a finite number or 1-element real tensor."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point() and not value.is_meta:
        value = float(value)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise StateMismatchError(f"state {name!r} of parameter {pid} is {value!r:.40}; expected a finite number")
    return float(value)


def _unsafe(dense: dict, by_key: dict) -> str | None:
    """Why fp32 states cannot be stored low-bit without damage, or None (``codec.plan.exact_reason``)."""
    for key, t in dense.items():
        local = dtensor.local(t)
        role = by_key[key].role
        if local.numel():
            reason = plan.exact_reason(key if role == roles.ADAM else key, local, role, 1, set())
            if reason and reason != plan.NOT_A_MOMENT:
                return f"{key} {reason}"
    return None


def _steppable(opt, values: dict, by_key: dict, is_dtensor: bool = False) -> bool:
    """Whether qstates can be stepped as stored: the optimizer's code width, one block size and one layout
    (one fused step; a DTensor parameter's in rows, which follow its shards), each state's declared
    transform (a ratio's divisor named, its eps' a float), or a plain first moment where a ratio is declared
    (the step re-encodes it). States of other roles than Adam's also need the optimizer's block size and the
    codebook it writes (else they are requantized onto it once). Anything else is requantized (so an 8-bit
    state loads into a 4-bit optimizer and the other way round, and a ``convert --bits 4`` file's 6 + 2
    layout into the 4-bit optimizer's 4 + 4: ``policy.convert_width``)."""
    if not all(qstate.is_qstate(v) for v in values.values()):
        return False
    layouts = {v.get("layout", "flat") for v in values.values()}
    if len(layouts) != 1 or (is_dtensor and layouts != {"rows"}) or len({v["block_size"] for v in values.values()}) != 1:
        return False
    for key, v in values.items():
        s = by_key[key]
        if v["bits"] != opt.bits:
            return False
        if s.transform == "ratio":
            if not (v["transform"] == "none" or (v.get("divisor") == s.divisor and isinstance(v.get("eps"), float))):
                return False
        elif v["transform"] != s.transform:
            return False
        if s.role != roles.ADAM and not _own_codec(opt, s, v):
            return False
    return True


def _own_codec(opt, s, v: dict) -> bool:
    codebook = opt._codebook(s)
    qmap = v["qmap"]
    return (v["block_size"] == opt.block_size and v.get("layout", "flat") == "rows" and isinstance(qmap, torch.Tensor)
            and qmap.shape == codebook.shape and torch.equal(qmap.detach().cpu().float(), codebook))


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
