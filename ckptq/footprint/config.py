"""A model's ``config.json`` as ``ckptq estimate`` reads it: the file, its JSON, and every field that decides
a size, each checked before anything is computed. A refusal is one ``InputError`` line naming the field
and what to give instead. Fields that decide no size (``rope_theta``...) are not read, so not checked.

Sizes are whole numbers from 1 to a bound far beyond any published model, so that a typo or a hostile
file (``num_hidden_layers: 1e9``, ``10**400``) is refused instead of estimated. The bounds also keep every
parameter tensor below 2**53 elements (vocab x width 2**44, positions x width 2**50, width x heads x
head_dim 2**52): exact as floats, far inside torch's int64 sizes, whatever the combination.
"""

from __future__ import annotations

import json
import os

from ..errors import InputError
from ..format.reader import json_depth

MAX_CONFIG_BYTES = 16 << 20  # Hugging Face configs are a few KB; this is no config
MAX_CONFIG_DEPTH = 64  # they nest a few levels (rope_scaling, quantization_config)

# Largest published values (2025) in the comments; each bound is 100x or more beyond them.
MAX_LAYERS = 2**16  # 126 (Llama 3.1 405B); 1,000 in DeepNet's experiments
MAX_WIDTH = 2**20  # hidden 16,384, intermediate 53,248 (Llama 3.1 405B)
MAX_HEADS = 2**16  # heads 128, head_dim 256
MAX_VOCAB = 2**24  # 262,144 (Gemma 3)
MAX_POSITIONS = 2**30  # 10M tokens of context (Llama 4 Scout)

_REQUIRED = object()


def read_config(path: str) -> dict:
    """The JSON object in ``path``; InputError if it is too large, too deeply nested, not JSON or not an object."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(min(size, MAX_CONFIG_BYTES) + 1)  # a file that grows is read only that far
    if len(raw) > MAX_CONFIG_BYTES:
        raise InputError(f"{path}: {max(size, len(raw)):,} bytes is no config.json (they are a few KB); "
                         "give the model's config.json")
    try:
        text = raw.decode("utf-8")
        depth = json_depth(text)
        if depth > MAX_CONFIG_DEPTH:
            raise InputError(f"{path}: JSON nested {depth} deep; a config.json nests a few levels, give the "
                             "model's config.json")
        config = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: also ints of 4,300+ digits
        raise InputError(f"{path}: not valid JSON ({str(e)[:80]}); give a Hugging Face config.json") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: a config.json holds a JSON object, not {type(config).__name__}")
    return config


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class Fields:
    """Typed reads of a config's fields; ``source`` names the file in messages. A JSON ``null`` reads as
    the default, as transformers reads it (``n_inner: null``, ``head_dim: null``)."""

    def __init__(self, config: dict, source: str):
        self.config, self.source = config, source

    def require(self, names: tuple[str, ...], kind: str) -> None:
        missing = [n for n in names if self.config.get(n) is None]
        if missing:
            raise InputError(f"{self.source}: a {kind} config needs {', '.join(missing)}; the file lacks them")

    def _bad(self, name: str, what: str) -> InputError:
        return InputError(f"{self.source}: {name} is {_shown(self.config[name])}; {what}")

    def count(self, name: str, bound: int, default=_REQUIRED):
        """A whole number from 1 to ``bound`` (a float only if whole: 4096.0); ``default`` if absent or null."""
        v = self.config.get(name)
        if v is None:
            return default
        or_default = "" if default is _REQUIRED else ", or leave it out for the default"
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
            raise self._bad(name, f"give a whole number from 1 to {bound:,}{or_default}")
        if not 1 <= v <= bound:
            beyond = ", a bound far beyond any published model" if v > bound else ""
            raise self._bad(name, f"give a whole number from 1 to {bound:,}{beyond}{or_default}")
        return int(v)

    def rate(self, name: str, default: float) -> float:
        """A probability (dropout): a number from 0 to 1."""
        v = self.config.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise self._bad(name, "give a number from 0 to 1")
        return float(v)

    def flag(self, name: str, default: bool) -> bool:
        v = self.config.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self._bad(name, "give true or false")
        return v

    def text(self, name: str, default: str) -> str:
        v = self.config.get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self._bad(name, f"give a name such as {default!r}")
        return v

