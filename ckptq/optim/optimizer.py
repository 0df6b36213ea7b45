"""8-bit (and 4-bit) Adam and AdamW that keep PyTorch's state keys and resume from ``ckptq`` checkpoints.

State per parameter: ``step`` (0-dim fp32 tensor, as torch), ``exp_avg``, ``exp_avg_sq`` and, with
amsgrad, ``max_exp_avg_sq``: each a qstate dict (``ckptq.qstate``: uint8 codes + fp32 absmax per
block, in rows: ``ckptq.codec.qstate``) for parameters with at least ``min_size`` elements, a plain fp32 tensor below.
``bits=4`` (or the ``AdamW4bit``/``Adam4bit`` classes, which only set it) stores two 4-bit codes per
byte on 16-entry codebooks, block 128 by default: about half the memory of 8-bit state. Both moments'
new codes are rounded stochastically at every step (``ckptq.adam.step_param`` says why). A
``ckptq convert --bits 4`` file stores the ratio in 6 bits and sqrt(v) in 2 (``policy.convert_width``);
loading one requantizes it to 4 + 4.
``exp_avg`` is stored as the ratio m / (sqrt(v) + eps') to ``exp_avg_sq`` (``qstate``'s ratio
transform, eps' = ``policy.ratio_eps`` of the step), exactly as ``ckptq convert`` writes it.
A step is planned once per param group and layout (``ckptq.optim.grouping``): the low-bit parameters of a
group go through one fused kernel call (``ckptq.codec.grouped``: C on the CPU, one Triton launch on CUDA,
the PyTorch reference elsewhere), the small fp32 ones through one more (``grouped.dense_group``); only what changes
from step to step (gradients, the step count) is gathered. Design after torchao's low-bit optimizers
(``torchao/optim``) and apex's ``multi_tensor_apply``.

Where users touch them they behave as ``torch.optim`` optimizers: torch's arguments (``ckptq.optim_args``),
complex parameters (stepped through ``view_as_real``, as torch does), hooks, deepcopy/pickle, and
``load_state_dict`` of older or torch-written state dicts (``ckptq.optim.state_io``).
"""

from __future__ import annotations


import warnings

import torch

from . import args as optim_args, grouping
from ..codec import dtensor, foreign, ops, qstate, sharded
from ..errors import InputError, StateMismatchError, UsageError
from .args import GROUP_FLAGS
from .surface import LowBitOptimizer
from .state_io import (MOMENT_KEYS, expand_on_load, import_state_dict, step_tensor, to_torch_state_dict,
                       with_float_eps)

BACKENDS = ops.BACKENDS
OPTIONS = {"block_size": 256, "min_size": 4096, "backend": "auto", "bits": 8, "rounding": "auto"}  # ckptq's own, beyond torch's arguments


