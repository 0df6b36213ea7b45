"""A ``DefaultSavePlanner`` whose small values are written compactly.

DCP writes every non-tensor entry (steps, ``param_groups`` fields, the scalars of a low-bit state) as a
``torch.save`` record of its own: about 1.3 KB each in the zip format, for an int. torch.save's legacy
format holds the same value in about 150 bytes, and ``torch.load`` (so ``dcp.load``, and ckptq's
``weights_only`` reader) reads both; a low-bit state has eight or nine such values, so on small models
this is several percent of a folder.
"""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType


class CompactSavePlanner(DefaultSavePlanner):
    def transform_object(self, write_item, object):  # noqa: A002 (DCP's parameter name)
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(object, buf, _use_new_zipfile_serialization=False)
            return buf
        return super().transform_object(write_item, object)
