"""The header checksum of format version 2 (docs/FORMAT.md, "Integrity").

Tensor bytes carry their own crc32 in ``ckptq.tensors``; the header is covered by
``ckptq.header_crc32``: the zlib CRC-32 of the file's first ``8 + N`` bytes (length prefix, header JSON
and its padding, i.e. everything before the tensor data) as written with the checksum's eight hex digits
set to ``"00000000"``. An index file is covered the same way, over the whole file. The key is written
compactly (``"ckptq.header_crc32":"xxxxxxxx"``) exactly once; inside a JSON string value its quotes would
be escaped, so the byte pattern cannot occur anywhere else.
"""

from __future__ import annotations

import re
import zlib

from ..errors import ChecksumError, FormatError

KEY = "ckptq.header_crc32"
SEALED_VERSIONS = ("2", "3")  # format versions whose headers carry the checksum (it is mandatory in them)
PLACEHOLDER = "0" * 8
_PATTERN = re.compile(rb'"ckptq\.header_crc32":"([0-9a-f]{8})"')


def _locate(raw: bytes | bytearray, where: str) -> re.Match:
    found = list(_PATTERN.finditer(raw))
    if len(found) != 1:
        raise FormatError(f"{where}: the header checksum field {KEY} appears {len(found)} times in the header, "
                          "expected once; the file is corrupt")
    return found[0]


def seal(raw: bytearray) -> str:
    """Fill in the checksum of ``raw`` (which holds the placeholder) in place; returns it."""
    m = _locate(raw, "header being written")
    if m.group(1) != PLACEHOLDER.encode():
        raise AssertionError("seal() needs the placeholder checksum")
    crc = f"{zlib.crc32(raw):08x}"
    raw[m.start(1) : m.end(1)] = crc.encode()
    return crc


def precheck(raw: bytes, where: str) -> None:
    """Before parsing: if the checksum field is present exactly once, verify it, so that damage
    anywhere in the header is reported as such rather than as whatever JSON error it causes."""
    found = list(_PATTERN.finditer(raw))
    if len(found) == 1:
        verify(raw, found[0].group(1).decode(), where)


def verify(raw: bytes, recorded: object, where: str) -> None:
    """Check a header's bytes against the checksum its metadata records (``recorded``)."""
    if not (isinstance(recorded, str) and re.fullmatch("[0-9a-f]{8}", recorded)):
        raise FormatError(f"{where}: the header checksum {KEY} is malformed ({str(recorded)[:20]!r}); "
                          "the file is corrupt")
    m = _locate(raw, where)
    if m.group(1).decode() != recorded:
        raise FormatError(f"{where}: the header checksum field is corrupt; re-create the file")
    zeroed = raw[: m.start(1)] + PLACEHOLDER.encode() + raw[m.end(1) :]
    actual = f"{zlib.crc32(zeroed):08x}"
    if actual != recorded:
        raise ChecksumError(f"{where}: the header (skeleton, tensor table or metadata) fails its checksum "
                            f"(crc32 {actual}, recorded {recorded}): the file is corrupt; re-create it "
                            "from the source checkpoint")
