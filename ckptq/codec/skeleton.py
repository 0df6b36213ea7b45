"""Validating a skeleton against the tensor table before anything is decoded or written.

A skeleton that passes decodes without surprises: every node is one of the kinds in docs/FORMAT.md
with exactly its fields, of the right types; nesting is at most MAX_DEPTH deep; every tensor view lies
inside its stored tensor (offset, strides and shape checked element by element, no negative strides);
whole tensors have exactly their stored tensor's size; quantized states name stored codes, scales and
codebook of exactly the sizes their shape and block size imply; dtype and device names are ones torch
reads back. Because sizes are tied to the table here, no later step allocates more than the skeleton
asks for. Every failure is a one-line FormatError naming the node.
"""

from __future__ import annotations

import math
import re

import torch

from . import policy, qstate
from ..errors import FormatError
from ..format.dtypes import FROM_SAFETENSORS, SAFETENSORS_NAMES, dtype_from_name
from ..format.reader import check_shape

MAX_DEPTH = 100
_FIELDS = {
    "tensor": ({"data", "dtype", "shape"}, {"offset", "stride", "parameter"}),
    "quantized": ({"codec", "bits", "codes", "absmax", "qmap", "block_size", "transform", "shape", "dtype"},
                  {"eps", "divisor", "layout"}),
}
_DEVICE = re.compile(r"[a-z][a-z_]{0,15}(:[0-9]{1,3})?")


def check_skeleton(skeleton, rows: dict[str, dict], where: str, version: int = 3) -> None:
    """Raise FormatError unless ``skeleton`` is well-formed and fits ``rows`` (stored name -> table row)."""
    _Checker(rows, where, version).node(skeleton, "/", 0)


def _bad(where: str, at: str, what: str) -> FormatError:
    return FormatError(f"{where}: skeleton node {at[:120]} {what}; the file is corrupt")


