"""A live bitsandbytes Adam optimizer (``AdamW8bit``, ``Adam8bit``, their paged and 32-bit kin: two states,
``state1`` the first moment and ``state2`` the second) given the state a ckptq file holds for it, in
bitsandbytes' own form: what its ``load_state_dict`` takes and its step reads. Torch's form (``exp_avg``,
``exp_avg_sq``), which is what ``ckptq convert`` makes of bitsandbytes' state, loads into it without a word
and fails at the first step with ``KeyError: 'state1'``.

Per parameter, as bitsandbytes' ``init_state`` lays it out (bitsandbytes 0.44+): fp32 ``state1``/``state2``
for parameters below its ``min_8bit_size`` or with ``optim_bits=32``; else uint8 codes of the parameter's
shape on its dynamic maps (signed for ``state1``, unsigned for ``state2``), one fp32 absmax per block of
256, quantized by bitsandbytes' own ``quantize_blockwise``. Nested under ``__bnb_optimizer_quant_state__``
as its ``state_dict`` writes them. bitsandbytes is imported only here, when such an optimizer is at hand.
"""

from __future__ import annotations

import torch

from ..codec import foreign, quant

BLOCK_SIZE = 256  # bitsandbytes' 8-bit optimizers since 0.44


def is_bnb_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """bitsandbytes' ``Optimizer2State`` family (two moments), told without importing bitsandbytes."""
    return type(optimizer).__module__.startswith("bitsandbytes.") and hasattr(optimizer, "name2qmap") \
        and "Optimizer2State" in {c.__name__ for c in type(optimizer).__mro__}


def state_dict_for(optimizer, state_dict: dict) -> dict:
    """``state_dict`` (torch's form, moments fp32 or ckptq's low-bit) with each parameter's moments in
    ``optimizer``'s own bitsandbytes form; states already in that form, or without both moments, stay."""
    saved = [pid for g in state_dict["param_groups"] for pid in g["params"]]
    live = [(gi, pi, p, g) for gi, g in enumerate(optimizer.param_groups) for pi, p in enumerate(g["params"])]
    state = dict(state_dict["state"])
    for pid, where in zip(saved, live):
        pstate = state.get(pid)
        if isinstance(pstate, dict) and foreign.kind(pstate) is None and {"exp_avg", "exp_avg_sq"} <= set(pstate):
            state[pid] = _param_state(optimizer, *where, pstate)
    return {**state_dict, "state": state}


def _param_state(optimizer, gi: int, pi: int, p: torch.Tensor, group: dict, pstate: dict) -> dict:
    from bitsandbytes import functional as F

    dense = dict(pstate)
    quant.decode_qstates(dense)  # a first moment stored as a ratio decodes through its second moment
    m, v = (dense[k].float().reshape(p.shape).to(p.device) for k in ("exp_avg", "exp_avg_sq"))
    config = optimizer.get_config(gi, pi, group)
    if config["optim_bits"] == 32 or p.numel() < config["min_8bit_size"]:
        q = {"state1": m, "state2": v}
    else:
        if "dynamic" not in optimizer.name2qmap:
            optimizer.fill_qmap()
        qmap1, qmap2 = (optimizer.name2qmap[k].to(p.device) for k in ("dynamic", "udynamic"))
        codes1, s1 = F.quantize_blockwise(m, code=qmap1, blocksize=BLOCK_SIZE)
        codes2, s2 = F.quantize_blockwise(v, code=qmap2, blocksize=BLOCK_SIZE)
        q = {"state1": codes1, "state2": codes2, "qmap1": qmap1, "qmap2": qmap2, "absmax1": s1.absmax,
             "absmax2": s2.absmax}
    if config["max_unorm"] > 0.0:
        q["unorm_vec"] = torch.zeros((1,), device=p.device)
    step = dense.get("step", 0)
    return {"step": int(float(step.item() if isinstance(step, torch.Tensor) else step)), foreign.BNB_NESTED: q}