class _Adam8bitBase(LowBitOptimizer):
    decoupled = True
    OPTIONS = OPTIONS

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        *,
        maximize=False,
        foreach=None,
        fused=None,
        capturable=False,
        differentiable=False,
        block_size=None,
        min_size=4096,
        backend="auto",
        bits=8,
        rounding="auto",
    ):
        """torch.optim.Adam(W)'s arguments (``foreach``/``fused``/``capturable``/``differentiable`` as
        ``ckptq.optim_args`` documents), plus ``bits`` (8 or 4), ``block_size`` (default 256 for 8 bits,
        128 for 4), ``min_size`` and ``backend`` for the quantized state, and ``rounding``: how the moments'
        new codes are rounded at every step: "auto" (to nearest at 8 bits, stochastically below), "nearest"
        or "stochastic" (seeded by the step count and the parameter's index: a resumed run draws the same
        numbers). Bad values raise ``ArgumentError``, a ``ValueError``, before anything is built."""
        optim_args.check_hyper(lr, betas, eps, weight_decay)
        block_size = optim_args.check_options(block_size, min_size, backend, bits)
        flags = dict(amsgrad=amsgrad, maximize=maximize, foreach=foreach, fused=fused)
        flags.update(capturable=capturable, differentiable=differentiable)
        optim_args.check_flags(flags)
        self.block_size, self.min_size, self.backend, self.bits = block_size, min_size, backend, bits
        self.rounding = optim_args.check_rounding(rounding)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **flags))

    def _check_group(self, group: dict, where: str) -> None:
        optim_args.check_group(group, where)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # groups pickled before a flag existed, as torch's Adam does
            for key, default in GROUP_FLAGS.items():
                group.setdefault(key, default)

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        keys = MOMENT_KEYS[: 3 if group["amsgrad"] else 2]
        zeros = {k: self._zeros(p) for k in keys}
        state = {"step": step_tensor(0.0, p, group)}
        state.update(self._quantize_moments(zeros, group, 0.0) if self._quantized(p) else zeros)
        return state

    def _quantized(self, p: torch.Tensor) -> bool:
        """Low-bit state from ``min_size`` elements of the (global) parameter; a DTensor's where its rows
        can follow its shards (``ckptq.codec.sharded``), else fp32 state, said once per parameter."""
        if p.numel() < self.min_size:
            return False
        if dtensor.is_dtensor(p) and not dtensor.shardable(p):
            _warn_fp32(self, p)
            return False
        return True

    @staticmethod
    def _zeros(p: torch.Tensor) -> torch.Tensor:
        """fp32 zeros shaped and placed like ``p`` (a DTensor for a DTensor)."""
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    def _quantize(self, t: torch.Tensor, key: str) -> dict:
        return sharded.quantize(t, key, self.block_size, self.bits)

    def _quantize_moments(self, dense: dict, group: dict, step: float) -> dict:
        """fp32 moments {key: tensor} -> qstates as ``ckptq convert`` writes them (``sharded.quantize_moments``;
        DTensor moments are quantized shard by shard into state placed like them)."""
        return sharded.quantize_moments(dense, group, step, self.block_size, self.bits)

    def _step(self) -> None:
        self._check_not_meta()
        capturing = _capturing(self)
        self._step_plan_now(capturing).step(self)

    def state_dict(self) -> dict:
        """torch's ``state_dict``, with every first moment's eps' a float, as the format (docs/FORMAT.md) and
        ``load_state_dict`` take it: a capturable step keeps it on the device as a 0-dim tensor, read back here
        (``state_io.with_float_eps``), never in the step."""
        return with_float_eps(super().state_dict())

    def _step_plan_now(self, capturing: bool = False) -> grouping.StepPlan:
        """The grouped plan for the parameters that have gradients now (``ckptq.optim.grouping``): the kept
        one while nothing it depends on changed, else a new one (new state is created first)."""
        active = [(i, p, gi) for i, (p, gi) in enumerate(
            (p, gi) for gi, group in enumerate(self.param_groups) for p in group["params"]) if p.grad is not None]
        plan = getattr(self, "_step_plan", None)
        signature = self._signature(active)
        if plan is not None and plan.signature == signature:
            if capturing and plan.single:
                raise UsageError(f"{type(self).__name__}.step() is being captured in a CUDA graph, but a parameter "
                                 "is not contiguous (its step reads its step count on the host); make it contiguous")
            return plan
        if capturing:
            raise UsageError(f"{type(self).__name__}.step() is being captured in a CUDA graph, but its parameters, "
                             "their gradients or its state changed since the last step (the step plan is rebuilt on "
                             "the host); run one step() outside the capture first")
        for _, p, gi in active:
            self._prepare_state(p, self.param_groups[gi])
        members = [grouping.Member(i, p, grouping._data(p), self.state[p], gi) for i, p, gi in active]
        self._step_plan = grouping.StepPlan(self, members, self._signature(active))
        return self._step_plan

    def _signature(self, active: list) -> tuple:
        """What a kept plan depends on beyond the state it was built on (``_state_version`` counts that)."""
        flags = tuple((bool(g["amsgrad"]), bool(g["maximize"]), bool(g["capturable"])) for g in self.param_groups)
        return (getattr(self, "_state_version", 0), self.rounding, flags, tuple(id(p) for _, p, _ in active),
                tuple(p.grad.dtype for _, p, _ in active))

    def _prepare_state(self, p: torch.Tensor, group: dict) -> None:
        """State for a parameter that steps for the first time, and amsgrad's max_exp_avg_sq when turned on."""
        if p.grad.is_sparse:
            raise UsageError(f"{type(self).__name__} does not support sparse gradients; use torch.optim.SparseAdam")
        real = torch.view_as_real(p) if p.is_complex() else p
        state = self.state[p]
        if not state:
            state.update(self._init_state(real, group))
            self._state_changed()
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = self._like(state["exp_avg_sq"], real)
            self._state_changed()

    def _state_changed(self) -> None:
        """The state or the param groups changed: the next step regroups."""
        self._state_version = getattr(self, "_state_version", 0) + 1
        self._step_plan = None

    def _check_not_meta(self) -> None:
        """Before any parameter steps: meta parameters have no values to update (a step would build
        meta state that silently stays meta after ``module.to_empty``)."""
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if p.grad is not None and (p.is_meta or p.grad.is_meta):
                    raise UsageError(
                        f"parameter {j} of param group {i} (shape {tuple(p.shape)}) or its gradient is on the meta "
                        "device; materialize the model (module.to_empty(device=...)) before stepping"
                    )

    def _like(self, template, p: torch.Tensor):
        """A zero max_exp_avg_sq in the same representation as ``template`` (amsgrad turned on later)."""
        zeros = self._zeros(p)
        return self._quantize(zeros, "max_exp_avg_sq") if qstate.is_qstate(template) else zeros

    def _import(self, state_dict) -> tuple[dict, list]:
        """This optimizer's own state dict, a torch Adam/AdamW one (fp32 moments, quantized here as
        ``ckptq convert`` does: ``quant.quantize_state``, exp_avg by ``quant.quantize_ratio``), or
        ``ckptq.load(path)["optimizer"]`` (qstates used as stored; a plain, pre-ratio exp_avg is re-encoded as a
        ratio by the next step), or a bitsandbytes / torchao 8-bit optimizer's state dict (decoded, then
        quantized as ckptq's). Group flags an older torch did not save (``maximize``...) are filled in as torch
        fills them; torch's implementation flags (``foreach``, ``fused``...) stay this optimizer's."""
        return import_state_dict(self, _from_other_8bit_optimizers(state_dict))


