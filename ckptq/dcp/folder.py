"""``ckptq convert`` / ``expand`` / ``info`` of ``torch.distributed.checkpoint`` folders (``.metadata`` +
``__{rank}_{n}.distcp``): a plain ``dcp.save`` of ``{"model", "optimizer"}``, torchtitan's ``step-N/``,
accelerate's FSDP ``optimizer_0/``, Lightning's sharded ``.ckpt/``.

The output is a DCP folder that DCP's own tools read. Converting, every fp32 Adam moment (a key ending in
``.exp_avg``, ``.exp_avg_sq`` or ``.max_exp_avg_sq`` beside its ``.step``) whose rows are whole blocks is
written as the parts of a quantized state (``codes``, ``absmax``, ``qmap`` and scalars; docs/FORMAT.md §7),
exactly what ``AdamW8bit`` under FSDP2 or ``ckptq.dcp.SavePlanner`` write; everything else is copied bit
for bit. Expanding does the reverse. Memory: each tensor is read when the writer reaches it and dropped
after, so a process holds about one moment pair at a time. Under ``torchrun`` each rank converts a share
of the keys and ``dcp.save`` merges them into one folder.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..format import files
from ..codec import plan, policy, qstate, quant
from ..errors import InputError, OutputExistsError, UsageError
from . import safe_reader

_MOMENT = re.compile(r"^(?P<opt>.+)\.state\.(?P<fqn>.+)\.(?P<key>exp_avg|exp_avg_sq|max_exp_avg_sq)$")
_PARTS = ("codes", "absmax", "qmap")


def read_metadata(path: str):
    """The checked metadata of the DCP folder ``path``, read without running code (``safe_reader``)."""
    return safe_reader.load_metadata(path)


def _read(path: str, items: dict) -> dict:
    """Read ``items`` ({key: template}) from the folder in this process only (no collectives), safely."""
    return safe_reader.read_items(path, items)


@dataclass
class _Moment:
    key: str  # the flattened DCP key of an fp32 moment
    opt: str
    fqn: str
    role: str  # exp_avg, exp_avg_sq, max_exp_avg_sq
    shape: tuple
    meta: TensorStorageMetadata
    eps: float = 0.0  # eps' of the ratio (exp_avg only)


@dataclass
class Plan:
    moments: list[_Moment] = field(default_factory=list)
    exact: dict = field(default_factory=dict)  # key -> TensorStorageMetadata | BytesStorageMetadata
    scalars: dict = field(default_factory=dict)  # the values of the small entries (steps, param_groups)
    warnings: list[str] = field(default_factory=list)


def _scalars(path: str, md) -> dict:
    """Every small non-tensor entry (steps, param_groups) as Python values; the shape and divisor of each
    8-bit state checked, since expand allocates and pairs by them before any decoder looks."""
    keys = {k: None for k, m in md.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)}
    steps = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
             if k.endswith(".step") and isinstance(m, TensorStorageMetadata)}
    scalars = _read(path, {**keys, **steps}) if keys or steps else {}
    qkeys = set(_quantized_keys(md.state_dict_metadata))
    for key in qkeys:
        shape, divisor = scalars.get(f"{key}.shape"), scalars.get(f"{key}.divisor")
        codes = md.state_dict_metadata[f"{key}.codes"]
        most = codes.size.numel() * 8 // min(qstate.SUPPORTED_BITS) if isinstance(codes, TensorStorageMetadata) else 0
        if not (isinstance(shape, (list, tuple)) and all(type(d) is int and d >= 0 for d in shape)
                and math.prod(shape) <= most and (divisor is None or f"{key.rpartition('.')[0]}.{divisor}" in qkeys)):
            raise InputError(f"{path}: quantized state {key} has shape {shape!r:.60} for {most} elements at most, "
                             f"divisor {divisor!r:.40}; it is damaged or crafted")
    return scalars


def _group_value(scalars: dict, opt: str, fqn: str, name: str, default):
    if f"{opt}.param_groups.{fqn}.{name}" in scalars:  # flatten_optimizer_state_dict (torchtitan)
        return scalars[f"{opt}.param_groups.{fqn}.{name}"]
    for key, params in scalars.items():
        m = re.fullmatch(re.escape(opt) + r"\.param_groups\.(\d+)\.params", key)
        if m and isinstance(params, (list, tuple)) and fqn in map(str, params):
            return scalars.get(f"{opt}.param_groups.{m.group(1)}.{name}", default)
    return default


def make_plan(path: str, md, min_size: int, block_size: int) -> Plan:
    """Which keys of the folder convert stores 8-bit (whole-block rows, >= min_size, fp32/bf16/fp16)."""
    p, meta = Plan(), md.state_dict_metadata
    scalars = p.scalars = _scalars(path, md)
    for key, m in meta.items():
        found = _MOMENT.match(key)
        sq = f"{key}_sq" if key.endswith(".exp_avg") else None
        if found and isinstance(m, TensorStorageMetadata) and m.properties.dtype.is_floating_point and \
                len(m.size) and m.size.numel() >= min_size and (m.size.numel() // m.size[0]) % block_size == 0 \
                and (sq is None or (sq in meta and tuple(meta[sq].size) == tuple(m.size))):
            opt, fqn, role = found["opt"], found["fqn"], found["key"]
            step = scalars.get(f"{opt}.state.{fqn}.step", 0)
            group = {"eps": _group_value(scalars, opt, fqn, "eps", 1e-8),
                     "betas": _group_value(scalars, opt, fqn, "betas", (0.9, 0.999))}
            eps = policy.ratio_eps_for(group, step) if role == "exp_avg" else 0.0
            p.moments.append(_Moment(key, opt, fqn, role, tuple(m.size), m, eps))
        else:
            p.exact[key] = m
    return p


def _empty(m: TensorStorageMetadata) -> torch.Tensor:
    return torch.empty(tuple(m.size), dtype=m.properties.dtype)


def _by_param(moments: list[_Moment]) -> dict[tuple, list[_Moment]]:
    """A parameter's moments together: they are read, checked and quantized together (a ratio needs its
    second moment), and one rank handles all of them."""
    out: dict[tuple, list[_Moment]] = {}
    for mo in moments:
        out.setdefault((mo.opt, mo.fqn), []).append(mo)
    return out


def _read_dense(path: str, ms: list[_Moment]) -> dict:
    """A parameter's moments (and the second moment a ratio needs) as fp32, read in one pass."""
    keys = {mo.key: mo.shape for mo in ms}
    keys |= {f"{mo.key}_sq": mo.shape for mo in ms if mo.role == "exp_avg" and f"{mo.key}_sq" not in keys}
    return _read(path, {k: torch.empty(shape, dtype=torch.float32) for k, shape in keys.items()})


