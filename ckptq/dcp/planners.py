"""Quantize on save, for runs that keep fp32 AdamW: a ``torch.distributed.checkpoint`` planner pair.

    dcp.save(state_dict, checkpoint_id=d, planner=ckptq.dcp.LowBitSavePlanner())   # Adam moments stored 8-bit
    dcp.load(state_dict, checkpoint_id=d, planner=ckptq.dcp.LowBitLoadPlanner())   # fp32 or 8-bit, as the template

``LowBitSavePlanner`` stores the fp32 Adam moments of every optimizer state dict inside ``state_dict`` (as
``get_state_dict``/``get_optimizer_state_dict`` give them, FQN-keyed) as ckptq 8-bit state, laid out as
``AdamW8bit`` lays out its own (``ckptq.codec.sharded``: codes placed like the parameter, one scale per block of a
row), so the folder is the one an ``AdamW8bit`` run would have written. The optimizer itself stays fp32;
nothing in ``state_dict`` is changed. ``LowBitLoadPlanner`` reads any such folder into any template: 8-bit into
fp32 moments (decoded as the last of a parameter's parts arrives) for torch's AdamW, fp32 into an
``AdamW8bit`` template (the fp32 moments are left in the state dict, and ``set_state_dict`` /
``AdamW8bit.load_state_dict`` quantize them), and like into like as DCP does.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import torch
from .compact import CompactSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..codec import checkpoint, dtensor, exactness, policy, qstate, quant, sharded
from .safe_reader import SafeLoadPlanner

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
def _group_of(osd: dict, fqn) -> dict:
    return next((g for g in osd.get("param_groups", []) if fqn in g.get("params", [])), {})


def _all_ranks_agree(ok: bool, t) -> bool:
    """``ok`` on every rank holding a shard of ``t`` (one collective for DTensors)."""
    if not dtensor.is_dtensor(t):
        return ok
    flag = torch.tensor([0.0 if ok else 1.0])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=t.device_mesh.get_group())
    return flag.item() == 0.0


def _quantizable(m, v, min_size: int, block_size: int) -> bool:
    """The rules of ``ckptq.codec.plan`` for one parameter's moments: large enough, a DTensor's rows following its
    shards (``dtensor.shardable``), finite, within fp32, a second moment >= 0 (checked on every shard)."""
    if not (isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor) and m.is_floating_point()
            and m.shape == v.shape and m.numel() >= min_size):
        return False
    if dtensor.is_dtensor(m) and not (dtensor.shardable(m) and dtensor.is_dtensor(v)):
        return False
    return _all_ranks_agree(exactness.unsafe_moments({"exp_avg": m, "exp_avg_sq": v}) is None, m)


def quantized_copy(state_dict: dict, min_size: int = policy.DEFAULT_MIN_SIZE, block_size: int | None = None,
                   bits: int = 8) -> dict:
    """``state_dict`` with the Adam moments of its optimizer state dicts (nested, or flattened as torchtitan
    saves them) as low-bit qstates in the row layout (``bits`` 8 or 4 per value, blocks of ``block_size``,
    default by ``bits``); new containers along the way, nothing of ``state_dict`` is modified."""
    block_size = policy.default_block_size(bits) if block_size is None else policy.check_block_size(block_size)
    out = dict(state_dict)
    for found in checkpoint.find_optimizers(state_dict):
        if not found.path:
            raise ValueError("pass the optimizer state dict inside a dict, e.g. {'optimizer': osd}")
        osd = dict(found.state_dict)
        osd["state"] = {fqn: _quantize_param(osd, fqn, pstate, min_size, block_size, bits)
                        for fqn, pstate in found.state_dict["state"].items()}
        _set_at(out, found.path, osd)
    for path, flat in list(_flat_optimizers(state_dict, ())):
        if not path:
            raise ValueError("pass the optimizer state dict inside a dict, e.g. {'optimizer': osd}")
        new = dict(flat)
        for fqn in sorted({m["fqn"] for k in flat if isinstance(k, str) and (m := _FLAT_MOMENT.match(k))}):
            pstate = {k[len(f"state.{fqn}."):]: v for k, v in flat.items() if isinstance(k, str)
                      and k.startswith(f"state.{fqn}.") and "." not in k[len(f"state.{fqn}."):]}
            group = {name: flat[f"param_groups.{fqn}.{name}"] for name in ("eps", "betas")
                     if f"param_groups.{fqn}.{name}" in flat}
            q = _quantize_param({"param_groups": [{"params": [fqn], **group}]}, fqn, pstate, min_size, block_size, bits)
            new.update((f"state.{fqn}.{k}", v) for k, v in q.items())
        _set_at(out, path, new)
    return out


def _set_at(out: dict, path: tuple, value) -> None:
    """out[path[0]]...[path[-1]] = value, copying the dicts on the way (the caller's stay as they are)."""
    node = out
    for k in path[:-1]:
        node[k] = dict(node[k])
        node = node[k]
    node[path[-1]] = value


def _quantize_param(osd: dict, fqn, pstate, min_size: int, block_size: int, bits: int):
    if isinstance(pstate, dict) and any(qstate.is_qstate(v) for v in pstate.values()):  # AdamW8bit's state
        return pstate
    if not isinstance(pstate, dict) or not _quantizable(pstate.get("exp_avg"), pstate.get("exp_avg_sq"),
                                                       min_size, block_size):
        return pstate
    dense = {k: pstate[k] for k in MOMENTS if isinstance(pstate.get(k), torch.Tensor)}
    step = pstate.get("step", 0)
    return {**pstate, **sharded.quantize_moments(dense, _group_of(osd, fqn), step, block_size, bits)}


class LowBitSavePlanner(CompactSavePlanner):
    """``DefaultSavePlanner`` that stores Adam moments low-bit (``quantized_copy``: 8 bits per value, or
    ``bits=4``, as ``AdamW4bit`` keeps them)."""

    def __init__(self, *args, min_size: int = policy.DEFAULT_MIN_SIZE, block_size: int | None = None, bits: int = 8,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.bits = policy.check_budget(bits)
        self.min_size = policy.check_min_size(min_size)
        self.block_size = policy.default_block_size(bits) if block_size is None else policy.check_block_size(block_size)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        quantized = quantized_copy(state_dict, self.min_size, self.block_size, self.bits)
        super().set_up_planner(quantized, storage_meta, is_coordinator)


class LowBitLoadPlanner(SafeLoadPlanner):
    """``DefaultLoadPlanner`` that reads 8-bit Adam moments into fp32 templates (torch AdamW) and fp32 moments
    into 8-bit templates (``AdamW8bit``: they stay fp32 in the state dict for ``load_state_dict`` to quantize).
    Byte entries are read with ``torch.load(weights_only=True)``; for a folder someone else wrote, pass
    ``storage_reader=ckptq.dcp.SafeFileSystemReader(path)`` too: ``.metadata`` is read by the storage reader,
    before any planner runs (docs/security.md)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self._pending: dict = {}  # owner -> ({key: (fp32 target, qstate template)}, put)
        self._parts: dict[str, object] = {}  # flattened name of a qstate part -> owner
        saved = metadata.state_dict_metadata
        for owner, prefix, pstate, put in _params(state_dict):
            self._rewrite(owner, pstate, prefix, saved, put)
        for found in checkpoint.find_optimizers(state_dict):
            _only_saved_group_keys(found, saved)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def _rewrite(self, owner, pstate: dict, prefix: str, saved: dict, put) -> None:
        targets = {}
        for key in MOMENTS:
            name, value = f"{prefix}.{key}", pstate.get(key)
            if qstate.is_qstate(value) and name in saved and f"{name}.codes" not in saved:
                put(key, _fp32_template(value, saved[name]))  # fp32 in the folder: load_state_dict quantizes
            elif qstate.is_qstate(value) and f"{name}.codes" in saved:
                put(key, _saved_layout(value, name, saved))
            elif isinstance(value, torch.Tensor) and f"{name}.codes" in saved and name not in saved:
                template = _qstate_template(value, name, saved)  # 8-bit in the folder, fp32 wanted
                put(key, template)
                targets[key] = (value, template)
                self._parts.update((n, owner) for n in saved if n.startswith(f"{name}."))
        if targets:
            self._pending[owner] = (targets, put)

    def finish_plan(self, new_plan):
        self._reads = Counter(item.dest_index.fqn for item in new_plan.items if item.dest_index.fqn in self._parts)
        return super().finish_plan(new_plan)

    def load_bytes(self, read_item, value) -> None:
        super().load_bytes(read_item, value)
        self._arrived(read_item.dest_index.fqn)

    def commit_tensor(self, read_item, tensor) -> None:
        super().commit_tensor(read_item, tensor)
        self._arrived(read_item.dest_index.fqn)

    def _arrived(self, name: str) -> None:
        """Count a read of a qstate part; decode a parameter's moments once all its parts are in."""
        if name not in self._reads:
            return
        self._reads[name] -= 1
        owner = self._parts[name]
        if owner in self._pending and all(self._reads[n] == 0 for n, o in self._parts.items() if o == owner):
            targets, put = self._pending.pop(owner)
            dense = quant.dequantize_states({k: dtensor.unplace(q) for k, (_, q) in targets.items()})
            for key, (target, _) in targets.items():
                dtensor.local(target).copy_(dense[key].view(dtensor.local(target).shape))
                put(key, target)


_FLAT_MOMENT = re.compile(r"^state\.(?P<fqn>.+)\.(?P<key>exp_avg|exp_avg_sq|max_exp_avg_sq)$")


def _params(state_dict: dict):
    """(owner, DCP name prefix, {moment: value}, put(moment, value)) for every parameter's state in the
    optimizer state dicts inside ``state_dict``: nested (``get_optimizer_state_dict``) or flattened
    (``flatten_optimizer_state_dict``, as torchtitan saves). Nested states are replaced by copies first, so
    that ``put`` never touches a live optimizer's state dict."""
    for found in checkpoint.find_optimizers(state_dict):
        holder = found.state_dict["state"]
        for fqn, pstate in list(holder.items()):
            if isinstance(pstate, dict):
                holder[fqn] = copy = dict(pstate)
                yield (found.path, fqn), ".".join(map(str, found.path + ("state", fqn))), copy, copy.__setitem__
    for path, flat in _flat_optimizers(state_dict, ()):
        for fqn in sorted({m["fqn"] for k in flat if isinstance(k, str) and (m := _FLAT_MOMENT.match(k))}):
            pstate = {key: flat[f"state.{fqn}.{key}"] for key in MOMENTS if f"state.{fqn}.{key}" in flat}
            yield (path, fqn), ".".join(map(str, path + ("state", fqn))), pstate, \
                (lambda key, value, f=flat, q=fqn: f.__setitem__(f"state.{q}.{key}", value))


def _flat_optimizers(node, path: tuple):
    """Dicts holding flattened optimizer state (keys ``state.<fqn>.exp_avg``...), with their paths."""
    if isinstance(node, dict):
        if any(isinstance(k, str) and _FLAT_MOMENT.match(k) for k in node):
            yield path, node
        else:
            for k, v in node.items():
                yield from _flat_optimizers(v, path + (k,))


def _only_saved_group_keys(found, saved: dict) -> None:
    """Another optimizer class saved the folder (torch AdamW's groups have ``foreach``, ``fused``, ...,
    AdamW8bit's do not): ask only for the group entries it holds; the optimizer keeps its own for the rest."""
    prefix = ".".join(map(str, found.path + ("param_groups",)))
    groups = found.state_dict.get("param_groups")
    if isinstance(groups, list):
        found.state_dict["param_groups"] = [
            {k: v for k, v in g.items() if k == "params" or f"{prefix}.{i}.{k}" in saved} if isinstance(g, dict) else g
            for i, g in enumerate(groups)]


def _saved_layout(q: dict, name: str, saved: dict) -> dict:
    """A low-bit template for the parts the folder holds, in the shapes it holds them: the same layout as
    ``q`` (the row layout of FSDP2 or ckptq's LowBitSavePlanner, read by one plain process, is viewed that way), or
    plain tensors of the saved shapes when the folder holds another layout (a flat 8-bit folder from before
    the row layout, or other widths): ``load_state_dict`` then lays the state out as the optimizer keeps it."""
    parts = {n[len(name) + 1:]: meta for n, meta in saved.items() if n.startswith(f"{name}.")}
    codes, absmax = parts.get("codes"), parts.get("absmax")
    if set(parts) != set(q) or not isinstance(absmax, TensorStorageMetadata):
        return _plain_template(parts)
    want = tuple(codes.size)
    if tuple(q["codes"].shape) == want and tuple(q["absmax"].shape) == tuple(absmax.size):
        return q
    if dtensor.is_dtensor(q["codes"]) or math.prod(want) != q["codes"].numel():
        return _plain_template(parts)
    return {**q, "codes": q["codes"].view(want), "absmax": q["absmax"].view(tuple(absmax.size))}


def _fp32_template(q: dict, meta) -> torch.Tensor:
    """A place for a moment the folder holds in fp32 (of the saved shape and dtype) where the optimizer keeps
    the qstate ``q``: placed like its codes (this rank's rows) when they are a DTensor."""
    if not isinstance(meta, TensorStorageMetadata):
        return None  # not a tensor in the folder: load_state_dict says what is wrong with it
    return dtensor.zeros_with_rows_of(q["codes"], tuple(meta.size), meta.properties.dtype)


def _plain_template(parts: dict) -> dict:
    """Plain tensors of the saved shapes and dtypes for a qstate's tensor parts (every rank reads the whole
    state), None for its scalars (filled by load_bytes)."""
    return {part: torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)
            if isinstance(meta, TensorStorageMetadata) else None for part, meta in parts.items()}


def _qstate_template(like: torch.Tensor, name: str, saved: dict) -> dict:
    """Empty places for a qstate's parts as the folder holds them: codes placed like the fp32 moment,
    scales placed like it with the saved per-row count, the codebook and scalars as saved."""
    out = {}
    for part_name, meta in saved.items():
        if not part_name.startswith(f"{name}."):
            continue
        part = part_name[len(name) + 1:]
        if part == "codes" and tuple(meta.size) == tuple(like.shape):  # an 8-bit folder from before the row layout
            out[part] = torch.zeros_like(like, dtype=torch.uint8)
        elif part in ("codes", "absmax") and dtensor.is_dtensor(like):  # [rows, width], placed like the moment
            out[part] = dtensor.rows_like(like, tuple(meta.size)[-1], meta.properties.dtype)
        elif isinstance(meta, TensorStorageMetadata):
            out[part] = torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)
        else:
            out[part] = None  # a scalar, filled by load_bytes
    return out
