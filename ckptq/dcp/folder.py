"""``ckptq convert`` / ``expand`` / ``info`` of ``torch.distributed.checkpoint`` folders (``.metadata`` +
``__{rank}_{n}.distcp``): a plain ``dcp.save`` of ``{"model", "optimizer"}``, torchtitan's ``step-N/``,
accelerate's FSDP ``optimizer_0/``, Lightning's sharded ``.ckpt/``.

The output is a DCP folder that DCP's own tools read. Converting, the Adam moments (keys ending in
``.exp_avg``, ``.exp_avg_sq``, ``.max_exp_avg_sq``) get the decisions of the one planner (``codec.plan``:
which go low-bit, the first moment as a ratio, the widths of ``--bits``) and the one quantizer
(``codec.quant``), in the row layout: exactly what ``AdamW8bit``/``AdamW4bit`` under FSDP2 or
``ckptq.dcp.LowBitSavePlanner`` write, as the parts of a quantized state (``codes``, ``absmax``, ``qmap`` and
scalars; docs/FORMAT.md). Every low-bit moment has the optimizer's width (``working_width``). Everything else is copied bit for bit. Expanding does the reverse. A parameter's
moments are read to decide, then again when the writer reaches them, so a process holds about one
parameter's moments at a time. Under ``torchrun`` each rank takes a share of the parameters and keys and
``dcp.save`` merges them into one folder (``ckptq.dcp.source`` joins and leaves the process group).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..codec import exactness, plan, policy, qstate, quant
from ..errors import InputError
from ..format.dtypes import dtype_name, float_dtype_from_name
from . import safe_reader
from .writer import folder_bytes, gathered, mine, write_folder

_MOMENT = re.compile(r"^(?P<opt>.+)\.state\.(?P<fqn>.+)\.(?P<key>exp_avg|exp_avg_sq|max_exp_avg_sq)$")
_PARTS = ("codes", "absmax", "qmap")
_SCALARS = ("ckptq", "bits", "block_size", "transform", "shape", "dtype", "eps", "divisor", "layout")


def read_metadata(path: str):
    """The checked metadata of the DCP folder ``path``, read without running code (``safe_reader``)."""
    return safe_reader.load_metadata(path)


def _read(path: str, items: dict) -> dict:
    """Read ``items`` ({key: template}) from the folder in this process only (no collectives), safely."""
    return safe_reader.read_items(path, items)


@dataclass
class Param:
    """One parameter's fp32 Adam moments in a folder: {role: (key, metadata)}, its step and group."""

    opt: str
    fqn: str
    roles: dict = field(default_factory=dict)
    step: float = 0.0
    group: dict = field(default_factory=dict)


@dataclass
class Stored:
    """A moment this rank writes low-bit: its width, and the ratio's divisor (key, eps') or None."""

    param: Param
    role: str
    width: int
    divisor: tuple | None = None


@dataclass
class Plan:
    params: list[Param] = field(default_factory=list)  # fp32 moments of min_size elements or more
    exact: dict = field(default_factory=dict)  # key -> metadata: copied as they are
    scalars: dict = field(default_factory=dict)  # the values of the small entries (steps, param_groups)
    stored: dict = field(default_factory=dict)  # key -> Stored, this rank's (after ``_decide``)
    warnings: list[str] = field(default_factory=list)
    quantized: int = 0  # over all ranks


def _scalars(path: str, md) -> dict:
    """Every small non-tensor entry (steps, param_groups) as Python values; the shape and divisor of each
    low-bit state checked, since expand allocates and pairs by them before any decoder looks."""
    keys = {k: None for k, m in md.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)}
    steps = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
             if k.endswith(".step") and isinstance(m, TensorStorageMetadata)}
    scalars = _read(path, {**keys, **steps}) if keys or steps else {}
    qkeys = set(quantized_keys(md.state_dict_metadata))
    for key in qkeys:
        shape, divisor = scalars.get(f"{key}.shape"), scalars.get(f"{key}.divisor")
        codes = md.state_dict_metadata[f"{key}.codes"]
        most = codes.size.numel() * 8 // min(qstate.SUPPORTED_BITS) if isinstance(codes, TensorStorageMetadata) else 0
        if not (isinstance(shape, (list, tuple)) and all(type(d) is int and d >= 0 for d in shape)
                and _numel(shape) <= most and (divisor is None or f"{key.rpartition('.')[0]}.{divisor}" in qkeys)):
            raise InputError(f"{path}: quantized state {key} has shape {shape!r:.60} for {most} elements at most, "
                             f"divisor {divisor!r:.40}; it is damaged or crafted")
    return scalars


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


