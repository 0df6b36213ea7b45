"""Checkpoint trees <-> a JSON skeleton plus a flat list of stored tensors.

``flatten(obj)`` turns any object that ``torch.load(weights_only=True)`` can return into a JSON-able
*skeleton* and a list of :class:`Stored` tensors (what goes into the safetensors file);
``unflatten(skeleton, fetch)`` rebuilds the object. Node encodings are specified in docs/FORMAT.md.

Tensors that share storage (tied weights, views of one buffer) are stored once, as the storage span,
and every tensor that uses it becomes a view (offset, shape, stride) of it, so sharing survives.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import plan, policy, qstate, quant, skeleton
from .checkpoint import storage_key
from ..format.dtypes import SAFETENSORS_NAMES, dtype_from_name, dtype_name
from ..format.container import Container
from ..format.safetensors_io import Stored
from ..format.torch_stream import contiguous_strides
from ..errors import FormatError, UsageError

@dataclass
class PendingQuant:
    """A state tensor to be quantized when the writer reaches it (lazy: bounded memory)."""

    tensor: torch.Tensor
    key: str
    block_size: int
    backend: str = "auto"
    divisor: tuple | None = None  # (sibling key, its exact tensor, eps'): store as a ratio state
    device: str = "cpu"  # where quantization runs ("cuda": the Triton kernels); inputs stay on the CPU
    bits: int = 8  # code width: 8, 6, 4 or 2 (``policy.convert_width``)
    layout: str = "rows"  # "rows" (what convert writes) or "flat" (re-creating a file of format 1 or 2)
    role: str | None = None  # its role (``ckptq.codec.roles``): which policy it gets; None: by its Adam key
    _result: dict | None = field(default=None, repr=False)

    def result(self) -> dict:
        if self._result is None:
            self._result = quant.quantize_as(self.tensor.to(self.device), self.key, self.block_size, self.bits,
                                             self.divisor, self.backend, self.layout, self.role)
        return self._result

    def take(self, part: str) -> torch.Tensor:
        out = self.result()[part]
        if part == "absmax":  # absmax is written after codes: free the memo
            self._result = None
        return out.cpu()


def mark(obj: Any, key: str | None, block_size: int, min_size: int, bits: int = 8, backend: str = "auto",
         device: str = "cpu") -> plan.Plan:
    """The plan for ``obj``, applied: each state it stores low-bit replaced, in place, by a lazy
    ``PendingQuant`` (quantized when a writer reaches it, on ``device``), in the row layout at the width
    ``convert_width`` gives it under the budget ``bits``. ``convert`` writes the result; ``info`` sizes it."""
    p = plan.make_plan(obj, key, min_size, block_size, bits)
    for d in p.quantized:
        node = obj
        for k in d.path:
            node = node[k]
        node[d.key] = PendingQuant(d.tensor, d.key, block_size, backend, divisor=d.divisor, device=device,
                                   bits=plan.convert_width(d, bits), role=d.role)
    return p


def _text(s: str, path: str) -> str:
    """A string as the header's UTF-8 JSON holds it; a lone surrogate (which no UTF-8 can hold) refused."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"cannot store the string {s!r:.60} at {path or '/'}: it holds a lone surrogate, which is not "
                         "valid Unicode and cannot be written as UTF-8; fix the key or value") from None
    return s


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


