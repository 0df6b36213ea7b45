"""The low-bit optimizer engine: everything a ckptq optimizer does that is not its own math, written once.

An optimizer (one file each: ``adam``, ``sgd``, ``lion``, ``muon``, ``rmsprop``, ``adagrad``, ``nadam``,
``radam``, ``ademamix``) declares:

- ``RULE``: its elementwise rule (``ckptq.kernels.rules``: the math every backend runs), and ``_flags(group)``,
  the rule's switches for a param group;
- ``STATES``: its per-parameter states (``spec.State``: torch's key, the role, the transform), of which
  ``_declared(group)`` are kept for a group (by default those the rule's flags name);
- ``_values(group)`` and ``_formula(x, *values, step, fresh)``: the step's scalars by the rule's field names,
  written once against a math namespace (``ckptq.codec.scalar_math``) for the host and the device;
- ``__init__`` with its torch counterpart's arguments, and ``_check_group(group)``: its torch counterpart's
  checks and message openings ("Invalid learning rate: ..."), raised as ``ArgumentError``.

The engine gives it: options (``bits``, ``block_size``, ``min_size``, ``backend``, ``rounding``), state
creation (low-bit from ``min_size`` elements, fp32 below), the grouped step (``plan``), ``capturable``,
DTensor (FSDP2) parameters, complex parameters (stepped through ``view_as_real``), non-contiguous ones
(through a contiguous copy), stochastic rounding, state dicts in torch's form and ``load_state_dict`` of
its own, its torch counterpart's, a converted file's and bitsandbytes'/torchao's forms (``state_io``),
validated before anything changes, deepcopy and pickle, torch's hooks, and the integrations (which test
``isinstance(opt, LowBitOptimizer)``).
"""

from __future__ import annotations

import warnings

import torch

from ..codec import dtensor, ops, policy, qstate, scalar_math
from ..errors import ArgumentError, UsageError
from . import args as optim_args, plan, spec, state_io

OPTIONS = {"block_size": 256, "min_size": 4096, "backend": "auto", "bits": 8, "rounding": "auto"}


