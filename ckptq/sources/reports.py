"""What ``convert``, ``expand`` and ``info`` return, for every kind of input: typed reports that the CLI
prints (``text()``) and ``--json`` serializes (``as_dict()``) the same way. A folder's or a run's report
holds one report per part (``parts``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def shown(text) -> str:
    """``text`` safe to print on a terminal, on one line: every character that is not printable (control
    characters such as newline or ESC, which a crafted key could use to redraw the screen; format
    characters; lone surrogates) as a Python escape."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   if not 0xD800 <= ord(c) <= 0xDFFF else f"\\u{ord(c):04x}" for c in text)


def _names(items) -> str:
    return ", ".join(shown(i) for i in items)


def mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f} MB"


def ratio_words(before: int, after: int) -> str:
    """'3.61x smaller', '1.18x larger' (a 4 -> 8-bit re-encode), or 'the same size' (within 0.5%)."""
    if not before or not after or abs(before - after) <= 0.005 * before:
        return "the same size"
    return f"{before / after:.2f}x smaller" if after < before else f"{after / before:.2f}x larger"


@dataclass
class ConvertReport:
    source: str
    kind: str  # what the source is (``detect``)
    outputs: list[str] = field(default_factory=list)
    source_bytes: int = 0  # of the files that were converted (a folder's optimizer files, not its weights)
    output_bytes: int = 0
    bits: int = 8
    optimizers: int = 0
    quantized: int = 0  # state tensors stored low-bit
    kept_small: int = 0  # float states below min_size, stored exact
    kept_nonfinite: int = 0  # states holding NaN/Inf, stored exact
    kept_shared: int = 0  # states sharing storage with another tensor, stored exact
    nonfinite_names: list[str] = field(default_factory=list)  # the states kept exact for NaN/Inf
    foreign_states: int = 0  # parameters whose state was bitsandbytes' or torchao's 8-bit state
    warnings: list[str] = field(default_factory=list)  # states kept exact, or not stored as ratios, and why
    removed: list[str] = field(default_factory=list)  # originals deleted (--replace) once the outputs checked out
    skipped: list[str] = field(default_factory=list)  # a run's checkpoints left as they are (--keep-last, converted)
    signposts: list[str] = field(default_factory=list)  # removed originals whose name a signpost took (--replace)
    seconds: float = 0.0
    parts: list[ConvertReport] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.source_bytes / max(self.output_bytes, 1)

    def add(self, part: "ConvertReport") -> None:
        """Count a part (a folder's file, a run's checkpoint) into this report."""
        self.parts.append(part)
        self.outputs += part.outputs
        self.removed += part.removed
        self.signposts += part.signposts
        self.warnings += part.warnings
        self.nonfinite_names += part.nonfinite_names
        for name in ("source_bytes", "output_bytes", "optimizers", "quantized", "kept_small", "kept_nonfinite",
                     "kept_shared", "foreign_states"):
            setattr(self, name, getattr(self, name) + getattr(part, name))

    def as_dict(self) -> dict:
        return asdict(self) | {"ratio": self.ratio}

    def text(self) -> str:
        if not self.outputs and self.skipped:  # convert --all with every checkpoint converted or kept
            return f"nothing left to convert; left as they are: {_names(self.skipped)}"
        lines = [f"wrote {_names(self.outputs)}: {mb(self.output_bytes)} from {mb(self.source_bytes)} "
                 f"({ratio_words(self.source_bytes, self.output_bytes)}) in {self.seconds:.1f} s; {self.quantized} "
                 f"states {self.bits}-bit, {self.kept_small} small kept exact"
                 + (f"; read {self.foreign_states} params of bitsandbytes/torchao 8-bit state" if self.foreign_states
                    else "")]
        if self.skipped:
            lines.append(f"left as they are: {_names(self.skipped)}")
        lines += _removed_lines(self.removed, self.outputs, self.signposts)
        if self.parts and self.removed:
            lines.append(f"saved {mb(self.source_bytes - self.output_bytes)} in all")
        return "\n".join(lines)


def _removed_lines(removed: list[str], outputs: list[str], signposts: list[str]) -> list[str]:
    """What --replace did to the originals: deleted, replaced in place, or replaced by a signpost."""
    lines = []
    in_place = [p for p in removed if p in outputs]
    gone = [p for p in removed if p not in outputs and p not in signposts]
    if gone:
        lines.append(f"removed {_names(gone)} (outputs read back and checked)")
    if in_place:
        lines.append(f"replaced {_names(in_place)} in place (read back and checked)")
    if signposts:
        lines.append(f"removed {_names(signposts)} (outputs read back and checked); a signpost takes each one's "
                     "name, so that a stock framework stops there instead of starting a fresh optimizer")
    return lines