class _Checker:
    def __init__(self, rows: dict, where: str, version: int = 3):
        self.version = version
        self.rows, self.where = rows, where

    def fail(self, at: str, what: str) -> FormatError:
        return _bad(self.where, at, what)

    def node(self, n, at: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise self.fail(at, f"is nested more than {MAX_DEPTH} deep")
        if n is None or isinstance(n, (bool, int, str)):
            return
        if not (isinstance(n, dict) and n):
            raise self.fail(at, f"is not a node ({type(n).__name__})")
        kind = next(iter(n))
        check = getattr(self, "k_" + kind, None)
        if check is None:
            raise self.fail(at, f"has unknown kind {kind[:40]!r} (or the file is newer than this ckptq)")
        check(n, f"{at}{kind}", depth)

    def _only(self, n: dict, at: str, required: set, optional: set = frozenset()) -> None:
        keys = set(n)
        if not required <= keys or keys - required - optional:
            raise self.fail(at, f"has fields {sorted(keys)[:8]}, expected {sorted(required)} (+ {sorted(optional)})")

    def k_float(self, n, at, depth):
        self._only(n, at, {"float"})
        try:
            float(n["float"]) if isinstance(n["float"], str) else float("x")
        except ValueError:
            raise self.fail(at, f"holds {str(n['float'])[:40]!r}, not a float") from None

    def k_list(self, n, at, depth):
        kind = next(iter(n))
        self._only(n, at, {kind})
        if not isinstance(n[kind], list):
            raise self.fail(at, "is not a list")
        for i, v in enumerate(n[kind]):
            self.node(v, f"{at}/{i}/", depth + 1)

    k_tuple = k_list

    def k_dict(self, n, at, depth):
        kind = next(iter(n))
        self._only(n, at, {kind}, {"_metadata"} if kind == "odict" else set())
        items = n[kind]
        if not (isinstance(items, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in items)):
            raise self.fail(at, "is not a list of [key, value] pairs")
        for k, v in items:
            if not _hashable(k):
                raise self.fail(at, "has an unhashable key")
            self.node(k, f"{at}/<key>/", depth + 1)
            self.node(v, f"{at}/{str(k)[:40]}/", depth + 1)
        if "_metadata" in n:
            self.node(n["_metadata"], f"{at}/_metadata/", depth + 1)
        self._ratio_siblings({k: v for k, v in items if isinstance(k, (str, int))}, at)

    k_odict = k_dict

    def k_size(self, n, at, depth):
        self._only(n, at, {"size"})
        if not (isinstance(n["size"], list) and all(type(d) is int and 0 <= d < 2**63 for d in n["size"])):
            raise self.fail(at, "is not a list of sizes")

    def k_dtype(self, n, at, depth):
        self._only(n, at, {"dtype"})
        dtype_of(n["dtype"], self.fail, at)

    def k_device(self, n, at, depth):
        self._only(n, at, {"device"})
        name = n["device"]
        try:
            ok = isinstance(name, str) and _DEVICE.fullmatch(name) and str(torch.device(name)) == name
        except RuntimeError:
            ok = False
        if not ok:
            raise self.fail(at, f"names device {str(name)[:40]!r}, which torch cannot read back")

    def k_tensor(self, n, at, depth):
        spec = n["tensor"]
        self._fields(spec, "tensor", at)
        dtype = dtype_of(spec["dtype"], self.fail, at)
        if not (dtype in SAFETENSORS_NAMES or dtype.is_complex):
            raise self.fail(at, f"is a tensor of dtype {dtype}, which ckptq does not store")
        shape = check_shape(spec["shape"], f"{self.where}: skeleton node {at}")
        row = self._row(spec["data"], at)
        stored_bytes = math.prod(row["shape"]) * FROM_SAFETENSORS[row["dtype"]].itemsize
        if not isinstance(spec.get("parameter", False), bool):
            raise self.fail(at, "has a non-boolean 'parameter'")
        if ("stride" in spec) != ("offset" in spec):
            raise self.fail(at, "has only one of 'stride' and 'offset'")
        if "stride" not in spec:  # a whole tensor is stored as itself (else the writer adds stride/offset)
            if math.prod(shape) * dtype.itemsize != stored_bytes:
                raise self.fail(at, f"needs {math.prod(shape) * dtype.itemsize} bytes, its stored tensor has {stored_bytes}")
            if SAFETENSORS_NAMES.get(dtype) != row["dtype"]:
                raise self.fail(at, f"is a whole {dtype} tensor stored as {row['dtype']}")
            return
        self._view(spec, shape, dtype, stored_bytes, at)

    def _view(self, spec, shape, dtype, stored_bytes, at):
        stride, offset = spec["stride"], spec["offset"]
        if not (isinstance(stride, list) and len(stride) == len(shape)
                and all(type(s) is int and 0 <= s < 2**63 for s in stride) and type(offset) is int and 0 <= offset < 2**63):
            raise self.fail(at, f"has an invalid stride {str(stride)[:60]} or offset {str(offset)[:20]}")
        if stored_bytes % dtype.itemsize:
            raise self.fail(at, f"views {stored_bytes} stored bytes as {dtype}, which does not divide them")
        # an empty view still sits at its offset, which torch.save writes and torch.load checks
        extent = offset if 0 in shape else offset + 1 + sum((d - 1) * s for d, s in zip(shape, stride))
        if extent > stored_bytes // dtype.itemsize:
            raise self.fail(at, f"reaches element {extent} of a storage of {stored_bytes // dtype.itemsize}")

    def k_quantized(self, n, at, depth):
        spec = n["quantized"]
        self._fields(spec, "quantized", at)
        if type(spec["bits"]) is not int or not isinstance(spec["transform"], str):
            raise self.fail(at, "has a malformed 'bits' or 'transform'")
        if spec["codec"] != qstate.CODEC or spec["bits"] not in qstate.SUPPORTED_BITS or spec["transform"] not in policy.TRANSFORMS:
            raise FormatError(f"{self.where}: quantized state {at[:80]} uses codec {str(spec['codec'])[:20]!r} with "
                              f"{spec['bits']} bits, transform {spec['transform'][:20]!r}, which this ckptq cannot "
                              f"decode (it reads {qstate.CODEC!r}, {qstate.SUPPORTED_BITS} bits, {policy.TRANSFORMS}); "
                              "upgrade ckptq")
        if spec["block_size"] not in policy.BLOCK_SIZES or type(spec["block_size"]) is not int:
            raise self.fail(at, f"has block size {str(spec['block_size'])[:20]}")
        if not dtype_of(spec["dtype"], self.fail, at).is_floating_point:
            raise self.fail(at, f"has dtype {spec['dtype']}, not a float dtype")
        shape = check_shape(spec["shape"], f"{self.where}: skeleton node {at}")
        layout = spec.get("layout", "flat")
        if layout not in policy.LAYOUTS or (layout != "flat" and self.version < 3):
            raise self.fail(at, f"has layout {str(layout)[:20]!r}")
        codes, absmax = qstate.layout_shapes(shape, spec["bits"], spec["block_size"], layout)
        parts = (("codes", "U8", list(codes)), ("absmax", "F32", list(absmax)), ("qmap", "F32", [2 ** spec["bits"]]))
        for part, dtype, size in parts:
            row = self._row(spec[part], at)
            if row["dtype"] != dtype or row["shape"] != size:
                raise self.fail(at, f"names {part} {row['dtype']} {row['shape'][:4]}, expected {dtype} {size}")
        if spec["transform"] == policy.RATIO_TRANSFORM:
            eps = spec.get("eps")
            if not (type(eps) in (int, float) and math.isfinite(eps) and isinstance(spec.get("divisor"), (str, int))):
                raise self.fail(at, "is a ratio state without a finite eps and a divisor key")

    def _ratio_siblings(self, items: dict, at: str) -> None:
        for key, v in items.items():
            q = v.get("quantized") if isinstance(v, dict) and len(v) == 1 else None
            if not (isinstance(q, dict) and q.get("transform") == policy.RATIO_TRANSFORM):
                continue
            d = items.get(q.get("divisor"))
            dq = d.get("quantized") if isinstance(d, dict) and len(d) == 1 else None
            layout = q.get("layout", "flat")
            if not (isinstance(dq, dict) and dq.get("transform") == "sqrt" and dq.get("layout", "flat") == layout
                    and (dq["shape"] == q["shape"] if layout == "rows" else math.prod(dq["shape"]) == math.prod(q["shape"]))):
                raise self.fail(f"{at}/{str(key)[:40]}", "is a ratio state whose divisor is not a sqrt state of its size")

    def _fields(self, spec, kind, at):
        if not isinstance(spec, dict):
            raise self.fail(at, "is not an object")
        self._only(spec, at, *_FIELDS[kind])

    def _row(self, name, at) -> dict:
        row = self.rows.get(name) if isinstance(name, str) else None
        if row is None:
            raise self.fail(at, f"names stored tensor {str(name)[:80]!r}, which the file does not hold")
        return row


def dtype_of(name, fail, at) -> torch.dtype:
    try:
        return dtype_from_name(name)
    except FormatError:
        raise fail(at, f"names dtype {str(name)[:40]!r}, which this ckptq does not know") from None


def _hashable(k) -> bool:
    """Whether a key node decodes to a hashable value (a list or dict key would raise TypeError)."""
    if not isinstance(k, dict):
        return not isinstance(k, list)
    kind = next(iter(k), None)
    if kind == "tuple":
        return isinstance(k["tuple"], list) and all(_hashable(v) for v in k["tuple"])
    return kind in ("float", "size", "dtype", "device", "tensor")
