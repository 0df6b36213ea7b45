"""What a file is, by its structure, before ckptq writes over it: ``--force`` replaces only an output of
the kind the command writes, and a name, a prefix or a string inside proves nothing (a user's zip starts
with ``PK``, a user's JSON may quote ``"ckptq.format"``).

- "torch": a torch.save zip archive laid out as torch writes it (one top folder holding ``data.pkl`` and
  ``version`` or ``.format_version``, every record under it), or a legacy torch.save pickle (its magic
  number first);
- "ckptq": a safetensors file whose parsed header's metadata names ckptq's format, or a shard index
  whose parsed metadata holds ckptq's shard list.
"""

from __future__ import annotations

import struct
import zipfile

from ..errors import FormatError, InputError
from .files import open_regular
from .header import FORMAT_NAME, MAX_HEADER, SHARDS_KEY, parse_json

KINDS = ("ckptq", "torch")  # what an output is: a ckptq file (or shard index), a torch.save file
# torch.save's legacy format: pickle protocol 2, then its magic number 0x1950a86a20f9469cfc6c as a LONG1
_LEGACY = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def kind_of(path: str) -> str | None:
    """What the regular file at ``path`` is: "ckptq", "torch", or None (anything else, not a regular file,
    or unreadable)."""
    try:
        with open_regular(path, "output") as f:
            head = f.read(len(_LEGACY))
            if head[:4] == b"PK\x03\x04":
                return "torch" if _is_torch_zip(f) else None
            if head == _LEGACY:
                return "torch"
            if len(head) >= 9 and head[8:9] == b"{":
                return "ckptq" if _is_ckptq_file(f, struct.unpack("<Q", head[:8])[0]) else None
            if head.lstrip()[:1] == b"{":
                return "ckptq" if _is_ckptq_index(f) else None
    except (InputError, OSError):
        return None
    return None


def _is_torch_zip(f) -> bool:
    try:
        names = zipfile.ZipFile(f).namelist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError):
        return False
    top = names[0].split("/", 1)[0] + "/" if names and "/" in names[0] else None
    return (top is not None and all(n.startswith(top) for n in names) and top + "data.pkl" in names
            and (top + "version" in names or top + ".format_version" in names))


def _parsed(raw: bytes):
    try:
        return parse_json(raw, "header")
    except (FormatError, UnicodeDecodeError, ValueError):
        return None


def _is_ckptq_file(f, length: int) -> bool:
    if not 2 <= length <= MAX_HEADER:
        return False
    f.seek(8)
    raw = f.read(length)
    header = _parsed(raw) if len(raw) == length else None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(meta, dict) and meta.get("ckptq.format") == FORMAT_NAME


def _is_ckptq_index(f) -> bool:
    f.seek(0)
    raw = f.read(MAX_HEADER + 1)
    index = _parsed(raw) if len(raw) <= MAX_HEADER else None
    meta = index.get("metadata") if isinstance(index, dict) else None
    return isinstance(meta, dict) and isinstance(meta.get(SHARDS_KEY), str) and isinstance(index.get("weight_map"), dict)