def _check(path: str, p: Plan, min_size: int) -> None:
    """Keep exact what 8 bits would damage (the rules of ``ckptq.plan``): NaN/Inf, beyond fp32, negative
    second moments, a first moment whose ratio would overflow. A parameter's moments stay exact together
    (a ratio needs its second moment quantized). Each rank checks its share of the parameters, reading
    each moment once, one parameter at a time; the ranks then share what they found."""
    found: list[tuple[tuple, str]] = []
    for pid, ms in _mine(list(_by_param(p.moments).items())):
        dense = _read_dense(path, ms)
        for mo in ms:
            t = dense[mo.key]
            reason = plan.exact_reason(mo.role, t, True, min_size, set())
            if not reason and mo.role == "exp_avg" and not plan.ratio_fits(t, dense[f"{mo.key}_sq"], mo.eps):
                reason = "its ratio would overflow float32"
            if reason:
                found.append((pid, f"{mo.key}: {reason}, kept exact"))
    if dist.is_initialized():
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, found)
        found = [f for rank in every for f in rank]
    bad = {pid for pid, _ in found}
    p.warnings += sorted(w for _, w in found)
    p.exact.update((mo.key, mo.meta) for mo in p.moments if (mo.opt, mo.fqn) in bad)
    p.moments = [mo for mo in p.moments if (mo.opt, mo.fqn) not in bad]


class _LazyWriter(DefaultSavePlanner):
    """Writes tensors that are produced when the writer reaches them (``producers[key](buffer)``), each
    through a buffer reused for every tensor of its dtype and shape: DCP's writer keeps a reference to every
    tensor it wrote to a file until the file is closed, so fresh tensors would pile up to the size of the
    output; reused buffers bound memory by the distinct shapes instead. A producer may fill the buffer it is
    given (exact tensors are read straight into it) or return another tensor, which is copied in."""

    def __init__(self, producers: dict):
        super().__init__()
        self.producers = producers
        self.buffers: dict = {}

    def resolve_data(self, write_item):
        produce = self.producers.get(write_item.index.fqn)
        if produce is None:
            return super().resolve_data(write_item)
        meta = write_item.tensor_data
        key = (meta.properties.dtype, tuple(meta.size))
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = torch.empty(key[1], dtype=key[0])
        t = produce(buf)
        return buf if t is buf else buf.copy_(t)