class _Flattener:
    def __init__(self):
        self.stored: list[Stored] = []
        self.names: set[str] = set()
        self.storages: dict[tuple, list] = {}  # storage key -> [data name, stored dtype]
        self.codebooks: dict[tuple, str] = {}

    def unique(self, name: str) -> str:
        base, n = name or "root", 1
        while name in self.names or not name:
            name, n = f"{base}~{n}", n + 1
        self.names.add(name)
        return name

    def add(self, name, dtype, shape, produce, role="exact") -> str:
        name = self.unique(name)
        self.stored.append(Stored(name, dtype, tuple(shape), produce, role))
        return name

    def node(self, obj: Any, path: str) -> Any:
        if isinstance(obj, str):
            return _text(obj, path)
        if obj is None or isinstance(obj, bool):
            return obj
        if isinstance(obj, int):
            return obj
        if isinstance(obj, float):
            return {"float": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if isinstance(obj, PendingQuant):
            return self.quantized(obj, path)
        if qstate.is_qstate(obj):
            return self.quantized(obj, path)
        if isinstance(obj, dict):
            return self.mapping(obj, path)
        if isinstance(obj, torch.Size):
            return {"size": list(obj)}
        if isinstance(obj, (list, tuple)):
            kind = "list" if isinstance(obj, list) else "tuple"
            return {kind: [self.node(v, _join(path, i)) for i, v in enumerate(obj)]}
        if isinstance(obj, torch.dtype):
            return {"dtype": dtype_name(obj)}
        if isinstance(obj, torch.device):
            return {"device": str(obj)}
        raise UsageError(f"cannot store {type(obj).__name__} at {path or '/'}: ckptq stores what "
                         "torch.load(weights_only=True) returns (tensors, dicts, lists, numbers, strings)")

    def mapping(self, obj: dict, path: str) -> dict:
        items = [[self.node(k, _join(path, "<key>")), self.node(v, _join(path, k))] for k, v in obj.items()]
        if type(obj) is dict:
            return {"dict": items}
        if isinstance(obj, collections.OrderedDict):
            node = {"odict": items}
            meta = getattr(obj, "_metadata", None)  # nn.Module.state_dict() version info
            if meta is not None:
                node["_metadata"] = self.node(meta, _join(path, "_metadata"))
            return node
        raise UsageError(f"cannot store {type(obj).__name__} at {path}: only dict and OrderedDict mappings")

    def tensor(self, t: torch.Tensor, path: str) -> dict:
        if not (t.dtype in SAFETENSORS_NAMES or t.dtype.is_complex) or t.layout != torch.strided:
            kind = t.dtype if t.layout == torch.strided else t.layout
            raise UsageError(f"cannot store the {str(kind).removeprefix('torch.')} tensor at {path or '/'}: ckptq "
                             "stores dense tensors of the safetensors dtypes (and complex ones), and writes nothing "
                             "it could not read back; dequantize or densify it first")
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        key = storage_key(t)
        node = {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        if isinstance(t, torch.nn.Parameter):
            node["parameter"] = True
        whole = (t.stride() == contiguous_strides(t.shape) and t.storage_offset() == 0
                 and t.numel() * t.element_size() == nbytes)
        if key not in self.storages:
            if whole or t.dtype not in SAFETENSORS_NAMES:
                stored_dtype, shape = (t.dtype, t.shape) if t.dtype in SAFETENSORS_NAMES else (torch.uint8, (nbytes,))
                src = t if t.dtype in SAFETENSORS_NAMES else torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            else:
                stored_dtype, shape = t.dtype, (nbytes // t.element_size(),)
                src = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, shape)
            name = self.add(path, stored_dtype, shape, lambda s=src: s.detach().contiguous().cpu())
            self.storages[key] = [name, stored_dtype]
        name, stored_dtype = self.storages[key]
        node["data"] = name
        if not (whole and stored_dtype == t.dtype):
            node["offset"] = t.storage_offset()
            node["stride"] = list(t.stride())
        return {"tensor": node}

    def quantized(self, q, path: str) -> dict:
        lazy = isinstance(q, PendingQuant)
        if lazy:
            pol = policy.ratio_policy(q.bits) if q.divisor else policy.policy_for(q.key, q.bits, q.role)
            qmap, bits, layout = pol.qmap(), q.bits, q.layout
            meta = {"block_size": q.block_size, "transform": pol.transform,
                    "shape": list(q.tensor.shape), "dtype": dtype_name(q.tensor.dtype)}
            if q.divisor:
                meta |= {"eps": q.divisor[2], "divisor": q.divisor[0]}
        else:
            qs = qstate.QState.from_dict(q)
            qmap, bits, layout = qs.qmap, qs.bits, qs.layout
            meta = {"block_size": qs.block_size, "transform": qs.transform, "dtype": qs.dtype}
            meta |= {"eps": qs.eps, "divisor": qs.divisor} if qs.is_ratio else {}
            meta["shape"] = list(qs.shape)
        if layout != "flat":
            meta["layout"] = layout
        codes_shape, absmax_shape = qstate.layout_shapes(meta["shape"], bits, meta["block_size"], layout)
        get = (lambda part, shape: q.take(part).view(shape)) if lazy else \
            (lambda part, shape: q[part].detach().contiguous().cpu().view(shape))
        codes = self.add(_join(path, "codes"), torch.uint8, codes_shape, lambda: get("codes", codes_shape), "codes")
        absmax = self.add(_join(path, "absmax"), torch.float32, absmax_shape, lambda: get("absmax", absmax_shape), "absmax")
        return {"quantized": {"codec": qstate.CODEC, "bits": bits, "codes": codes, "absmax": absmax,
                              "qmap": self.codebook(qmap), **meta}}

    def codebook(self, qmap: torch.Tensor) -> str:
        qmap = qmap.detach().to("cpu", torch.float32).contiguous()
        key = tuple(qmap.tolist())
        if key not in self.codebooks:
            self.codebooks[key] = self.add(f"codebooks/{len(self.codebooks)}", torch.float32, (qmap.numel(),),
                                           lambda: qmap, "codebook")
        return self.codebooks[key]


def flatten(obj: Any) -> tuple[Any, list[Stored]]:
    """Skeleton (JSON-able) and the tensors to store, in write order."""
    f = _Flattener()
    skeleton = f.node(obj, "")
    return skeleton, f.stored


def unflatten(skeleton: Any, fetch: Callable[[str], torch.Tensor], dequantize: bool = False,
              lazy: bool = False, numel_of: Callable[[str], int] | None = None) -> Any:
    """Rebuild the object. ``fetch(name)`` returns a stored tensor; each name is fetched once, so
    views of one stored storage share it again. Quantized states come back as qstate dicts, or as
    dense tensors with ``dequantize=True``. With ``lazy=True`` whole tensors and dequantized states
    become :class:`~ckptq.torch_stream.LazyTensor` placeholders, fetched only when written (views
    too, when ``numel_of(name)`` gives a stored tensor's element count)."""
    u = _Unflattener(fetch, dequantize, lazy, numel_of)
    return _finalize(u, u.node(skeleton), None)


class _Unflattener:
    def __init__(self, fetch, dequantize: bool, lazy: bool, numel_of=None):
        self.fetch, self.dequantize, self.lazy, self.numel_of = fetch, dequantize, lazy, numel_of
        self.cache: dict[str, torch.Tensor] = {}
        self.lazy_storages: dict[str, Any] = {}

    def get(self, name: str) -> torch.Tensor:
        if name not in self.cache:
            self.cache[name] = self.fetch(name)
        return self.cache[name]

    def node(self, n: Any) -> Any:
        if n is None or isinstance(n, (bool, int, str)):
            return n
        if isinstance(n, dict) and len(n) >= 1:
            build = _BUILDERS.get(next(iter(n)))
            if build is not None:
                return build(n, self)
        raise FormatError(f"unknown skeleton node {str(n)[:80]!r}; the file is corrupt or newer than this ckptq")

    def lazy_tensor(self, key: str, dtype: torch.dtype, shape: tuple, produce, parameter: bool = False,
                    numel: int | None = None, stride: tuple | None = None, offset: int = 0):
        from ..format.torch_stream import LazyStorage, LazyTensor

        if key not in self.lazy_storages:
            self.lazy_storages[key] = LazyStorage(dtype, math.prod(shape) if numel is None else numel, produce)
        return LazyTensor(self.lazy_storages[key], shape, parameter, stride, offset)


def _build_tensor(n, u: _Unflattener):
    from ..format.torch_stream import can_stream

    spec = n["tensor"]
    dtype, shape = dtype_from_name(spec["dtype"]), tuple(spec["shape"])
    if u.lazy and can_stream(dtype) and ("stride" not in spec or u.numel_of is not None):
        whole = "stride" not in spec  # else a view of the stored (flat) storage, same dtype
        numel = None if whole else u.numel_of(spec["data"], dtype)
        if whole or numel is not None:
            return u.lazy_tensor(spec["data"], dtype, shape, lambda: u.fetch(spec["data"]).reshape(-1),
                                 bool(spec.get("parameter")), numel, spec.get("stride"), spec.get("offset", 0))
    base = u.get(spec["data"])
    if base.dtype != dtype:
        base = base.reshape(-1).view(dtype)
    if "stride" in spec:
        t = base.reshape(-1).as_strided(shape, tuple(spec["stride"]), spec["offset"])
    else:
        t = base.reshape(shape)
    return torch.nn.Parameter(t, requires_grad=t.is_floating_point()) if spec.get("parameter") else t


@dataclass
class _QRef:
    """A quantized node awaiting decoding: a ratio state needs its sibling divisor first."""

    spec: dict
    build: Callable[[], dict]


def _build_quantized(n, u: _Unflattener):
    spec = n["quantized"]
    qstate.check_qstate({"ckptq": spec.get("codec"), "bits": spec.get("bits"), "transform": spec.get("transform"),
                         "layout": spec.get("layout", "flat")})
    if spec.get("block_size") not in policy.BLOCK_SIZES:
        raise FormatError(f"quantized state {spec.get('codes')!r} has block size {spec.get('block_size')!r}; "
                          "the file is corrupt or newer than this ckptq")

    def build() -> dict:
        q = qstate.QState(u.fetch(spec["codes"]), u.fetch(spec["absmax"]), u.get(spec["qmap"]), spec["block_size"],
                          spec["transform"], tuple(spec["shape"]), spec["dtype"], spec["bits"], spec.get("eps"),
                          spec.get("divisor"), spec.get("layout", "flat"))
        codes, absmax = qstate.layout_shapes(q.shape, q.bits, q.block_size, q.layout)
        if tuple(q.codes.shape) != codes or tuple(q.absmax.shape) != absmax or q.qmap.numel() != 2**q.bits:
            raise FormatError(f"quantized state {spec['codes']!r}: codes, scales and shape {list(q.shape)} "
                              "disagree; the file is corrupt")
        return q.to_dict()

    return _QRef(spec, build) if u.dequantize else build()


def _finalize(u: _Unflattener, value: Any, siblings: dict | None) -> Any:
    """Decode a _QRef (to a tensor, or a lazy one), finding a ratio state's divisor among its siblings."""
    if not isinstance(value, _QRef):
        return value
    ratio = value.spec["transform"] == policy.RATIO_TRANSFORM
    divisor = (siblings or {}).get(value.spec.get("divisor")) if ratio else None  # no key: not a lookup of None
    if ratio and not isinstance(divisor, _QRef):
        raise FormatError(f"ratio state {value.spec['codes']!r} has no quantized sibling "
                          f"{value.spec.get('divisor')!r}; the file is corrupt")

    def produce() -> torch.Tensor:
        return quant.dequantize_state(value.build(), divisor=divisor.build() if divisor is not None else None)

    if u.lazy:
        return u.lazy_tensor(value.spec["codes"], dtype_from_name(value.spec["dtype"]), tuple(value.spec["shape"]), produce)
    return produce()


def _build_mapping(n, u: _Unflattener):
    kind = next(iter(n))
    out = {} if kind == "dict" else collections.OrderedDict()
    for k, v in n[kind]:
        out[u.node(k)] = u.node(v)
    refs = dict(out)
    for k, v in refs.items():
        out[k] = _finalize(u, v, refs)
    if "_metadata" in n:
        out._metadata = u.node(n["_metadata"])
    return out


_BUILDERS = {
    "float": lambda n, u: float(n["float"]),
    "tensor": _build_tensor,
    "quantized": _build_quantized,
    "dict": _build_mapping,
    "odict": _build_mapping,
    "list": lambda n, u: [_finalize(u, u.node(v), None) for v in n["list"]],
    "tuple": lambda n, u: tuple(_finalize(u, u.node(v), None) for v in n["tuple"]),
    "size": lambda n, u: torch.Size(n["size"]),
    "dtype": lambda n, u: dtype_from_name(n["dtype"]),
    "device": lambda n, u: torch.device(n["device"]),
}


class Converted(Container):
    """An open converted checkpoint (single file or shards): bytes validated on open (``Container``), and
    the skeleton checked against the tensor table (``ckptq.codec.skeleton``) before anything is decoded."""

    def __init__(self, path: str, verify: bool = True):
        super().__init__(path, verify)
        try:
            skeleton.check_skeleton(self.skeleton, self.tensors, path, self.version)
        except BaseException:
            self.close()
            raise

    def states(self):
        """(role, code width or None, elements, stored bytes) of every quantized state (its role: its state
        key) and of every other stored tensor (role "exact", or "codebooks")."""
        quantized, codebooks = set(), set()
        for key, q in _quantized_specs(self.skeleton, None):
            numel = math.prod(int(d) for d in q["shape"])
            yield str(key), q["bits"], numel, self.stored_bytes(q["codes"]) + self.stored_bytes(q["absmax"])
            quantized |= {q["codes"], q["absmax"]}
            codebooks.add(q["qmap"])
        for name, row in self.tensors.items():
            if name not in quantized:
                numel = math.prod(int(d) for d in row.get("shape", []))
                yield ("codebooks" if name in codebooks else "exact"), None, numel, self.stored_bytes(name)

    def block_sizes(self) -> list[int]:
        """The block sizes its quantized states use."""
        return sorted({q["block_size"] for _, q in _quantized_specs(self.skeleton, None)})

    def read(self, dequantize: bool = False, lazy: bool = False) -> Any:
        """The checkpoint object; quantized states as qstate dicts, or decoded with ``dequantize``; with
        ``lazy``, tensors are produced when a writer reaches them (``unflatten``)."""
        try:
            return unflatten(self.skeleton, self.fetch, dequantize, lazy, self.numel_as)
        except (KeyError, TypeError, ValueError, AttributeError, AssertionError, IndexError, RecursionError) as e:
            # check_skeleton admits only what decodes; this is the backstop that keeps it one line
            raise FormatError(f"{self.path}: the skeleton does not decode ({type(e).__name__}: "
                              f"{str(e)[:100]}); the file is corrupt") from None


def _quantized_specs(node: Any, key: Any):
    """(state key, spec) of every quantized node of a skeleton."""
    if isinstance(node, dict):
        if "quantized" in node:
            yield key, node["quantized"]
            return
        if "tensor" in node:
            return
        for kind in ("dict", "odict"):
            for k, v in node.get(kind, []):
                yield from _quantized_specs(v, k)
        for kind in ("list", "tuple"):
            for v in node.get(kind, []):
                yield from _quantized_specs(v, key)