_GROUP_PARAMS = re.compile(r"(.+)\.param_groups\.(\d+)\.params")


def _group_of(scalars: dict) -> dict:
    """{(optimizer key, parameter fqn): its param group's index}, from the ``<opt>.param_groups.N.params``
    lists, the first group naming a parameter winning; one pass over all the lists (not one per parameter)."""
    where: dict[tuple, str] = {}
    for key, params in scalars.items():
        m = _GROUP_PARAMS.fullmatch(key) if isinstance(key, str) else None
        if m and isinstance(params, (list, tuple)):
            for fqn in params:
                where.setdefault((m.group(1), str(fqn)), m.group(2))
    return where


def _group_value(scalars: dict, groups: dict, opt: str, fqn: str, name: str, default):
    if f"{opt}.param_groups.{fqn}.{name}" in scalars:  # flatten_optimizer_state_dict (torchtitan)
        return scalars[f"{opt}.param_groups.{fqn}.{name}"]
    index = groups.get((opt, fqn))
    return default if index is None else scalars.get(f"{opt}.param_groups.{index}.{name}", default)


def make_plan(path: str, md, min_size: int) -> Plan:
    """The fp32 Adam moments of the folder with ``min_size`` elements or more, by parameter; all other keys
    copied as they are (``_decide`` then reads the moments and keeps exact what low bits would damage)."""
    p, meta, params = Plan(), md.state_dict_metadata, {}
    p.scalars = _scalars(path, md)
    for key, m in meta.items():
        found = _MOMENT.match(key)
        if found and isinstance(m, TensorStorageMetadata) and m.properties.dtype.is_floating_point \
                and len(m.size) and m.size.numel() >= min_size:
            param = params.setdefault((found["opt"], found["fqn"]), Param(found["opt"], found["fqn"]))
            param.roles[found["key"]] = (key, m)
        else:
            p.exact[key] = m
    groups = _group_of(p.scalars)
    for (opt, fqn), param in params.items():
        param.step = p.scalars.get(f"{opt}.state.{fqn}.step", 0)
        param.group = {"eps": _group_value(p.scalars, groups, opt, fqn, "eps", 1e-8),
                       "betas": _group_value(p.scalars, groups, opt, fqn, "betas", (0.9, 0.999))}
        p.params.append(param)
    return p


def _read_moments(path: str, param: Param) -> dict:
    """A parameter's moments as fp32 tensors, {role: tensor}, plus its step."""
    dense = _read(path, {key: torch.empty(tuple(m.size), dtype=torch.float32) for key, m in param.roles.values()})
    return {role: dense[key] for role, (key, _) in param.roles.items()} | {"step": param.step}


def _decide(path: str, p: Plan, bits: int, min_size: int) -> None:
    """This rank's share of the parameters: their moments read once, decided by ``codec.plan.decide`` (what
    low bits would damage stays exact, the first moment is a ratio where it fits), widths by ``bits``."""
    found = []
    for param in mine(p.params):
        for d in plan.decide((), _read_moments(path, param), param.group, min_size):
            key, meta = param.roles[d.key]
            if d.exact:
                p.exact[key] = meta
                found += [f"{key}: {d.exact}, kept exact"] if d.exact not in exactness.ORDINARY else []
                continue
            divisor = (param.roles[d.divisor[0]][0], d.divisor[2]) if d.divisor else None
            p.stored[key] = Stored(param, d.key, working_width(bits), divisor)
            found += [f"{key}: {d.note}"] if d.note else []
    every = gathered((found, len(p.stored)))
    p.warnings = sorted(w for ws, _ in every for w in ws)
    p.quantized = sum(n for _, n in every)


