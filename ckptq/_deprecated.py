"""Names kept for one release after a rename: each old name still works and warns once per process
(``DeprecationWarning``, naming the replacement), so a loop that calls an old function does not repeat it."""

from __future__ import annotations

import functools
import inspect
import warnings

_WARNED: set[str] = set()  # the old names warned about so far in this process


def warn(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn once that ``old`` is deprecated in favour of ``new``; ``stacklevel`` 3: the caller's caller, the
    line of user code that used the old name."""
    if old in _WARNED:
        return
    _WARNED.add(old)
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}", DeprecationWarning,
                  stacklevel=stacklevel)


def renamed_keywords(**renames: str):
    """A decorator: the function also takes each old keyword (``old="new"``) under its new name, warning once;
    both names at once is a TypeError. The signature shown (``help``, IDEs) is the function's own."""

    def decorate(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old in [k for k in kwargs if k in renames]:
                new = renames[old]
                others = {k: v for k, v in kwargs.items() if k not in renames}
                if new in signature.bind_partial(*args, **others).arguments:
                    raise TypeError(f"{fn.__name__}() got both {old}= and {new}=; pass {new}= only")
                warn(f"{fn.__name__}({old}=...)", f"{fn.__name__}({new}=...)")
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call

    return decorate

