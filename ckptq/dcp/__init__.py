"""``torch.distributed.checkpoint`` (DCP) with ckptq: ``SavePlanner`` / ``LoadPlanner`` store and read Adam
moments 8-bit inside a user's own ``dcp.save`` / ``dcp.load`` (``planners``); ``folder`` converts and
expands whole DCP folders for the CLI."""

from .planners import LoadPlanner, SavePlanner

__all__ = ["SavePlanner", "LoadPlanner"]
