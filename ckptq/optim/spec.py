"""What a low-bit optimizer declares, and what follows from a declaration: its states (``State``: the key
torch uses, the role ``ckptq.codec.roles`` gives it, its transform), the codebook each state gets at a code
width (``codebook``: the one ``ckptq convert`` writes for that role, so a converted file resumes as stored),
and fresh or fp32 states quantized as convert quantizes them (``quantize_states``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codec import dtensor, exactness, policy, quant, roles
from ..kernels import contract


@dataclass(frozen=True)
class State:
    """One per-parameter state an optimizer keeps low-bit (fp32 below ``min_size`` elements)."""

    key: str  # torch's state key (``exp_avg``, ``momentum_buffer``, ...)
    role: str  # ``ckptq.codec.roles``: decides the codebook, as convert decides it
    transform: str = "none"  # "none", "sqrt" (stores sqrt(value): non-negative second moments) or "ratio"
    divisor: str | None = None  # a "ratio" state: the key of the "sqrt" state it is stored relative to
    seeded: bool = True  # requantized stochastically where the optimizer rounds stochastically
    init: str | None = None  # the param group key of its initial value (Adagrad's); None: zeros
    slot: str | None = None  # the rule's name for it (``rules.Rule.states``) where that is not ``key``

    @property
    def slot_name(self) -> str:
        return self.slot or self.key

    @property
    def kernel_transform(self) -> int:
        return contract.TRANSFORM_NAMES[self.transform]


def policy_of(state: State, bits: int) -> policy.Policy:
    """The codec a state gets at ``bits`` bits: a ratio's codebook, Adam's by its key, else its role's."""
    if state.transform == "ratio":
        return policy.ratio_policy(bits)
    return policy.policy_for(state.key, bits, None if state.role == roles.ADAM else state.role)


def codebook(state: State, bits: int) -> torch.Tensor:
    return policy_of(state, bits).qmap()


def _quantize(t: torch.Tensor, state: State, block_size: int, bits: int) -> dict:
    """One fp32 state on its own (a tensor, or a DTensor quantized shard by shard and placed like it)."""
    q = quant.quantize_state(dtensor.local(t).float(), state.key, block_size, bits=bits,
                             role=None if state.role == roles.ADAM else state.role)
    q["dtype"] = "float32"  # the state is fp32 whatever the checkpoint stored
    return dtensor.place(q, t) if dtensor.is_dtensor(t) else q


def quantize_states(dense: dict, states: tuple, eps: float | None, block_size: int, bits: int) -> dict:
    """fp32 states {key: tensor or DTensor} -> qstates with ``bits``-bit codes, as ``ckptq convert`` writes
    them: ratio states relative to their exact divisor with eps' ``eps`` (or on their own where the ratio
    would overflow fp32: ``codec.exactness.ratio_fits``)."""
    by_key = {s.key: s for s in states}
    out = {}
    for key, t in dense.items():
        s = by_key[key]
        if s.transform != "ratio" or eps is None or \
                not exactness.ratio_fits(dtensor.local(t), dtensor.local(dense[s.divisor]), eps):
            out[key] = _quantize(t, s if s.transform != "ratio" else State(key, s.role), block_size, bits)
            continue
        q = quant.quantize_ratio(dtensor.local(t).float(), dtensor.local(dense[s.divisor]).float(), eps, block_size,
                                 divisor_key=s.divisor, bits=bits)
        q["dtype"] = "float32"
        out[key] = dtensor.place(q, t) if dtensor.is_dtensor(t) else q
    return out
