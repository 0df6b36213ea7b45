"""Reading a written output back before its original is deleted (``--replace``).

A converted file is checked against its source: every stored tensor's checksum, every exact tensor bit for
bit, and every 8-bit state re-quantized from the source with the parameters the file records (codes,
scales and codebook must be identical: quantization is deterministic). An expanded file is loaded with
``torch.load(weights_only=True)`` and compared bit for bit with the decoding of its source. Only then,
with the output's folder entry made durable (``fsync`` of the folder), is the original removed.
"""

from __future__ import annotations

import math
import os
import stat
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ..codec import checkpoint, foreign, policy, qstate, quant, tree
from .. import format
from ..format import files
from ..errors import FormatError, InputError


class ReadbackError(FormatError):
    """A written output does not read back as what was meant; the original was kept."""


@contextmanager
def discarding(outputs: list[str]) -> Iterator[None]:
    """An output that fails its check is removed (it is known bad); the original stays."""
    try:
        yield
    except (FormatError, InputError):
        for p in outputs:
            files.remove_path(p)
        raise


def check_converted(src: str, outputs: list[str], trust: bool = False) -> None:
    """Raise :class:`ReadbackError` (and remove ``outputs``) unless the converted ``outputs`` (file, or
    index + shards) of the torch.save file ``src`` decode to exactly what convert meant to write."""
    if format.is_safetensors(src):  # a converted file re-encoded at another width: its decoded states
        want = tree.Converted(src).read(dequantize=True)
    else:
        want = checkpoint.load_torch(src, trust=trust)
    foreign.to_torch(want)  # bitsandbytes / torchao state is converted from its fp32 form, as convert does
    with discarding(outputs):
        conv = tree.Converted(outputs[0], verify=True)  # verify: each tensor's crc32 is checked as it is read
        try:
            _compare(want, conv.read(dequantize=False), "", outputs[0])
        finally:
            conv.close()


def check_expanded(src: str, dst: str, trust: bool = False) -> None:
    """Raise :class:`ReadbackError` (and remove ``dst``) unless the torch.save file ``dst`` holds exactly the
    decoding of ``src`` (a converted file or set, or a torch.save file holding 8-bit states)."""
    with discarding([dst]):
        _check_expanded(src, dst, trust)


def _check_expanded(src: str, dst: str, trust: bool) -> None:
    got = checkpoint.load_torch(dst)
    if checkpoint.is_torch_file(src):
        want = checkpoint.load_torch(src, trust=trust)
        foreign.to_torch(want)
        quant.decode_qstates(want)
        _compare(want, got, "", dst)
        return
    conv = tree.Converted(src, verify=True)
    try:
        _compare(conv.read(dequantize=True, lazy=True), got, "", dst)  # lazy: one decoded tensor at a time
    finally:
        conv.close()


def _mismatch(where: str, path: str, what: str) -> ReadbackError:
    return ReadbackError(f"{where} does not read back as written ({path or '<root>'}: {what}); it was removed "
                         "and the original kept")


def _compare(want: Any, got: Any, path: str, where: str, siblings: dict | None = None) -> None:
    if qstate.is_qstate(got) and isinstance(want, torch.Tensor):
        want = _requantize(want, got, path, where, siblings)
    want = _materialize(want)
    if isinstance(want, torch.Tensor):
        if not (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
                and _same_bytes(want, got)):
            raise _mismatch(where, path, "tensor differs")
    elif isinstance(want, dict):
        if not isinstance(got, dict) or list(map(str, want)) != list(map(str, got)):
            raise _mismatch(where, path, "keys differ")
        for (k, w), g in zip(want.items(), got.values()):
            _compare(w, g, f"{path}/{k}", where, want)
    elif isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            raise _mismatch(where, path, "sequence differs")
        for i, (w, g) in enumerate(zip(want, got)):
            _compare(w, g, f"{path}/{i}", where)
    elif not (want == got or (isinstance(want, float) and isinstance(got, float) and math.isnan(want) and math.isnan(got))):
        raise _mismatch(where, path, f"{str(want)[:40]!r} != {str(got)[:40]!r}")


def _requantize(t: torch.Tensor, q: dict, path: str, where: str, siblings: dict | None) -> dict:
    """What convert meant to store for source tensor ``t``, with the parameters the file records."""
    key = path.rsplit("/", 1)[-1]
    if q.get("transform") != policy.RATIO_TRANSFORM:
        return quant.quantize_state(t, key, q["block_size"], bits=q.get("bits", 8), layout=q.get("layout", "flat"))
    v = (siblings or {}).get(q.get("divisor"))
    if not isinstance(v, torch.Tensor):
        raise _mismatch(where, path, "ratio state without its second moment in the source")
    return quant.quantize_ratio(t, v, q["eps"], q["block_size"], divisor_key=q["divisor"], bits=q.get("bits", 8),
                                layout=q.get("layout", "flat"))


def _materialize(x: Any) -> Any:
    """A ``torch_stream.LazyTensor`` (a lazily read expand input) as the tensor it stands for."""
    storage = getattr(x, "storage", None)
    if hasattr(storage, "produce"):
        return storage.produce().reshape(-1).as_strided(x.shape, x.stride, x.offset)
    return x


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included)."""
    return torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8),
                       b.detach().contiguous().reshape(-1).view(torch.uint8))


def sync_folder(path: str) -> None:
    """Make the folder entries of ``path`` (a rename into place) durable before anything is deleted."""
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SourceChangedError(InputError):
    """The original changed while it was converted; it was kept."""


class Original:
    """An input as it was when ``--replace`` started: its device, inode, size and modification time,
    held open so the inode cannot be reused. ``remove`` deletes the input only if it is still that file: it
    renames the path aside (atomic), checks what it moved, and moves it back if it is not the file that was
    converted (a trainer rewrote ``last.ckpt`` meanwhile, say), so a file that was not checked is never lost."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.key = self._key(os.fstat(self._fd), path)

    @staticmethod
    def _key(st: os.stat_result, path: str) -> tuple:
        if stat.S_ISDIR(st.st_mode):  # a folder: its identity and its .metadata's (a DCP folder rewritten in place)
            meta = os.path.join(path, ".metadata")
            inner = os.stat(meta) if os.path.exists(meta) else st
            return (st.st_dev, st.st_ino, inner.st_ino, inner.st_size, inner.st_mtime_ns)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def remove(self, outputs: list[str], also: list[str] = ()) -> list[str]:
        """Delete the input (and ``also``: the shards of a set) once ``outputs`` are checked, their folder
        entries synced first; SourceChangedError, keeping it, if it is not the file that was converted."""
        try:
            for out in outputs:
                sync_folder(out)
            aside = f"{self.path.rstrip(os.sep)}.ckptq-removing-{os.getpid()}"
            os.rename(self.path, aside)
            if self._key(os.lstat(aside), aside) != self.key:
                os.rename(aside, self.path)
                raise SourceChangedError(
                    f"{self.path} changed while it was converted (another program rewrote it); it was kept: the "
                    f"output ({', '.join(outputs)}) holds the version that was read, check which one you want")
            files.remove_path(aside)
            for extra in also:
                files.remove_path(extra)
            sync_folder(self.path)
            return [self.path, *also]
        finally:
            os.close(self._fd)


def remove_original(src: str, outputs: list[str]) -> None:
    """Delete ``src`` (a file or a folder) once ``outputs`` are checked; their folder entries synced first."""
    for out in outputs:
        sync_folder(out)
    files.remove_path(src)
    sync_folder(src)