@dataclass
class ExpandReport:
    source: str
    kind: str
    outputs: list[str] = field(default_factory=list)
    output_bytes: int = 0
    seconds: float = 0.0
    removed: list[str] = field(default_factory=list)  # converted files deleted (--replace) once the output checked out
    parts: list[ExpandReport] = field(default_factory=list)

    @property
    def output(self) -> str:
        return ", ".join(self.outputs)

    def add(self, part: "ExpandReport") -> None:
        self.parts.append(part)
        self.outputs += part.outputs
        self.removed += part.removed
        self.output_bytes += part.output_bytes

    def as_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        lines = [f"wrote {_names(self.outputs)}: {mb(self.output_bytes)} in {self.seconds:.1f} s"]
        return "\n".join(lines + _removed_lines(self.removed, self.outputs, []))


@dataclass
class StateRow:
    """States of one role (state key) at one code width (None: kept exact, in their own dtype)."""

    role: str
    bits: int | None
    tensors: int = 0
    elements: int = 0
    stored_bytes: int = 0

    @property
    def fp32_bytes(self) -> int:
        return 4 * self.elements


@dataclass
class InfoReport:
    path: str
    kind: str  # what the input is, in words (``detect``)
    bytes: int = 0  # on disk
    states: list[StateRow] = field(default_factory=list)  # what it holds: low-bit states by role and width, exact
    options: dict = field(default_factory=dict)  # what a converted file records, or the options convert would use
    would_write: int | None = None  # bytes ``convert`` with these options would write (inputs with fp32 moments)
    would_store: list[StateRow] = field(default_factory=list)  # the states it would store low-bit, by role and width
    notes: list[str] = field(default_factory=list)  # what to know, and what to do next
    warnings: list[str] = field(default_factory=list)  # damage: states that cannot be stored low-bit, and why
    details: dict = field(default_factory=dict)  # what only this kind has (world size, stage, framework...)
    parts: list[InfoReport] = field(default_factory=list)
    type: str = ""  # the kind as a short name: torch, converted, safetensors, folder, run, dcp, deepspeed

    @property
    def ratio(self) -> float | None:
        """How much smaller the converted file is than its source; for fp32 input, than it would be."""
        before = self.options.get("source_bytes")
        if isinstance(before, int) and before > 0 and self.bytes:
            return before / self.bytes
        return self.bytes / self.would_write if self.would_write else None

    def low_bit(self, role: str | None = None) -> int:
        """How many low-bit states the input holds (of ``role``, or all)."""
        return sum(r.tensors for r in self.states if r.bits and role in (None, r.role))

    def row(self, role: str, bits: int | None) -> StateRow:
        for r in self.states:
            if (r.role, r.bits) == (role, bits):
                return r
        self.states.append(StateRow(role, bits))
        return self.states[-1]

    def count(self, role: str, bits: int | None, elements: int, stored: int) -> None:
        r = self.row(role, bits)
        r.tensors, r.elements, r.stored_bytes = r.tensors + 1, r.elements + elements, r.stored_bytes + stored

    def as_dict(self) -> dict:
        d = asdict(self)
        d["states"] = [asdict(r) | {"fp32_bytes": r.fp32_bytes} for r in self.states]
        d["would_store"] = [asdict(r) | {"fp32_bytes": r.fp32_bytes} for r in self.would_store]
        d["ratio"] = self.ratio
        d["parts"] = [p.as_dict() for p in self.parts]
        return d

    def text(self, indent: str = "") -> str:
        lines = [f"{indent}{shown(self.path)}  ({shown(self.kind)})", f"{indent}  size: {mb(self.bytes)}"
                 + self._source_words()]
        opts = {k: v for k, v in self.options.items() if k not in ("source", "source_bytes", "quantized")}
        if opts:
            lines.append(f"{indent}  " + ", ".join(shown(f"{k.replace('_', ' ')} {v}") for k, v in opts.items()))
        lines += [f"{indent}  {shown(k.replace('_', ' '))}: {shown(v)}" for k, v in self.details.items()
                  if not isinstance(v, (list, dict))]
        if self.states:
            lines.append(f"{indent}  {'state':<16}{'width':>8}{'tensors':>9}{'elements':>14}{'stored':>13}")
            for r in sorted(self.states, key=lambda r: (r.bits is None, r.role, -(r.bits or 0))):
                width = f"{r.bits}-bit" if r.bits else "exact"
                lines.append(f"{indent}  {shown(r.role):<16}{width:>8}{r.tensors:>9}{r.elements:>14,}{mb(r.stored_bytes):>13}")
        if self.would_write is not None:
            bits = self.options.get("bits", 8)
            stored = ", ".join(f"{r.tensors} {shown(r.role)} {r.bits}-bit" for r in self.would_store)
            lines.append(f"{indent}  convert{f' --bits {bits}' if bits != 8 else ''} would write ~{mb(self.would_write)} "
                         f"({ratio_words(self.bytes, self.would_write)})" + (f": {stored}" if stored else ""))
        lines += [f"{indent}  note: {shown(n)}" for n in self.notes] + [f"{indent}  warning: {shown(w)}" for w in self.warnings]
        return "\n".join(lines + [p.text(indent + "  ") for p in self.parts])

    def _source_words(self) -> str:
        source, before = self.options.get("source"), self.options.get("source_bytes")
        if not (isinstance(before, int) and before > 0 and self.bytes):
            return ""
        return f"; from {shown(source)} ({mb(before)}): {ratio_words(before, self.bytes)}"
