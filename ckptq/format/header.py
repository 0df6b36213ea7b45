"""Safetensors headers and ckptq's JSON: the size bound, and a parser that refuses duplicate keys and absurd
nesting (before parsing) as one FormatError. Imports nothing of the reader, so an index and a reader both
use it."""

from __future__ import annotations

import json
import re

import numpy as np

from ..errors import FormatError

MAX_HEADER = 100_000_000  # safetensors' own limit
FORMAT_NAME = "ckptq"  # a ckptq file's ``__metadata__["ckptq.format"]``
SHARDS_KEY = "ckptq.shards"  # in a ckptq shard index's metadata: the shards and their checksums
# Arrays and objects inside one another. A skeleton at its limit (``codec.skeleton.MAX_DEPTH``, 100 nodes)
# nests about 300 deep (a dict node is an object, its list of pairs, a pair); 512 also leaves json's
# recursive parser room below Python's default recursion limit (1,000).
MAX_JSON_DEPTH = 512
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_JSON_STRING = re.compile(rb'"[^"]*"')  # once escapes are gone, every quote opens or closes a string
_DEPTH_CHUNK = 1 << 20  # brackets per step of the running sum: bounded temporaries for a 100 MB header


def json_depth(text: str | bytes) -> int:
    """How deeply arrays and objects nest in JSON ``text`` (brackets inside strings do not count), found
    without parsing it: escaped backslashes, then escaped quotes are dropped, so that the quotes left
    delimit strings; only brackets outside them remain (a fifth of the time json takes to parse)."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    brackets = np.frombuffer(_JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    deepest = level = 0
    for start in range(0, brackets.size, _DEPTH_CHUNK):
        chunk = brackets[start : start + _DEPTH_CHUNK]
        levels = level + np.cumsum(np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1), dtype=np.int64)
        deepest, level = max(deepest, int(levels.max())), int(levels[-1])
    return deepest


def parse_json(text: str | bytes, what: str):
    """JSON without duplicate keys; any malformation (including absurd nesting) is a FormatError.

    Nesting is measured before parsing (``json_depth``): json's parser recurses, so whether it refuses a
    header 1,000 deep depended on the recursion limit of the moment (a library that raises it, as
    torch's inductor does, let such a header through to a different refusal)."""
    def pairs(items):
        out = dict(items)
        if len(out) != len(items):
            raise ValueError("duplicate keys")
        return out

    try:
        if json_depth(text) > MAX_JSON_DEPTH:
            raise ValueError(f"arrays and objects nested more than {MAX_JSON_DEPTH} deep")
        return json.loads(text, object_pairs_hook=pairs)
    except (ValueError, RecursionError, TypeError) as e:
        raise FormatError(f"{what} is corrupt ({str(e)[:80]})") from None