class LowBitOptimizer(torch.optim.Optimizer):
    """The engine (see the module docstring); subclasses declare ``RULE``, ``STATES`` and their scalars."""

    OPTIONS = OPTIONS
    RULE = None
    STATES: tuple = ()
    SCALAR_STATES: dict = {}  # per-parameter 0-dim fp32 states beside ``step`` (NAdam's mu_product): initial values
    complex_ok = True  # complex parameters step through view_as_real (torch's elementwise optimizers do)
    # param-group keys that a loaded state dict may lack and that then keep the optimizer's own values (keys
    # the counterpart keeps on the optimizer, not in its state dict); other keys it lacks take the class
    # default, as torch fills the flags an older torch did not save
    KEPT_ON_LOAD: tuple = ()

    def __init__(self, params, defaults: dict, *, block_size=None, min_size=4096, backend="auto", bits=8,
                 rounding="auto"):
        self.block_size = optim_args.check_options(block_size, min_size, backend, bits)
        self.min_size, self.backend, self.bits = int(min_size), backend, bits
        self.rounding = optim_args.check_rounding(rounding)
        self._checked({**defaults, "params": []}, None)
        if not isinstance(params, torch.Tensor):  # (torch refuses a tensor, with its TypeError)
            params = list(params)  # read once: a generator
        # messages name a param group only where the caller wrote groups: a plain list of parameters reads
        # as the constructor's arguments, with torch's message openings
        self._group_names = bool(params) and isinstance(params[0], dict)
        super().__init__(params, defaults)
        self._group_names = True

    # what each optimizer declares

    def _check_group(self, group: dict) -> None:
        """Refuse a param group's bad values (every key present: defaults filled in) with ``ArgumentError``
        (``KeyError``/``TypeError`` read as one), opening as its torch counterpart's messages do."""
        raise NotImplementedError

    def _flags(self, group: dict) -> int:
        """The rule's flag word for a param group (``rules.MAXIMIZE`` added from ``maximize``)."""
        return 0

    def _declared(self, group: dict) -> tuple:
        """The states a parameter of ``group`` keeps, in kernel order."""
        names = self.RULE.states(self._rule_flags(group))
        return tuple(s for s in self.STATES if s.slot_name in names)

    def _values(self, group: dict) -> tuple:
        raise NotImplementedError

    def _formula(self, x, *values, step, fresh) -> dict:
        """The step's scalars by the rule's field names (``decode_eps`` excepted: it comes from the states)."""
        raise NotImplementedError

    def _stateless(self, group: dict) -> bool:
        """A group whose parameters keep no state (SGD without momentum): stepped by ``_plain_step``."""
        return False

    def _apply(self, group: dict, params: list, directions: list) -> None:
        """Rules that write a direction (Muon): apply it to the parameters."""

    def _ratio_eps(self, group: dict, step: float) -> float:
        """eps' of ratio states written outside a step (fresh state, fp32 state loaded)."""
        return policy.ratio_eps_for(group, step)

    # the engine's own

    def _checked(self, group: dict, where: str | None) -> None:
        """``_check_group`` with the group named first in the message (``where``: "param group 1"; None for
        the constructor's own arguments, whose messages open as torch's)."""
        try:
            for key, default in optim_args.signature_defaults(type(self)).items():
                if isinstance(default, bool) and key in group and not isinstance(group[key], bool):
                    raise ArgumentError(f"{key} must be True or False, got {group[key]!r:.40}")
            self._check_group(group)
        except (ArgumentError, KeyError, TypeError) as e:
            message = f"has no {e}" if isinstance(e, KeyError) else str(e)
            raise ArgumentError(f"{where}: {message}" if where else message) from None

    def _rule_flags(self, group: dict) -> int:
        from ..kernels.rules import MAXIMIZE

        return self._flags(group) | (MAXIMIZE if group.get("maximize", False) else 0)

    def _codebook(self, state: spec.State) -> torch.Tensor:
        return spec.codebook(state, self.bits)

    def _formula_of(self, group: dict, step: float, fresh: bool, extra: tuple = ()) -> dict:
        """The formula on the host: group values that are tensors (a tensor lr) read as floats; ``extra``: the
        member's ``SCALAR_STATES`` values, in their order."""
        values = tuple(float(v) if isinstance(v, torch.Tensor) else v for v in self._values(group))
        return self._formula(scalar_math.HOST, *values, step=step, fresh=fresh,
                             **dict(zip(self.SCALAR_STATES, extra)))

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_params()
        capturing = _capturing(self)
        directions = self._plan_now(capturing).step(self)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if self._stateless(group):
                self._plain_step(_host_values(group), params)
            elif directions:
                self._apply(_host_values(group), params, [directions[id(p)] for p in params])
        return loss

    def _plain_step(self, group: dict, params: list) -> None:
        raise NotImplementedError

    def _check_params(self) -> None:
        """Before any parameter steps: what no kernel can take (meta, sparse, complex where not supported)."""
        name = type(self).__name__
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.is_meta or p.grad.is_meta:
                    raise UsageError(f"parameter {j} of param group {i} (shape {tuple(p.shape)}) or its gradient is "
                                     "on the meta device; materialize the model (module.to_empty(device=...)) before "
                                     "stepping")
                if p.grad.is_sparse:
                    raise UsageError(f"{name} does not support sparse gradients")
                if p.is_complex() and not self.complex_ok:
                    raise RuntimeError(f"{name} does not support complex parameters")

    def _plan_now(self, capturing: bool = False) -> plan.StepPlan:
        """The grouped plan for the parameters that have gradients now: the kept one while nothing it depends
        on changed, else a new one (new state is created first)."""
        active = [(i, p, gi) for i, (p, gi) in enumerate(
            (p, gi) for gi, group in enumerate(self.param_groups) for p in group["params"])
            if p.grad is not None and not self._stateless(self.param_groups[gi])]
        kept = getattr(self, "_step_plan", None)
        signature = self._signature(active)
        if kept is not None and kept.signature == signature:
            return kept
        if capturing:
            raise UsageError(f"{type(self).__name__}.step() is being captured in a CUDA graph, but its parameters, "
                             "their gradients or its state changed since the last step (the step plan is rebuilt on "
                             "the host); run one step() outside the capture first")
        fresh = {id(p) for _, p, gi in active if self._prepare_state(p, self.param_groups[gi])}
        members = []
        for i, p, gi in active:
            flat, target = plan.data_of(p)
            keys = tuple(s.key for s in self._declared(self.param_groups[gi]))
            members.append(plan.Member(i, p, flat, target, self.state[p], gi, keys, id(p) in fresh))
        self._step_plan = plan.StepPlan(self, members, self._signature(active))
        return self._step_plan

    def _signature(self, active: list) -> tuple:
        """What a kept plan depends on beyond the state it was built on (``_state_version`` counts that)."""
        flags = tuple((self._rule_flags(g), bool(g.get("capturable", False))) for g in self.param_groups)
        contiguous = tuple(dtensor.local(p).is_contiguous() for _, p, _ in active)
        return (getattr(self, "_state_version", 0), self.rounding, flags, tuple(id(p) for _, p, _ in active),
                tuple(p.grad.dtype for _, p, _ in active), contiguous)

    def _prepare_state(self, p: torch.Tensor, group: dict) -> bool:
        """State for a parameter that steps for the first time (True), and states a group's flags added since
        (amsgrad's max_exp_avg_sq turned on) as zeros in the same representation."""
        real = torch.view_as_real(p) if p.is_complex() else p
        state = self.state[p]
        if not state:
            state.update(self._init_state(real, group))
            self._state_changed()
            return True
        missing = [s for s in self._declared(group) if s.key not in state]
        if missing:
            template = next(state[s.key] for s in self._declared(group) if s.key in state)
            for s in missing:
                zeros = self._zeros(real, group, s)
                state[s.key] = (spec.quantize_states({s.key: zeros}, (s,), None, self.block_size, self.bits)[s.key]
                                if qstate.is_qstate(template) else zeros)
            self._state_changed()
        return False

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        declared = self._declared(group)
        dense = {s.key: self._zeros(p, group, s) for s in declared}
        state = {"step": state_io.step_tensor(0.0, p, group)}
        state.update({k: state_io.step_tensor(v, p, group) for k, v in self.SCALAR_STATES.items()})
        if self._quantized(p):
            dense = spec.quantize_states(dense, declared, self._ratio_eps(group, 0.0), self.block_size, self.bits)
        state.update(dense)
        return state

    @staticmethod
    def _zeros(p: torch.Tensor, group: dict, s: spec.State) -> torch.Tensor:
        """fp32 initial state shaped and placed like ``p`` (a DTensor for a DTensor): zeros or its init value."""
        t = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        return t.fill_(float(group[s.init])) if s.init else t

    def _quantized(self, p: torch.Tensor) -> bool:
        """Low-bit state from ``min_size`` elements of the (global) parameter; a DTensor's where its rows
        can follow its shards (``ckptq.codec.sharded``), else fp32 state, said once per parameter."""
        if p.numel() < self.min_size:
            return False
        if dtensor.is_dtensor(p) and not dtensor.shardable(p):
            _warn_fp32(self, p)
            return False
        return True

    def _state_changed(self) -> None:
        """The state or the param groups changed: the next step regroups."""
        self._state_version = getattr(self, "_state_version", 0) + 1
        self._step_plan = None

    # torch's surface

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``, with the group's values checked first (``ArgumentError``)."""
        if isinstance(param_group, dict):
            where = f"param group {len(self.param_groups)}"
            if "params" not in param_group:
                raise ArgumentError(f"{where} has no 'params'; every param group needs them")
            params = param_group["params"]
            if isinstance(params, torch.Tensor):
                param_group = {**param_group, "params": [params]}
            elif not isinstance(params, (set, list)):
                param_group = {**param_group, "params": list(params)}  # a generator is read once, here
            self._checked({**self.defaults, **param_group}, where if getattr(self, "_group_names", True) else None)
        super().add_param_group(param_group)
        self._state_changed()

    def __getstate__(self) -> dict:
        """torch keeps defaults, state and param_groups; the low-bit options travel too (deepcopy, pickle)."""
        return {**super().__getstate__(), **{k: getattr(self, k) for k in self._pickled()}}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for key, default in self.OPTIONS.items():  # objects pickled before an option existed
            if key not in self.__dict__:
                setattr(self, key, default)
        self._state_changed()

    def _pickled(self) -> tuple:
        """The attributes that travel with deepcopy and pickle beyond torch's."""
        return tuple(self.OPTIONS)

    def state_dict(self) -> dict:
        """torch's ``state_dict``, with every ratio state's eps' a float, as the format (docs/FORMAT.md) and
        ``load_state_dict`` take it (a capturable step keeps it on the device as a 0-dim tensor)."""
        return state_io.with_float_eps(super().state_dict())

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict: this optimizer's own, its torch counterpart's (fp32 states, quantized as
        ``ckptq convert`` quantizes them), ``ckptq.load(path)["optimizer"]`` (low-bit states used as stored
        where they fit, else requantized), or a bitsandbytes / torchao 8-bit optimizer's (decoded first).
        ``StateMismatchError`` (a ``ValueError``) before anything changes when it does not fit. torch's
        load pre/post hooks run as torch runs them."""
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        state, groups = state_io.import_state_dict(self, state_dict)
        self.state.clear()
        self.state.update(state)
        self.param_groups = groups
        self._state_changed()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _host_values(group: dict) -> dict:
    """A param group as the steps written in torch ops on the host read it (``_plain_step``, ``_apply``): its
    1-element tensor values (a tensor lr, of any shape torch takes) as floats, as ``_formula_of`` reads them."""
    return {k: float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v for k, v in group.items()}


def _capturing(opt) -> bool:
    """Whether this step is being captured in a CUDA graph; if so every param group must be capturable (as
    torch's optimizers check): the others read their step counts on the host, which a capture cannot hold."""
    if not torch.cuda.is_initialized() or not torch.cuda.is_current_stream_capturing():
        return False
    if not all(g.get("capturable", False) for g in opt.param_groups):
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


__all__ = ["LowBitOptimizer", "OPTIONS", "ops"]
