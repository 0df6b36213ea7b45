"""8-bit Adam and AdamW that keep PyTorch's state keys and resume from ``ckptq`` checkpoints.

State per parameter: ``step`` (0-dim fp32 tensor, as torch), ``exp_avg``, ``exp_avg_sq`` and, with
amsgrad, ``max_exp_avg_sq``: each a qstate dict (``ckptq.qstate``: uint8 codes + fp32 absmax per
block + codebook) for parameters with at least ``min_size`` elements, a plain fp32 tensor below.
``exp_avg`` is stored as the ratio m / (sqrt(v) + eps') to ``exp_avg_sq`` (``qstate``'s ratio
transform, eps' = ``qstate.ratio_eps`` of the step), exactly as ``ckptq convert`` writes it.
A step goes ``step`` -> ``ckptq.adam.step_param`` -> ``ckptq.ops.adam8bit_step`` (one fused kernel per
parameter: C on the CPU, Triton on CUDA, the PyTorch reference elsewhere). Design after torchao's
low-bit optimizers (``torchao/optim``).
"""

from __future__ import annotations


import torch

from . import adam, ops, qstate, sharded
from .errors import StateMismatchError, UsageError
from .optim_io import MOMENT_KEYS, import_state_dict

BACKENDS = ops.BACKENDS


class _Adam8bitBase(torch.optim.Optimizer):
    decoupled = True

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
        block_size=256,
        min_size=4096,
        backend="auto",
    ):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise UsageError(f"a tensor lr must have one element, got shape {tuple(lr.shape)}")
        if not 0.0 <= float(lr) or not 0.0 <= eps or not 0.0 <= weight_decay:
            raise UsageError(f"lr, eps and weight_decay must be >= 0, got {float(lr)}, {eps}, {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise UsageError(f"betas must lie in [0, 1), got {betas}")
        if backend not in BACKENDS:
            raise UsageError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        ops.check_block_size(block_size)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)
        self.block_size, self.min_size, self.backend = block_size, min_size, backend

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        keys = MOMENT_KEYS[: 3 if group["amsgrad"] else 2]
        zeros = {k: self._zeros(p) for k in keys}
        state = {"step": torch.tensor(0.0, dtype=torch.float32)}
        state.update(self._quantize_moments(zeros, group, 0.0) if self._quantized(p) else zeros)
        return state

    def _quantized(self, p: torch.Tensor) -> bool:
        """8-bit state from ``min_size`` elements of the (global) parameter; a DTensor's only where its
        blocks can follow its shards (``ckptq.sharded``)."""
        return p.numel() >= self.min_size and (not sharded.is_dtensor(p) or sharded.row_aligned(p, self.block_size))

    @staticmethod
    def _zeros(p: torch.Tensor) -> torch.Tensor:
        """fp32 zeros shaped and placed like ``p`` (a DTensor for a DTensor)."""
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    def _quantize(self, t: torch.Tensor, key: str) -> dict:
        return sharded.quantize(t, key, self.block_size)

    def _quantize_moments(self, dense: dict, group: dict, step: float) -> dict:
        """fp32 moments {key: tensor} -> qstates as ``ckptq convert`` writes them (``sharded.quantize_moments``;
        DTensor moments are quantized shard by shard into state placed like them)."""
        return sharded.quantize_moments(dense, group, step, self.block_size)

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_param(p, group)
        return loss

    def _step_param(self, p: torch.Tensor, group: dict) -> None:
        if p.grad.is_sparse:
            raise UsageError(f"{type(self).__name__} does not support sparse gradients; use torch.optim.SparseAdam")
        state = self.state[p]
        if not state:
            state.update(self._init_state(p, group))
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = self._like(state["exp_avg_sq"], p)
        adam.step_param(p, state, group, self.decoupled, self.backend)

    def _like(self, template, p: torch.Tensor):
        """A zero max_exp_avg_sq in the same representation as ``template`` (amsgrad turned on later)."""
        zeros = self._zeros(p)
        return self._quantize(zeros, "max_exp_avg_sq") if qstate.is_qstate(template) else zeros

    def load_state_dict(self, state_dict: dict) -> None:
        """Load this optimizer's own state dict, a torch Adam/AdamW one (fp32 moments, quantized here
        as ``ckptq convert`` does: ``qstate.quantize_state``, exp_avg by ``qstate.quantize_ratio``), or
        ``ckptq.load(path)["optimizer"]`` (qstates used as stored; a plain, pre-ratio exp_avg is
        re-encoded as a ratio by the next step).

        Raises ``StateMismatchError`` before changing anything if groups, counts or shapes differ.
        """
        state, groups = import_state_dict(self, state_dict)
        self.state.clear()
        self.state.update(state)
        self.param_groups = groups


class AdamW8bit(_Adam8bitBase):
    """``torch.optim.AdamW`` with blockwise 8-bit moments (decoupled weight decay; default 1e-2)."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class Adam8bit(_Adam8bitBase):
    """``torch.optim.Adam`` with blockwise 8-bit moments (L2 weight decay added to the gradient)."""

    decoupled = False


__all__ = ["AdamW8bit", "Adam8bit", "StateMismatchError"]
