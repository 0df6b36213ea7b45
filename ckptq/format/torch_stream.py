"""A streaming ``torch.save``: tensors are produced one at a time while the file is written.

``torch.save`` needs every tensor in memory before it writes. Its file is a zip of ``data.pkl`` (the
pickled object, where each storage is a persistent id ``("storage", <Type>Storage, key, location,
numel)``) followed by one ``data/<key>`` record per storage. The pickle never needs the bytes, so here
it is written from placeholders (:class:`LazyTensor`) and each storage is produced only when its
record is written: memory stays at the size of the largest tensor. ``torch.load(weights_only=True)``
reads the result like any torch.save file (the same records, written by torch's own zip writer).

torch's zip writer is given a Python file object, not a path. Two reasons: with a path it names the
zip's entries after the file (a random temp name, so the same input gave different bytes), and a failed
write (disk full) made its C++ destructor throw during unwinding, which aborts the whole process
(``terminate called ... c10::Error``). Here the first write error is recorded, later writes are dropped,
and the error is raised as an ordinary ``OSError`` once torch's writer is done with the file.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import sys
from typing import Any, Callable

import torch
from torch.serialization import _get_storage_alignment, location_tag

_STORAGE_TYPES = {
    torch.float64: "DoubleStorage", torch.float32: "FloatStorage", torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage", torch.bool: "BoolStorage",
    torch.complex64: "ComplexFloatStorage", torch.complex128: "ComplexDoubleStorage",
}


def can_stream(dtype: torch.dtype) -> bool:
    return dtype in _STORAGE_TYPES


class LazyStorage:
    """Stands for a storage of ``numel`` elements of ``dtype``; ``produce()`` returns its tensor."""

    def __init__(self, dtype: torch.dtype, numel: int, produce: Callable[[], torch.Tensor]):
        self.dtype, self.numel, self.produce = dtype, numel, produce


class LazyTensor:
    """Pickles exactly like a CPU tensor over ``storage`` (or an ``nn.Parameter``): contiguous unless
    ``stride``/``offset`` say otherwise (views of one storage stay views of it)."""

    def __init__(self, storage: LazyStorage, shape: tuple, parameter: bool = False, stride: tuple | None = None,
                 offset: int = 0):
        self.storage, self.shape, self.parameter, self.offset = storage, tuple(shape), parameter, offset
        self.stride = tuple(stride) if stride is not None else contiguous_strides(self.shape)

    def __reduce_ex__(self, protocol):
        if self.parameter:
            plain = LazyTensor(self.storage, self.shape, stride=self.stride, offset=self.offset)
            return (torch._utils._rebuild_parameter, (plain, True, collections.OrderedDict()))
        args = (self.storage, self.offset, torch.Size(self.shape), self.stride, False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args)


def contiguous_strides(shape) -> tuple:
    """C-order strides of ``shape`` in elements, as torch gives them (size-0/1 dims count as 1)."""
    strides, step = [], 1
    for d in reversed(tuple(shape)):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def save(obj: Any, path: str, progress: Callable[[int, int], None] | None = None, *,
         pickler: type = pickle.Pickler) -> None:
    """Write ``obj`` (which may hold LazyTensors as well as real tensors) as a torch.save file.
    ``pickler``: a ``pickle.Pickler`` class to derive from (``ckptq.deepspeed.objects`` writes DeepSpeed's objects)."""
    records: dict[str, Any] = {}  # key -> LazyStorage | UntypedStorage, in first-seen order
    keys: dict[int, str] = {}

    class Pickler(pickler):
        def persistent_id(self, o):
            if isinstance(o, LazyStorage):
                key = keys.setdefault(id(o), str(len(keys)))
                records[key] = o
                return ("storage", getattr(torch, _STORAGE_TYPES[o.dtype]), key, "cpu", o.numel)
            if isinstance(o, torch.storage.TypedStorage):  # what Tensor.__reduce_ex__ hands over
                untyped = o._untyped_storage
                key = keys.setdefault(untyped._cdata, str(len(keys)))
                records[key] = untyped
                return ("storage", getattr(torch, o._pickle_storage_type()), key, location_tag(untyped), o._size())
            if isinstance(o, torch.UntypedStorage):  # dtypes without a typed storage class (float8, uint16...)
                key = keys.setdefault(o._cdata, str(len(keys)))
                records[key] = o
                return ("storage", torch.UntypedStorage, key, location_tag(o), o.nbytes())
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(obj)
    with open(path, "wb") as f:
        sink = _Sink(f)
        try:
            writer = torch._C.PyTorchFileWriter(sink, True, _get_storage_alignment())
            _write_records(writer, sink, buf.getvalue(), records, progress)
        finally:
            sink.closed = True  # a traceback may keep torch's writer alive past this file: drop its writes
        sink.check()
        f.flush()
        os.fsync(f.fileno())


class _Sink:
    """A write-only file for torch's zip writer that never raises into C++ (see the module docstring)."""

    def __init__(self, f):
        self.f, self.error, self.closed = f, None, False

    def write(self, data) -> int:
        if self.error is None and not self.closed:
            try:
                self.f.write(data)
            except Exception as e:  # noqa: BLE001 - nothing may propagate into torch's C++ writer
                self.error = e
        return len(memoryview(data))

    def flush(self) -> None:
        pass

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def _write_records(writer, sink: _Sink, data: bytes, records: dict, progress) -> None:
    writer.write_record("data.pkl", data, len(data))
    writer.write_record(".format_version", "1", 1)
    alignment = str(_get_storage_alignment())
    writer.write_record(".storage_alignment", alignment, len(alignment))
    writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    total = sum(r.numel * r.dtype.itemsize if isinstance(r, LazyStorage) else r.nbytes() for r in records.values())
    done = 0
    for key, rec in records.items():
        if isinstance(rec, LazyStorage):
            t = rec.produce().detach().to("cpu", rec.dtype).contiguous()
            assert t.numel() == rec.numel, (key, t.numel(), rec.numel)
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()  # a view into a larger buffer: write only its own bytes
            storage = t.untyped_storage()
        else:
            storage = rec.cpu()
        writer.write_record(f"data/{key}", storage, storage.nbytes())
        done += storage.nbytes()
        t = storage = None  # free this tensor before the next one is produced: one at a time
        if progress:
            progress(done, total)
        sink.check()  # stop at the first failed write instead of producing every other tensor
    writer.write_end_of_file()
