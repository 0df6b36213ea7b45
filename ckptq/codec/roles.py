"""What each optimizer's state is: the optimizer recognised from its state keys and its param groups'
hyperparameters, and the role of each state it keeps (docs/FORMAT.md, "Roles").

A role says what a state holds, so that it gets the codec that keeps that kind of value (``ckptq.codec.policy``
has the codec of each role and width, and the measurements that chose it):

- ``adam``: Adam's pair (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` of torch's Adam, AdamW, NAdam, RAdam,
  bitsandbytes' Adam): the first moment stored as the ratio to its second moment (``ckptq.codec.qstate``);
  Adam-specific, because it makes Adam's update carry only the ratio's rounding error.
- ``first``: a signed first moment used on its own (SGD's and Muon's ``momentum_buffer``, Lion's ``exp_avg``,
  RMSprop's ``momentum_buffer`` and ``grad_avg``, Adafactor's and Adamax's ``exp_avg``).
- ``second``: a non-negative second moment used on its own (RMSprop's ``square_avg``, Adagrad's ``sum``,
  Adafactor's unfactored ``exp_avg_sq``, torch Adafactor's ``variance``).
- ``max-norm``: Adamax's ``exp_inf``, a running max of |g|, non-negative, divided by as it is.
- ``factored``: Adafactor's row and column statistics: small (a row and a column per matrix), kept exact.

Whatever an optimizer holds beyond its roles (steps, NAdam's ``mu_product``, Adafactor's ``RMS``, unknown
keys) stays exact, and so does every state of an optimizer that is not recognised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InputError

ADAM, FIRST, SECOND, MAX_NORM, FACTORED = "adam", "first", "second", "max-norm", "factored"
NON_NEGATIVE = (SECOND, MAX_NORM)


@dataclass(frozen=True)
class Kind:
    """A recognised optimizer: its name and the role of each state key it stores low-bit."""

    name: str
    roles: dict = field(default_factory=dict)  # state key -> role (a key absent here stays exact)
    factored: tuple = ()  # keys kept exact as factored statistics (said as such)

    @property
    def ratio(self) -> bool:
        """Whether Adam's first moment is stored as the ratio to its second moment."""
        return ADAM in self.roles.values()

    def role(self, key: str) -> str | None:
        return self.roles.get(key)


_ADAM_ROLES = {"exp_avg": ADAM, "exp_avg_sq": ADAM, "max_exp_avg_sq": ADAM}
UNKNOWN = Kind("an optimizer ckptq does not recognise")


def flag(group: dict, name: str, where: str) -> bool:
    """A param group's on/off setting (RMSprop's ``centered``, Adam's ``decoupled_weight_decay``): a bool, or
    0 / 1 / None as an older or hand-made state dict may hold; InputError naming it for anything else (a
    tensor, whose truth value is not one)."""
    value = group.get(name)
    if value is None or isinstance(value, bool) or (type(value) is int and value in (0, 1)):
        return bool(value)
    raise InputError(f"optimizer at {where}: a param group has {name} = {type(value).__name__} {str(value)[:40]}; "
                     "it is True or False, the state dict is damaged")


def _adam_name(groups: list, where: str) -> str:
    g = groups[0] if groups else {}
    if "momentum_decay" in g:
        return "torch.optim.NAdam"
    if "amsgrad" in g:
        return "torch.optim.AdamW" if flag(g, "decoupled_weight_decay", where) else "torch.optim.Adam"
    if "decoupled_weight_decay" in g:
        return "torch.optim.RAdam"
    return "Adam (betas, exp_avg, exp_avg_sq)"


def _has(groups: list, *names: str) -> bool:
    return bool(groups) and all(all(n in g for n in names) for g in groups)


def _by_groups(groups: list) -> Kind | None:
    """The optimizers whose param groups name them."""
    if _has(groups, "decay_rate", "clip_threshold"):
        return Kind("transformers Adafactor", {"exp_avg": FIRST, "exp_avg_sq": SECOND},
                    ("exp_avg_sq_row", "exp_avg_sq_col"))
    if _has(groups, "beta2_decay", "d"):
        return Kind("torch.optim.Adafactor", {"variance": SECOND}, ("row_var", "col_var"))
    if _has(groups, "ns_coefficients") or _has(groups, "ns_steps"):
        return Kind("torch.optim.Muon", {"momentum_buffer": FIRST})
    if _has(groups, "momentum", "dampening"):
        return Kind("torch.optim.SGD", {"momentum_buffer": FIRST})
    if _has(groups, "alpha", "centered"):
        return Kind("torch.optim.RMSprop", {"square_avg": SECOND, "momentum_buffer": FIRST, "grad_avg": FIRST})
    if _has(groups, "lr_decay") or _has(groups, "initial_accumulator_value"):
        return Kind("torch.optim.Adagrad", {"sum": SECOND})
    if _has(groups, "alpha", "betas") and all(isinstance(g["betas"], (list, tuple)) and len(g["betas"]) == 3
                                               for g in groups):  # bitsandbytes' Adam groups hold alpha too
        return Kind("AdEMAMix (bitsandbytes, ckptq)", {"exp_avg": FIRST, "exp_avg_slow": FIRST, "exp_avg_sq": SECOND})
    return None


def recognise(state_dict: dict, where: str = "<root>") -> Kind:
    """The optimizer an optimizer state dict (``state`` + ``param_groups``) was saved by, from its groups'
    hyperparameters and its state keys; ``UNKNOWN`` (everything exact) when nothing fits. InputError for
    heavyball's nested form, which ckptq does not read."""
    groups = [g for g in state_dict["param_groups"] if isinstance(g, dict)]
    states = [s for s in state_dict["state"].values() if isinstance(s, dict)]
    _refuse_nested(states, where)
    kind = _by_groups(groups)
    if kind is not None:
        return kind
    keys = set().union(*states) if states else set()
    if not _has(groups, "betas"):
        return UNKNOWN
    if "exp_inf" in keys:
        return Kind("torch.optim.Adamax", {"exp_avg": FIRST, "exp_inf": MAX_NORM})
    if keys & {"exp_avg_sq", "max_exp_avg_sq"} or not keys:
        return Kind(_adam_name(groups, where), dict(_ADAM_ROLES))
    if keys <= {"exp_avg", "step"}:
        return Kind("Lion (lion-pytorch, bitsandbytes)", {"exp_avg": FIRST})
    return UNKNOWN


def _refuse_nested(states: list, where: str) -> None:
    """heavyball keeps each parameter's state one level deeper (``state[pid][0]``), with a Python set inside
    (``is_initialized``), which a checkpoint of ckptq cannot hold: refused in one line."""
    for s in states:
        if s and all(isinstance(k, int) and isinstance(v, dict) for k, v in s.items()):
            inner = sorted(map(str, next(iter(s.values()))))[:3]
            raise InputError(f"optimizer at {where}: its state nests one level deeper (state[param][0]: "
                             f"{', '.join(inner)}, ...), as heavyball's optimizers save it; ckptq does not read "
                             "heavyball state: keep this checkpoint as it is")
