"""A torch.save zip archive's storage records, checked against what its pickle claims, before any data is read.

ckptq loads torch.save files memory-mapped (``torch.load(mmap=True)``), so that a checkpoint larger than
memory converts. A strict ``torch.load`` (``mmap=False``) reads each storage from its zip record and
refuses a record whose size is not the storage's ("record size does not match"); the memory-mapped load
skips that check and reads ``nbytes`` from where the record starts, whatever the record holds: a short
record gives the next records' bytes (or the zip directory) as tensor data, a compressed one its
compressed bytes. ``check_records`` restores the strict load's guarantee on the mapped one: it reads the
pickle alone (``data.pkl``, through torch's own weights-only unpickler, with storages stood in for by
meta storages that hold no data) to learn each storage's key and size, then requires of each record what
a strict load requires and more: present once, stored uncompressed, exactly the storage's size, its bytes
inside the file and shared with no other record. ``verify_crcs`` checks what no torch.load checks, each
record's CRC-32: ``--replace`` runs it before it deletes an original, which must not be a damaged one.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib

import torch

from ..errors import InputError
from . import files
from .spans import overlapping_ranges

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header: 30 bytes, then name and extra
_CHUNK = 1 << 22


def _refuse(path: str, what: str) -> InputError:
    return InputError(f"{path}: {what[:240]}; the file is damaged or crafted (a strict torch.load refuses it too)")


def _archive(path: str, z: zipfile.ZipFile) -> tuple[str, dict]:
    """(the archive's top folder, {record name: ZipInfo}); duplicate names refused."""
    infos = z.infolist()
    if not infos:
        raise _refuse(path, "an empty zip archive")
    prefix = infos[0].filename.split("/", 1)[0] + "/" if "/" in infos[0].filename else ""  # as torch finds it
    by_name: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        if info.filename in by_name:
            raise _refuse(path, f"the zip archive holds {info.filename[:80]!r} twice")
        by_name[info.filename] = info
    return prefix, by_name


def storage_claims(pickled: bytes) -> dict[str, int]:
    """{storage key: bytes} of every storage the pickle of a torch.save archive names, as torch's loader
    sizes them (the first mention of a key decides, as in ``torch.serialization._load``). Uses torch's
    weights-only unpickler: nothing outside its allowlist is called, and no storage data is read."""
    from torch import _weights_only_unpickler

    claims: dict[str, int] = {}
    made: dict[str, torch.storage.TypedStorage] = {}

    def persistent_load(saved_id):
        if not (isinstance(saved_id, tuple) and len(saved_id) == 5 and saved_id[0] in ("storage", b"storage")):
            raise InputError("a storage reference of an unknown form")
        _, storage_type, key, _, numel = saved_id
        key = key.decode("ascii") if isinstance(key, bytes) else str(key)
        if key not in made:
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            if type(numel) is not int or not 0 <= numel < 2**62:
                raise InputError(f"storage {key[:40]} claims {numel!r:.40} elements")
            claims[key] = numel * torch._utils._element_size(dtype)
            made[key] = torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(claims[key], device="meta"),
                                                   dtype=dtype, _internal=True)
        return made[key]

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(pickled), encoding="utf-8")
    unpickler.persistent_load = persistent_load
    unpickler.load()
    return claims


def _data_offset(f, info: zipfile.ZipInfo) -> int:
    """Where a record's bytes start: after its local header, its name and its extra field."""
    f.seek(info.header_offset)
    head = f.read(_LOCAL_HEADER.size)
    if len(head) != _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        raise ValueError("no local header")
    fields = _LOCAL_HEADER.unpack(head)
    return info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]


def check_records(path: str) -> None:
    """InputError (one line) unless every storage that the pickle of the torch.save zip at ``path``
    names has one record of its own: present, uncompressed, exactly its size, inside the file."""
    with files.open_regular(path, "torch.save checkpoint") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            z = zipfile.ZipFile(f)
            prefix, by_name = _archive(path, z)
            pickled = z.read(prefix + "data.pkl") if prefix + "data.pkl" in by_name else None
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, zlib.error) as e:
            raise _refuse(path, f"its zip archive does not read ({str(e)[:80]})") from None
        if pickled is None:
            raise _refuse(path, f"no {prefix}data.pkl in the archive")
        try:
            claims = storage_claims(pickled)
        except InputError as e:
            raise _refuse(path, str(e)) from None
        except Exception:  # not weights-only data: torch.load itself names the global it refuses
            return
        spans = []
        for key, nbytes in claims.items():
            info = by_name.get(f"{prefix}data/{key}")
            if info is None:
                raise _refuse(path, f"its pickle names storage {key[:40]}, which the archive does not hold")
            if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                raise _refuse(path, f"storage {key[:40]} is stored compressed; torch.save stores data uncompressed")
            if info.file_size != nbytes:
                raise _refuse(path, f"storage {key[:40]} needs {nbytes} bytes and its record holds {info.file_size}")
            try:
                start = _data_offset(f, info)
            except (OSError, ValueError, struct.error):
                raise _refuse(path, f"the record of storage {key[:40]} has no readable zip header") from None
            if start + nbytes > size:
                raise _refuse(path, f"storage {key[:40]}'s {nbytes} bytes run past the end of the file")
            spans.append((start, nbytes, key))
        pair = overlapping_ranges(spans)
        if pair:
            raise _refuse(path, f"storages {pair[0][2][:40]} and {pair[1][2][:40]} are stored in the same bytes")


def verify_crcs(path: str) -> None:
    """InputError unless every record of the zip at ``path`` matches the CRC-32 its directory records
    (torch.save writes them; torch.load does not check them); reads the file once, a few MB at a time."""
    with files.open_regular(path, "torch.save checkpoint") as f:
        try:
            with zipfile.ZipFile(f) as z:
                for info in z.infolist():
                    with z.open(info) as member:  # ZipExtFile checks the CRC when it reaches the end
                        while member.read(_CHUNK):
                            pass
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as e:
            raise _refuse(path, f"a record does not match its checksum ({str(e)[:80]})") from None
