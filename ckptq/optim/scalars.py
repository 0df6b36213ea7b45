"""The per-step scalars of a kernel group computed on its device (``capturable=True``): the hyper rows and
stochastic rounding seeds that the grouped kernels read, made by tensor ops from the members' step
tensors on that device and their param groups' values, with nothing read back to the host, so that a
step can be captured in a CUDA graph.

An optimizer states its scalars once, as a formula of what it reads from a param group (``_values``) and the
step count, written against a math namespace (``ckptq.codec.scalar_math``) and returning the rule's fields
by name (``ckptq.kernels.rules``). Evaluated on floats it is the host path (``capturable=False``:
``ckptq.optim.plan``), on float64 tensors this one; on the CPU both give the same bits.

What a capturable step keeps on the device: each member's ``state["step"]`` (0-dim fp32, on the
parameter's device, as torch's capturable Adam keeps it) and, for a state stored as a ratio, its eps'
(``exp_avg["eps"]``): a 0-dim float64 view into this group's ``eps`` buffer, which the step rewrites
(``state_dict()`` exports it as the float the format holds). Values of param groups that are Python floats
enter the kernels as scalars, those that are tensors (a tensor ``lr``) are read on the device: under a CUDA
graph, a schedule must change a tensor ``lr`` in place (a float's value is frozen into the graph, as with
torch's capturable optimizers).
"""

from __future__ import annotations

import torch

from ..codec import scalar_math
from ..kernels import contract

def salt_hash(salts: list[int], device) -> torch.Tensor:
    """int64 [n]: the salt half of ``ops.step_seed`` (a parameter's index in the optimizer), on ``device``."""
    return ((torch.tensor(salts, dtype=torch.int64) * 0x9E3779B9) & 0xFFFFFFFF).to(device)


def seeds(steps: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
    """``ops.step_seed`` of each (step count int64 [n], ``salt_hash``), vectorized: int64 [n] in [0, 2**32)."""
    return contract.mix32(contract.mix32(steps & 0xFFFFFFFF) ^ salt)


def _on_device(state: dict, device: torch.device, key: str = "step") -> torch.Tensor:
    """The member's step count (or another scalar state) as a capturable step keeps it: 0-dim fp32 on
    ``device`` (moved there once, when the plan is built: a state loaded or made before ``capturable`` was
    turned on)."""
    value = state[key]
    if not (isinstance(value, torch.Tensor) and value.device == device and value.dtype == torch.float32):
        state[key] = torch.as_tensor(value).to(device=device, dtype=torch.float32).reshape(())
    return state[key]


class DeviceScalars:
    """The device side of one kernel group's step: its members' step tensors and param groups, their salts,
    and (first moments stored as ratios) the buffer their eps' live in."""

    def __init__(self, states: list[dict], groups: list[int], device: torch.device, salts: list[int] | None,
                 ratio_key: str | None):
        self.math = scalar_math.DeviceMath(device)
        self.states = states
        self.steps = [_on_device(state, self.math.device) for state in states]
        self.groups = sorted(set(groups))  # the distinct param groups, by index
        where = {g: i for i, g in enumerate(self.groups)}
        self.gid = torch.tensor([where[g] for g in groups], dtype=torch.int64).to(self.math.device)
        self.salt = None if salts is None else salt_hash(salts, self.math.device)
        self.eps, self.ratio_key = None, ratio_key
        if ratio_key:  # what the stored codes were written with: the decode eps of the next step
            self._keep_eps(torch.stack([self.math.tensor(s[ratio_key]["eps"]).reshape(()) for s in states]))
        self._uploaded: dict[int, tuple] = {}

    def hyper(self, opt, fields: tuple, fresh: list | None) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """(fp32 [n, len(fields)] hyper rows, the formula's values by name (floats or float64 [n]), the step
        counts float64 [n]) of this step; the step tensors were incremented already. ``fresh``: per member
        whether its state was created for this step (None: none was)."""
        step = torch.stack(self.steps).to(torch.float64)
        flag = False if fresh is None else self.math.upload([float(f) for f in fresh]) > 0
        per_group = [opt._values(opt.param_groups[g]) for g in self.groups]
        columns = [self._column(k, [values[k] for values in per_group]) for k in range(len(per_group[0]))]
        extra = {k: torch.stack([_on_device(state, self.math.device, k) for state in self.states]).to(torch.float64)
                 for k in opt.SCALAR_STATES}
        named = opt._formula(self.math, *columns, step=step, fresh=flag, **extra)
        for k in extra:  # the scalar states' new values, written on the device
            torch._foreach_copy_([state[k] for state in self.states], list(named[k].to(torch.float32).unbind(0)))
        rows = torch.zeros(len(self.steps), len(fields), dtype=torch.float64, device=self.math.device)
        for name, value in named.items():
            if name in fields:  # (scalar states are not hyper fields)
                rows[:, fields.index(name)] = value
        if self.eps is not None:
            rows[:, fields.index("decode_eps")] = self.eps
        return rows.to(torch.float32), named, step

    def seeds(self, step: torch.Tensor) -> torch.Tensor:
        return seeds(step.to(torch.int64), self.salt)

    def written_with(self, encode_eps) -> None:
        """The eps' the new codes were written with (float64 [n] or a float): the next step decodes them with it."""
        encode_eps = self.math.tensor(encode_eps).expand(len(self.steps))
        if self.eps is None:
            self._keep_eps(encode_eps.clone())
        else:
            self.eps.copy_(encode_eps)

    def _keep_eps(self, values: torch.Tensor) -> None:
        self.eps = values.contiguous()
        for i, state in enumerate(self.states):
            for value in state.values():  # every ratio state of the member (they share eps')
                if isinstance(value, dict) and value.get("transform") == "ratio":
                    value["eps"] = self.eps[i]

    def _column(self, k: int, values: list):
        if not any(isinstance(v, torch.Tensor) for v in values):
            if len(set(values)) == 1:
                return float(values[0])
            if self._uploaded.get(k, (None,))[0] != tuple(values):  # uploaded again only when changed
                column = self.math.upload(values)
                self._uploaded[k] = (tuple(values), torch.index_select(column, 0, self.gid))
            return self._uploaded[k][1]
        column = torch.stack([self.math.tensor(v).reshape(()) for v in values])
        return torch.index_select(column, 0, self.gid)