def _quantized_parts(src: str, ms: list[_Moment], block_size: int) -> dict:
    """The parts of one parameter's quantized moments: tensors by producer, scalars by value. The first
    part the writer asks for reads the moments once and quantizes them all; each part is dropped when written."""
    cache: dict = {}

    def quantize() -> dict:
        if not cache:
            dense = _read_dense(src, ms)
            for mo in ms:
                t = dense[mo.key]
                q = quant.quantize_ratio(t, dense[f"{mo.key}_sq"], mo.eps, block_size) if mo.role == "exp_avg" \
                    else quant.quantize_state(t, mo.role, block_size)
                cache[mo.key] = dict(codes=q["codes"].view(mo.shape), absmax=q["absmax"].view(mo.shape[0], -1),
                                     qmap=q["qmap"])
        return cache

    def part(key: str, name: str):
        return lambda _buffer: quantize()[key].pop(name)

    out: dict = {}
    for mo in ms:
        pol = policy.RATIO_POLICY if mo.role == "exp_avg" else policy.policy_for(mo.role)
        out |= {f"{mo.key}.ckptq": qstate.CODEC, f"{mo.key}.bits": 8, f"{mo.key}.block_size": block_size,
                f"{mo.key}.transform": pol.transform, f"{mo.key}.shape": list(mo.shape),
                f"{mo.key}.dtype": str(mo.meta.properties.dtype).removeprefix("torch.")}  # expand restores it
        if mo.role == "exp_avg":
            out |= {f"{mo.key}.eps": float(mo.eps), f"{mo.key}.divisor": "exp_avg_sq"}
        rows = mo.shape[0]
        out |= {f"{mo.key}.codes": (torch.empty(mo.shape, dtype=torch.uint8, device="meta"), part(mo.key, "codes")),
                f"{mo.key}.absmax": (torch.empty(rows, _per_row(mo.shape, block_size), device="meta"),
                                     part(mo.key, "absmax")),
                f"{mo.key}.qmap": (torch.empty(256, device="meta"), part(mo.key, "qmap"))}
    return out