def _from_other_8bit_optimizers(state_dict):
    """bitsandbytes' or torchao's 8-bit state decoded to torch's fp32 form (``ckptq.foreign``), in a copy;
    StateMismatchError naming the parameter where one is damaged."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) \
            or not any(foreign.kind(v) for v in state_dict["state"].values()):
        return state_dict
    state = dict(state_dict["state"])
    for pid, pstate in state.items():
        try:
            converted = foreign.to_torch_state(pstate)
        except InputError as e:
            raise StateMismatchError(f"state of parameter {pid}: {e}") from None
        if converted is not None:
            state[pid] = converted
    return {**state_dict, "state": state}


class AdamW8bit(_Adam8bitBase):
    """``torch.optim.AdamW`` with blockwise 8-bit moments (decoupled weight decay; default 1e-2)."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class Adam8bit(_Adam8bitBase):
    """``torch.optim.Adam`` with blockwise 8-bit moments (L2 weight decay added to the gradient)."""

    decoupled = False


class AdamW4bit(AdamW8bit):
    """``AdamW8bit`` with ``bits=4``: two 4-bit codes per byte, block 128 (about 1.06 bytes per parameter
    for both moments instead of 2.03)."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{"bits": 4, **kwargs})


class Adam4bit(Adam8bit):
    """``Adam8bit`` with ``bits=4`` (see ``AdamW4bit``)."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{"bits": 4, **kwargs})


__all__ = ["AdamW8bit", "Adam8bit", "AdamW4bit", "Adam4bit", "StateMismatchError", "expand_on_load",
           "to_torch_state_dict"]


def _capturing(opt) -> bool:
    """Whether this step is being captured in a CUDA graph; if so every param group must be capturable (as
    torch's optimizers check): the others read their step counts on the host, which a capture cannot hold."""
    if not torch.cuda.is_initialized() or not torch.cuda.is_current_stream_capturing():
        return False
    if not all(g["capturable"] for g in opt.param_groups):
        raise UsageError(f"{type(opt).__name__}.step() is being captured in a CUDA graph but a param group has "
                         "capturable=False; build the optimizer with capturable=True")
    return True


def _warn_fp32(opt, p) -> None:
    """Say once per parameter that a DTensor parameter keeps fp32 state, and why."""
    said = opt.__dict__.setdefault("_fp32_said", set())
    if id(p) in said:
        return
    said.add(id(p))
    why = ("a 1-D parameter: its one row is split across ranks" if p.dim() < 2 else
           f"sharded along another dim than 0 ({p.placements}): blocks would straddle ranks")
    names = [n for g in opt.param_groups for q, n in zip(g["params"], g.get("param_names", ())) if q is p]
    what = f"parameter {names[0]!r}" if names else "a DTensor parameter"
    warnings.warn(f"ckptq: {what} of shape {tuple(p.shape)} keeps fp32 optimizer state ({why}); state of "
                  "parameters sharded on dim 0 (FSDP2) is low-bit", RuntimeWarning, stacklevel=4)
