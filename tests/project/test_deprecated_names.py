"""Names renamed for one shape across the integrations, kept for a release: each old name still does what it
did and warns once per process (DeprecationWarning) naming its replacement; the new names do not warn."""

from __future__ import annotations

import warnings

import pytest
import torch

import ckptq
from ckptq import _deprecated
from ckptq.codec import signpost
from ckptq.codec.quant import count_qstates


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Each test starts as a process that has warned about nothing yet."""
    monkeypatch.setattr(_deprecated, "_WARNED", set())


def warns_once(use, match: str):
    """``use()`` twice: a DeprecationWarning matching ``match`` the first time, none the second; its results."""
    with pytest.warns(DeprecationWarning, match=match) as first:
        a = use()
    assert len([w for w in first if w.category is DeprecationWarning]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        b = use()
    return a, b


def test_dcp_planners_old_names_are_the_new_classes():
    from ckptq.dcp.planners import LowBitLoadPlanner, LowBitSavePlanner

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert ckptq.dcp.LowBitSavePlanner is LowBitSavePlanner and ckptq.dcp.LowBitLoadPlanner is LowBitLoadPlanner
    save = warns_once(lambda: ckptq.dcp.SavePlanner, r"dcp\.SavePlanner is deprecated.*use ckptq\.dcp\.LowBitSavePlanner")
    load = warns_once(lambda: ckptq.dcp.LoadPlanner, r"dcp\.LoadPlanner is deprecated.*use ckptq\.dcp\.LowBitLoadPlanner")
    assert save == (LowBitSavePlanner, LowBitSavePlanner) and load == (LowBitLoadPlanner, LowBitLoadPlanner)
    assert ckptq.dcp.SavePlanner(bits=4).bits == 4
    assert "SavePlanner" not in ckptq.dcp.__all__ and "LowBitSavePlanner" in ckptq.dcp.__all__


def _adamw() -> torch.optim.AdamW:
    torch.manual_seed(0)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(64, 128))], lr=1e-2)
    opt.param_groups[0]["params"][0].grad = torch.randn(64, 128)
    opt.step()
    return opt


def test_accelerate_store_8bit_is_low_bit_checkpoints_at_8_bits():
    from ckptq.integrations.accelerate import low_bit_checkpoints, store_8bit

    old = warns_once(lambda: store_8bit(_adamw()), r"store_8bit is deprecated.*accelerate\.low_bit_checkpoints")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        new = low_bit_checkpoints(_adamw())
    for opt in (*old, new):
        state = opt.state_dict()
        assert signpost.carries(state) and count_qstates(state) == 2
        assert {q["bits"] for q in state[signpost.CARRIED]["state"][0].values() if isinstance(q, dict)} == {8}


def test_store_8bit_in_fabric_warns_gives_the_fabric_it_is_handed_the_plugin_and_patches_nothing(monkeypatch):
    """The old function given a Fabric is ``low_bit_checkpoints(fabric)`` (8 bits), warning once; called bare,
    as it used to be, it no longer patches ``Fabric.__init__`` for the whole process: a UsageError says what
    to use instead, and Fabrics made afterwards are stock."""
    pytest.importorskip("lightning")
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from ckptq import _deprecated
    from ckptq.errors import UsageError
    from ckptq.integrations.lightning import CkptqCheckpointIO, store_8bit_in_fabric

    monkeypatch.setattr(_deprecated, "_WARNED", set())
    init, fabric = Fabric.__init__, Fabric(accelerator="cpu", devices=1)
    with pytest.warns(DeprecationWarning, match=r"store_8bit_in_fabric\(\) is deprecated.*low_bit_checkpoints"
                                                r"\(fabric\).*Fabric\(plugins=\[ckptq.*litgpt"):
        plugin = store_8bit_in_fabric(fabric)
    assert isinstance(plugin, CkptqCheckpointIO) and plugin.bits == 8 and fabric.strategy.checkpoint_io is plugin
    with pytest.raises(UsageError, match=r"no longer changes every Fabric of the process.*plugins=\[CkptqCheckpointIO"
                                         r"\(\)\].*low_bit_checkpoints\(fabric\)"):
        store_8bit_in_fabric()
    assert Fabric.__init__ is init
    assert type(Fabric(accelerator="cpu", devices=1).strategy.checkpoint_io) is TorchCheckpointIO


def _codecs(report) -> str:
    return ckptq.info(report.outputs[0]).as_dict()["details"]["codecs"]


def test_convert_and_expand_old_keywords_map_onto_the_new_ones(trained_ckpt, tmp_path):
    """convert(all=) is all_checkpoints=, convert(dst=) and expand(dst=) are output=, convert(compress_level=N)
    is compress=N; each warns once; an old and a new name together is a TypeError, as Python's own."""
    path = trained_ckpt[0]
    out = str(tmp_path / "old.q8.safetensors")
    with pytest.warns(DeprecationWarning) as caught:
        old = ckptq.convert(path, dst=out, compress_level=5)
    assert sorted(str(w.message).split(" is ")[0] for w in caught) == ["convert(compress_level=...)", "convert(dst=...)"]
    assert "use convert(output=...)" in " ".join(str(w.message) for w in caught)
    new = ckptq.convert(path, output=str(tmp_path / "new.q8.safetensors"), compress=5)
    assert old.outputs == [out] and old.output_bytes == new.output_bytes and "zstd" in _codecs(old)
    with pytest.raises(TypeError, match="got both dst= and output="):
        ckptq.convert(path, "x.q8.safetensors", dst="y.q8.safetensors")
    with pytest.raises(TypeError, match="unexpected keyword argument 'al'"):
        ckptq.convert(path, al=True)
    with pytest.warns(DeprecationWarning, match=r"convert\(all=\.\.\.\) is deprecated.*convert\(all_checkpoints="):
        with pytest.raises(ckptq.CkptqError, match="holds no checkpoint folders"):  # the file is no run folder
            ckptq.convert(path, all=True)
    with pytest.warns(DeprecationWarning, match=r"expand\(dst=\.\.\.\) is deprecated.*expand\(output="):
        back = ckptq.expand(out, dst=str(tmp_path / "back.pt"))
    assert back.output == str(tmp_path / "back.pt")


def test_convert_compress_takes_true_or_a_level(trained_ckpt, tmp_path):
    path = trained_ckpt[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        plain = ckptq.convert(path, str(tmp_path / "a.q8.safetensors"))
        packed = ckptq.convert(path, str(tmp_path / "b.q8.safetensors"), compress=True)
    level_3 = ckptq.convert(path, str(tmp_path / "c.q8.safetensors"), compress=3)
    assert packed.output_bytes == level_3.output_bytes and "zstd" in _codecs(packed) and "zstd" not in _codecs(plain)
    with pytest.raises(ckptq.CkptqError, match="compress='yes'"):
        ckptq.convert(path, compress="yes")