def _per_row(shape: tuple, block_size: int) -> int:
    return (torch.Size(shape).numel() // shape[0]) // block_size


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


def _mine(keys: list) -> list:
    """This rank's share of the keys under torchrun (all of them in one process)."""
    if not dist.is_initialized():
        return keys
    return keys[dist.get_rank()::dist.get_world_size()]


def _copy_companions(src: str, dst: str) -> None:
    """Files beside the DCP data that the framework reads too (Lightning's ``meta.pt``), copied as they are."""
    for name, kind in safe_reader.companions(src):
        source, target = os.path.join(src, name), os.path.join(dst, name)
        if kind == "folder":
            os.mkdir(target)
            shutil.copymode(source, target)
        elif kind == "link":
            os.symlink(os.readlink(source), target)
        else:
            with files.open_regular(source, "companion file") as f, open(target, "wb") as out:
                shutil.copyfileobj(f, out)
            shutil.copystat(source, target)


def write_folder(dst: str, state: dict, producers: dict, force: bool, src: str | None = None) -> None:
    """``dcp.save`` of ``state`` (meta tensors produced lazily) into ``dst``, all or nothing: a temp folder
    beside it, renamed into place (by rank 0 under torchrun, after every rank wrote). The other files of
    ``src`` (e.g. Lightning's ``meta.pt``) come along."""
    from torch.distributed.checkpoint import FileSystemWriter

    distributed = dist.is_initialized()
    if os.path.exists(dst) and not force:
        raise OutputExistsError(f"{dst} exists; pass --force to overwrite it")
    tmp = f"{dst.rstrip('/')}.ckptq-tmp"
    if not distributed or dist.get_rank() == 0:
        files.remove_path(tmp)
        os.makedirs(tmp)
        try:
            if src:
                _copy_companions(src, tmp)
        except BaseException:
            files.remove_path(tmp)
            raise
    if distributed:
        dist.barrier()
    writer = FileSystemWriter(tmp, single_file_per_rank=True, thread_count=1, sync_files=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, storage_writer=writer, planner=_LazyWriter(producers), no_dist=not distributed)
    except BaseException as e:
        if not distributed or dist.get_rank() == 0:
            files.remove_path(tmp)
        if isinstance(e, CheckpointException):  # DCP wraps what a rank raised: say it in one line
            last = [line for line in str(e).splitlines() if line.strip()][-1:] or ["unknown error"]
            raise InputError(f"writing {dst} failed: {last[0].strip()[:300]}") from None
        raise
    if distributed:
        dist.barrier()
    if not distributed or dist.get_rank() == 0:
        files.remove_path(dst)
        os.replace(tmp, dst)


def join_torchrun() -> None:
    """Under torchrun (WORLD_SIZE > 1) join its process group, so that ranks share the work."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")


def leave_torchrun() -> None:
    """After a successful write, leave the group together: a rank that tears gloo down while another
    still talks to it aborts with SIGABRT. (After an error torchrun ends the other ranks.)"""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def convert(src: str, dst: str, *, block_size: int = 256, min_size: int = policy.DEFAULT_MIN_SIZE,
            force: bool = False, bits: int = 8) -> dict:
    """Convert a DCP folder's fp32 Adam moments to 8-bit; returns a report dict."""
    if bits != 8:
        raise UsageError(f"{bits}-bit state is not supported for DCP folders yet; convert them with --bits 8")
    join_torchrun()
    md = read_metadata(src)
    p = make_plan(src, md, min_size, block_size)
    _check(src, p, min_size)
    if not p.moments:
        raise InputError(f"{src}: no fp32 Adam moment (…state.<fqn>.exp_avg / exp_avg_sq) with {min_size} elements "
                         f"or more and rows of whole {block_size}-blocks; nothing to store 8-bit")
    state, producers = _exact_entries(src, p, _mine(list(p.exact)))
    for _, ms in _mine(list(_by_param(p.moments).items())):
        for key, value in _quantized_parts(src, ms, block_size).items():
            state[key], producers[key] = value if isinstance(value, tuple) else (value, None)
    write_folder(dst, state, {k: f for k, f in producers.items() if f}, force, src)
    leave_torchrun()
    return {"source": src, "output": dst, "quantized": len(p.moments), "exact": len(p.exact),
            "warnings": p.warnings, "source_bytes": _folder_bytes(src),
            "output_bytes": _folder_bytes(dst) if os.path.isdir(dst) else 0}


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _quantized_keys(meta: dict) -> list[str]:
    return [k[: -len(".codes")] for k in meta if k.endswith(".codes") and f"{k[: -len('.codes')]}.ckptq" in meta]


def _qstate_at(src: str, key: str, scalars: dict, meta: dict) -> dict:
    names = ("ckptq", "bits", "block_size", "transform", "shape", "dtype", "eps", "divisor")
    q = {n: scalars[f"{key}.{n}"] for n in names if f"{key}.{n}" in scalars}
    parts = _read(src, {f"{key}.{n}": _empty(meta[f"{key}.{n}"]) for n in _PARTS})
    q |= {n: parts[f"{key}.{n}"].reshape(-1) if n != "qmap" else parts[f"{key}.{n}"] for n in _PARTS}
    q["shape"] = tuple(q.get("shape", ()))
    try:
        qstate.QState.from_dict(q)
    except Exception as e:
        raise InputError(f"{src}: quantized state {key} is damaged: {e}") from None
    return q


def _decoder(src: str, key: str, scalars: dict, meta: dict):
    def produce(_buffer) -> torch.Tensor:
        q = _qstate_at(src, key, scalars, meta)
        divisor = None
        if q["transform"] == policy.RATIO_TRANSFORM:
            divisor = _qstate_at(src, key[: key.rindex(".") + 1] + q["divisor"], scalars, meta)
        return quant.dequantize_state(q, divisor=divisor)
    return produce


def expand(src: str, dst: str, *, force: bool = False) -> dict:
    """A DCP folder with 8-bit Adam moments -> the same folder with fp32 moments (torch AdamW resumes)."""
    join_torchrun()
    md = read_metadata(src)
    meta = md.state_dict_metadata
    qkeys = _quantized_keys(meta)
    if not qkeys:
        raise InputError(f"{src} holds no ckptq 8-bit state; it is already expanded")
    p = Plan(exact={k: m for k, m in meta.items() if not any(k.startswith(f"{q}.") for q in qkeys)})
    p.scalars = _scalars(src, md)
    state, producers = _exact_entries(src, p, _mine(list(p.exact)))
    for key in _mine(qkeys):
        shape = tuple(p.scalars[f"{key}.shape"])
        dtype = getattr(torch, str(p.scalars.get(f"{key}.dtype", "float32")), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InputError(f"{src}: quantized state {key} names dtype {p.scalars.get(f'{key}.dtype')!r}; it is damaged")
        state[key] = torch.empty(shape, dtype=dtype, device="meta")
        producers[key] = _decoder(src, key, p.scalars, meta)
    write_folder(dst, state, producers, force, src)
    leave_torchrun()
    return {"source": src, "output": dst, "expanded": len(qkeys), "output_bytes": _folder_bytes(dst)
            if os.path.isdir(dst) else 0}


def info(path: str, *, min_size: int = policy.DEFAULT_MIN_SIZE, block_size: int = 256) -> dict:
    """What a DCP folder holds and what convert would store 8-bit (before its NaN/Inf check)."""
    md = read_metadata(path)
    meta = md.state_dict_metadata
    p = make_plan(path, md, min_size, block_size)
    qkeys = _quantized_keys(meta)
    fp32 = sum(m.size.numel() * m.properties.dtype.itemsize for k, m in meta.items()
               if isinstance(m, TensorStorageMetadata) and _MOMENT.match(k))
    return {"kind": "dcp", "path": path, "bytes": _folder_bytes(path), "keys": len(meta),
            "moments_8bit": len(qkeys), "moments_fp32": sum(1 for k in meta if _MOMENT.match(k)),
            "fp32_moment_bytes": fp32, "convert_would_quantize": len(p.moments)}
