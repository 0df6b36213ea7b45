"""What every kind of input offers: the verbs ``convert``, ``expand`` and ``info``, each taking its checked
options and returning its typed report. A verb a kind does not have is refused here, in one place."""

from __future__ import annotations

from ..errors import UsageError
from .options import ConvertOptions, ExpandOptions, InfoOptions
from .reports import ConvertReport, ExpandReport, InfoReport


class Source:
    kind = "input"  # in words
    type = "input"  # as a short name (``InfoReport.type``)

    def __init__(self, path: str):
        self.path = path

    def _lacks(self, verb: str, why: str = "") -> UsageError:
        return UsageError(f"{self.path} is a {self.kind}; ckptq cannot {verb} it{': ' + why if why else ''}")

    def convert(self, opts: ConvertOptions) -> ConvertReport:
        raise self._lacks("convert")

    def expand(self, opts: ExpandOptions) -> ExpandReport:
        raise self._lacks("expand")

    def info(self, opts: InfoOptions) -> InfoReport:
        raise self._lacks("describe")

    def check_converted(self, outputs: list[str], trust: bool) -> None:
        """Read ``outputs`` back against this source (``--replace``); ReadbackError if they differ."""
        raise UsageError(f"--replace does not handle {self.kind}s yet; convert without it, check the output, then "
                         "delete the original yourself")

    def check_expanded(self, outputs: list[str], trust: bool) -> None:
        raise UsageError(f"--replace does not handle {self.kind}s yet; expand without it, check the output, then "
                         "delete the original yourself")