def working_width(bits: int) -> int:
    """The code width of every low-bit moment in a converted DCP folder: the optimizer's own (8 + 8, or 4 + 4
    as ``AdamW4bit`` keeps them under FSDP2), not a file's 6 + 2 split, so that a plain ``dcp.load`` into
    ``AdamW8bit`` / ``AdamW4bit`` finds every part in the shape it holds (6-bit codes made it fail with
    "Size mismatch ... [512, 96] vs [512, 64] ... exp_avg.codes"), and the resumed state is one rounding
    away from the fp32 moments, not two."""
    return policy.check_budget(bits)


def _parts(src: str, key: str, s: Stored, block_size: int, cache: dict) -> dict:
    """The entries of one low-bit moment: its tensors as (meta placeholder, producer), its scalars as values.
    The first tensor the writer asks for quantizes it (``quant.quantize_as``); each is dropped when written."""
    def quantized() -> dict:
        if key not in cache:
            dense = _read_moments(src, s.param)
            divisor = None if s.divisor is None else ("exp_avg_sq", dense["exp_avg_sq"], s.divisor[1])
            cache[key] = quant.quantize_as(dense[s.role], s.role, block_size, s.width, divisor)
        return cache[key]

    def part(name: str):
        return lambda _buffer: quantized().pop(name)

    entries = {f"{key}.{n}": v for n, v in scalar_parts(s, block_size).items()}
    for name, (size, dtype) in tensor_parts(s, block_size).items():
        entries[f"{key}.{name}"] = (torch.empty(size, dtype=dtype, device="meta"), part(name))
    return entries


def scalar_parts(s: Stored, block_size: int) -> dict:
    """The small values of a low-bit moment's entries (docs/FORMAT.md, "DCP folders")."""
    meta = s.param.roles[s.role][1]
    pol = policy.ratio_policy(s.width) if s.divisor else policy.policy_for(s.role, s.width)
    out = {"ckptq": qstate.CODEC, "bits": s.width, "block_size": block_size, "transform": pol.transform,
           "shape": list(meta.size), "dtype": dtype_name(meta.properties.dtype), "layout": "rows"}  # expand restores dtype
    return out | ({"eps": float(s.divisor[1]), "divisor": "exp_avg_sq"} if s.divisor else {})


def tensor_parts(s: Stored, block_size: int) -> dict:
    """{part: (shape, dtype)} of a low-bit moment's tensors: codes and scales in the row layout, the codebook."""
    codes, absmax = qstate.layout_shapes(tuple(s.param.roles[s.role][1].size), s.width, block_size)
    return {"codes": (codes, torch.uint8), "absmax": (absmax, torch.float32), "qmap": ((2**s.width,), torch.float32)}


def _exact_entries(src: str, p: Plan, keys) -> tuple[dict, dict]:
    state, producers = {}, {}
    for key in keys:
        m = p.exact[key]
        if isinstance(m, TensorStorageMetadata):
            state[key] = torch.empty(tuple(m.size), dtype=m.properties.dtype, device="meta")
            producers[key] = (lambda out, k=key: _read(src, {k: out})[k])  # read into the writer's buffer
        else:
            state[key] = p.scalars[key] if key in p.scalars else _read(src, {key: None})[key]
    return state, producers


def convert(src: str, dst: str, *, bits: int, block_size: int, min_size: int, force: bool = False) -> dict:
    """Store a DCP folder's fp32 Adam moments at ``bits`` per value (8, or 4: a 6-bit ratio over a 2-bit
    second moment); returns the fields of a convert report."""
    p = make_plan(src, read_metadata(src), min_size)
    candidates = {key for param in p.params for key, _ in param.roles.values()}
    _decide(src, p, bits, min_size)
    if not p.quantized:
        raise InputError(f"{src}: no fp32 Adam moment (…state.<fqn>.exp_avg / exp_avg_sq) with {min_size} elements "
                         "or more that low bits would not damage; nothing to store low-bit")
    plain = mine(sorted(k for k in p.exact if k not in candidates))  # this rank's share of the other keys
    state, producers = _exact_entries(src, p, plain + [k for k in p.exact if k in candidates])
    cache: dict = {}
    for key, s in p.stored.items():
        for name, value in _parts(src, key, s, block_size, cache).items():
            state[name], producers[name] = value if isinstance(value, tuple) else (value, None)
    write_folder(dst, state, {k: f for k, f in producers.items() if f}, force, src)
    small = [k for k, m in p.exact.items() if k not in candidates and _MOMENT.match(k) and isinstance(m, TensorStorageMetadata)]
    return {"quantized": p.quantized, "kept_small": len(small), "warnings": p.warnings, "source_bytes": folder_bytes(src),
            "output_bytes": folder_bytes(dst) if os.path.isdir(dst) else 0}


