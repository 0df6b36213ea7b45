"""``torch.distributed.checkpoint`` (DCP) with ckptq: ``SavePlanner`` / ``LoadPlanner`` store and read Adam
moments 8-bit inside a user's own ``dcp.save`` / ``dcp.load`` (``planners``); ``SafeFileSystemReader`` reads
a folder someone else wrote without running its pickles (``safe_reader``); ``folder`` converts and expands
whole DCP folders for the CLI."""

from .planners import LoadPlanner, SavePlanner
from .safe_reader import SafeFileSystemReader

__all__ = ["SavePlanner", "LoadPlanner", "SafeFileSystemReader"]
