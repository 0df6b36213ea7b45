"""``torch.distributed.checkpoint`` (DCP) with ckptq: ``LowBitSavePlanner`` / ``LowBitLoadPlanner`` store and
read Adam moments low-bit inside a user's own ``dcp.save`` / ``dcp.load`` (``planners``),
``SafeFileSystemReader`` reads folders someone else wrote without running their code (``safe_reader``);
``folder``, ``writer`` and ``source`` convert and expand whole DCP folders for the CLI. Names are looked up on
first use (PEP 562), so the CLI imports torch.distributed.checkpoint only for a DCP folder."""

from .. import lazy_attributes

_NAMES = {"LowBitSavePlanner": "planners", "LowBitLoadPlanner": "planners", "SafeFileSystemReader": "safe_reader"}
# Deprecated: torch's abstract base classes' names (torch.distributed.checkpoint.SavePlanner), on concrete classes.
_RENAMED = {"SavePlanner": "LowBitSavePlanner", "LoadPlanner": "LowBitLoadPlanner"}
__all__ = sorted(_NAMES)

__getattr__ = lazy_attributes(__name__, _NAMES, _RENAMED)
