"""What every ckptq optimizer shares where users touch it as a ``torch.optim.Optimizer``: its own options
travelling with deepcopy and pickle, param groups checked when added, and ``load_state_dict`` that validates
everything before changing anything and runs torch's load hooks as torch runs them."""

from __future__ import annotations

import torch


class LowBitOptimizer(torch.optim.Optimizer):
    """The shared surface; a subclass defines ``OPTIONS`` (its own options and their defaults),
    ``_check_group(group, where)``, ``_import(state_dict) -> (state, param_groups)``, ``_state_changed()`` and
    ``_step()`` (one step of every parameter with a gradient, under no_grad)."""

    OPTIONS: dict = {}

    def _check_group(self, group: dict, where: str) -> None:
        raise NotImplementedError

    def _import(self, state_dict) -> tuple[dict, list]:
        raise NotImplementedError

    def _state_changed(self) -> None:
        raise NotImplementedError

    def _step(self) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        return loss

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``, with the group's values checked first (``ArgumentError``)."""
        if isinstance(param_group, dict):
            self._check_group({**self.defaults, **param_group}, f"param group {len(self.param_groups)}")
        super().add_param_group(param_group)
        self._state_changed()

    def __getstate__(self) -> dict:
        """torch keeps defaults, state and param_groups; the low-bit options travel too (deepcopy, pickle)."""
        return {**super().__getstate__(), **{k: getattr(self, k) for k in self.OPTIONS}}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for key, default in self.OPTIONS.items():  # objects pickled before an option existed
            if key not in self.__dict__:
                setattr(self, key, default)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict (what forms each optimizer takes: its ``_import``); ``StateMismatchError`` (a
        ``ValueError``) before anything changes when it does not fit. torch's
        ``register_load_state_dict_pre_hook``/``post_hook`` hooks run as torch runs them: pre hooks on a shallow
        copy (one may return a replacement), post hooks after the state is in place."""
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        state, groups = self._import(state_dict)
        self.state.clear()
        self.state.update(state)
        self.param_groups = groups
        self._state_changed()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