def part_meta(src: str, meta: dict, key: str, part: str) -> TensorStorageMetadata:
    """The metadata of a low-bit state's tensor part (codes, absmax, qmap); InputError if it is not a tensor."""
    m = meta.get(f"{key}.{part}")
    if not isinstance(m, TensorStorageMetadata):
        raise InputError(f"{src}: quantized state {key} has no tensor {part}; it is damaged or crafted")
    return m


def quantized_keys(meta: dict) -> list[str]:
    return [k[: -len(".codes")] for k in meta if k.endswith(".codes") and f"{k[: -len('.codes')]}.ckptq" in meta]


def qstate_at(src: str, key: str, scalars: dict, meta: dict) -> dict:
    """The low-bit state ``key`` of a folder as a qstate dict: the row layout as saved, or an 8-bit folder
    from before it (codes shaped like the tensor, blocks of whole rows: the flat layout, viewed)."""
    q = {n: scalars[f"{key}.{n}"] for n in _SCALARS if f"{key}.{n}" in scalars}
    parts = _read(src, {f"{key}.{n}": torch.empty(tuple(m.size), dtype=m.properties.dtype)
                        for n in _PARTS for m in [part_meta(src, meta, key, n)]})
    q |= {n: parts[f"{key}.{n}"] for n in _PARTS}
    q["shape"] = tuple(q.get("shape", ()))
    if q.get("layout", "flat") != "rows":
        q["codes"], q["absmax"] = q["codes"].reshape(-1), q["absmax"].reshape(-1)
    try:
        qstate.QState.from_dict(q)
    except Exception as e:
        raise InputError(f"{src}: quantized state {key} is damaged: {e}") from None
    return q


def _decoder(src: str, key: str, scalars: dict, meta: dict):
    def produce(_buffer) -> torch.Tensor:
        q = qstate_at(src, key, scalars, meta)
        divisor = None
        if q["transform"] == policy.RATIO_TRANSFORM:
            divisor = qstate_at(src, key[: key.rindex(".") + 1] + q["divisor"], scalars, meta)
        return quant.dequantize_state(q, divisor=divisor)
    return produce


def expand(src: str, dst: str, *, force: bool = False) -> dict:
    """A DCP folder with low-bit Adam moments -> the same folder with fp32 moments (torch AdamW resumes)."""
    md = read_metadata(src)
    meta = md.state_dict_metadata
    qkeys = quantized_keys(meta)
    if not qkeys:
        raise InputError(f"{src} holds no ckptq low-bit state; it is already expanded")
    p = Plan(exact={k: m for k, m in meta.items() if not any(k.startswith(f"{q}.") for q in qkeys)})
    p.scalars = _scalars(src, md)
    state, producers = _exact_entries(src, p, mine(sorted(p.exact)))
    for key in mine(qkeys):
        shape = tuple(p.scalars[f"{key}.shape"])
        try:
            dtype = float_dtype_from_name(p.scalars.get(f"{key}.dtype", "float32"), f"quantized state {key}")
        except Exception as e:
            raise InputError(f"{src}: {e}") from None
        state[key] = torch.empty(shape, dtype=dtype, device="meta")
        producers[key] = _decoder(src, key, p.scalars, meta)
    write_folder(dst, state, producers, force, src)
    return {"expanded": len(qkeys), "output_bytes": folder_bytes(dst) if os.path.isdir(dst) else 0}

