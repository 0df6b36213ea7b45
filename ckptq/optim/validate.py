"""Every field of one parameter's saved optimizer state, checked before ``load_state_dict`` changes anything
(``state_io.import_state_dict`` calls ``check_param_state``). A refusal is one ``StateMismatchError`` naming
the parameter, the state key, the field and what to do.

Without these checks a damaged or hand-edited state dict loaded, then failed at the first step with a raw
TypeError or ctypes.ArgumentError, or wrote NaN into the parameters, or made the C and PyTorch kernels
disagree, or failed only at ``ckptq expand``. What each field must be, and why:

- every tensor: dense (strided). A sparse one passed every check and failed in the step's ``view``.
- ``step``: a finite number >= 0. NaN makes the bias corrections NaN; a negative step reaches a
  division by zero (1 - beta**0) on its way up; inf cannot seed 4-bit stochastic rounding.
- ``bits``, ``block_size``: ints among the supported ones. A float passes ``in`` tests (256.0 == 256)
  and reaches the C kernels' ctypes arguments.
- ``absmax``: float32 (the kernels read fp32 scales), finite, >= 0 (a block's largest magnitude), and
  with the codebook decoding to at most ``MAX_STORED`` = 2**63 in magnitude: the second moment is the
  square of its stored value, and a scale of 3e38 made it inf and the parameters NaN after one step.
- ``qmap``: float32, 2**bits entries, finite, strictly ascending: the kernels binary-search it, and with
  a NaN entry the C and PyTorch backends picked different codes.
- ``dtype``: a floating-point dtype name; ``transform``: one ckptq decodes; ``shape``: non-negative ints.
- ratio states: ``eps`` a finite number >= 0 (or the 0-dim tensor a capturable step keeps) and
  ``divisor`` naming the sibling sqrt state it divides by.
- fp32 moments (torch's): finite; first moments at most 2**63 in magnitude (an update m / (sqrt(v) + eps)
  of more overflows fp32), second moments >= 0 (their sqrt) and at most 2**126 (sqrt(v) <= 2**63).
"""

from __future__ import annotations

import math
import numbers

import torch

from ..codec import dtensor, policy, qstate
from ..errors import FormatError, StateMismatchError
from ..format.dtypes import float_dtype_from_name


MAX_STORED = policy.MAX_STORED


def _refuse(pid, key: str, what: str) -> StateMismatchError:
    return StateMismatchError(f"state {key!r} of parameter {pid} {what}; load an intact state dict (or delete "
                              f"state[{pid!r}] to restart this parameter's moments)")


def step_value(pid, step) -> float:
    """The saved ``step`` as a float: a number or 1-element real tensor, finite and >= 0."""
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_meta and not step.is_complex() \
            and step.layout == torch.strided:
        value = float(step)
    elif isinstance(step, numbers.Real) and not isinstance(step, bool):
        value = float(step) if abs(step) < 2**1000 else math.inf if step > 0 else -math.inf  # float(10**400) raises
    else:
        shown = repr(step)[:40]
        if isinstance(step, torch.Tensor):
            layout = "" if step.layout == torch.strided else f"{step.layout} "
            shown = f"a {layout}tensor of shape {tuple(step.shape)} on {step.device}"
        raise StateMismatchError(f"state 'step' of parameter {pid} is {shown}; expected a number or 1-element tensor")
    if not 0 <= value < math.inf:
        raise _refuse(pid, "step", f"is {value}, not a finite count >= 0 of the steps taken")
    return value


def check_param_state(pid, saved: dict) -> None:
    """Every field of one parameter's state (``{"step", "exp_avg", ...}``), qstates and fp32 moments."""
    step_value(pid, saved.get("step", 0))
    for key, value in saved.items():
        if qstate.is_qstate(value):
            check_qstate_fields(pid, key, value)
        elif isinstance(value, torch.Tensor) and key != "step":
            _check_dense(pid, key, value)
    for key, value in saved.items():  # once every state's own fields hold: what ratio states divide by
        if qstate.is_qstate(value) and value["transform"] == qstate.RATIO_TRANSFORM:
            _check_ratio(pid, key, value, saved)


def check_qstate_fields(pid, key: str, q: dict) -> None:
    """The fields of one qstate dict (``ckptq.codec.qstate``) on their own."""
    for name in ("codes", "absmax", "qmap"):
        if isinstance(q.get(name), torch.Tensor) and dtensor.local(q[name]).layout != torch.strided:
            raise _refuse(pid, key, f"is malformed: {name} is a {q[name].layout} tensor, where the kernels read dense "
                                    "ones (save it with .to_dense())")
    bits, block_size = q.get("bits"), q.get("block_size")
    if type(bits) is not int or bits not in qstate.SUPPORTED_BITS:
        raise _refuse(pid, key, f"is malformed: bits {bits!r:.40} is not an int among {', '.join(map(str, qstate.SUPPORTED_BITS))}")
    if type(block_size) is not int or block_size not in policy.BLOCK_SIZES:
        raise _refuse(pid, key, f"is malformed: block_size {block_size!r:.40} is not an int among {', '.join(map(str, policy.BLOCK_SIZES))}")
    if not isinstance(q.get("transform"), str) or q["transform"] not in qstate.TRANSFORMS:
        raise _refuse(pid, key, f"is malformed: transform {q.get('transform')!r:.40} is not one of {', '.join(qstate.TRANSFORMS)}")
    if q.get("layout", "flat") not in qstate.LAYOUTS:
        raise _refuse(pid, key, f"is malformed: layout {q.get('layout')!r:.40} is not one of {', '.join(qstate.LAYOUTS)}")
    try:
        float_dtype_from_name(q.get("dtype"), "it")
    except FormatError:
        raise _refuse(pid, key, f"is malformed: dtype {q.get('dtype')!r:.40} is not the name of a floating-point dtype "
                                "(such as 'float32')") from None
    _check_shape_field(pid, key, q.get("shape"))
    _check_absmax(pid, key, q.get("absmax"))
    _check_qmap(pid, key, q.get("qmap"), bits)
    _check_range(pid, key, dtensor.local(q["absmax"]), q["qmap"])


def _check_range(pid, key: str, scales: torch.Tensor, qmap: torch.Tensor) -> None:
    """Decoded values (qmap[code] * absmax) at most ``MAX_STORED`` in magnitude."""
    if scales.is_meta or qmap.is_meta or not scales.numel():
        return
    largest = float(scales.max()) * float(qmap.abs().max())
    if largest > MAX_STORED:
        raise _refuse(pid, key, f"is malformed: absmax {float(scales.max()):.3g} decodes values up to {largest:.3g}, beyond "
                                "2**63, whose squares overflow fp32")


def _check_dense(pid, key: str, value: torch.Tensor) -> None:
    """A moment torch's way: a dense floating tensor of finite values in the range the step can take."""
    if value.layout != torch.strided:
        raise _refuse(pid, key, f"is a {value.layout} tensor, where Adam's moments are dense (save it with .to_dense())")
    if not (value.is_floating_point() or value.is_complex()):
        raise _refuse(pid, key, f"is a {value.dtype} tensor, where Adam's moments are floating point")
    local = dtensor.local(value)
    if local.is_meta or not local.numel():
        return
    local = torch.view_as_real(local) if local.is_complex() else local
    if not torch.isfinite(local).all():
        raise _refuse(pid, key, f"holds {int((~torch.isfinite(local)).sum())} NaN or infinite values")
    if key in policy.SECOND_MOMENTS and (local < 0).any():
        raise _refuse(pid, key, f"holds negative values (min {float(local.min()):.3g}), where a second moment is a mean "
                                "of squares")
    limit = MAX_STORED**2 if key in policy.SECOND_MOMENTS else MAX_STORED
    if float(local.abs().max()) > limit:
        raise _refuse(pid, key, f"holds values up to {float(local.abs().max()):.3g}, beyond {limit:.3g}: the step would "
                                "overflow fp32")


def _check_shape_field(pid, key: str, shape) -> None:
    if not isinstance(shape, (tuple, list)) or not all(type(d) is int and d >= 0 for d in shape):
        raise _refuse(pid, key, f"is malformed: shape {shape!r:.60} is not a sequence of ints >= 0")


def _check_absmax(pid, key: str, absmax) -> None:
    if not isinstance(absmax, torch.Tensor) or absmax.dtype != torch.float32:
        got = absmax.dtype if isinstance(absmax, torch.Tensor) else type(absmax).__name__
        raise _refuse(pid, key, f"is malformed: absmax is {got}, where the kernels read float32 scales")
    scales = dtensor.local(absmax)
    if scales.is_meta:
        return  # meta tensors carry no values: state_io says so with the shapes
    if not torch.isfinite(scales).all():
        raise _refuse(pid, key, f"is malformed: absmax holds {int((~torch.isfinite(scales)).sum())} NaN or infinite scales")
    if (scales < 0).any():
        raise _refuse(pid, key, f"is malformed: absmax holds negative scales (min {float(scales.min())}), where a scale is a "
                                "block's largest magnitude")


def _check_qmap(pid, key: str, qmap, bits: int) -> None:
    if not isinstance(qmap, torch.Tensor) or qmap.dtype != torch.float32 or qmap.shape != (2**bits,):
        got = f"{qmap.dtype} {tuple(qmap.shape)}" if isinstance(qmap, torch.Tensor) else type(qmap).__name__
        raise _refuse(pid, key, f"is malformed: qmap is {got}, not a float32 codebook of {2**bits} entries for {bits}-bit codes")
    if qmap.is_meta:
        return
    if not torch.isfinite(qmap).all():
        raise _refuse(pid, key, "is malformed: qmap holds NaN or infinite codes")
    if not (qmap[1:] > qmap[:-1]).all():
        raise _refuse(pid, key, "is malformed: qmap is not sorted ascending without repeats, as the kernels' search needs")


def _check_ratio(pid, key: str, q: dict, siblings: dict) -> None:
    eps = q.get("eps")
    if isinstance(eps, torch.Tensor) and eps.dim() == 0 and eps.is_floating_point() and not eps.is_meta \
            and eps.layout == torch.strided:
        eps = float(eps)  # a capturable step's eps' (the state dict exports a float)
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not 0 <= eps < math.inf:
        raise _refuse(pid, key, f"is malformed: ratio eps {eps!r:.40} is not a finite number >= 0")
    if eps > MAX_STORED:
        raise _refuse(pid, key, f"is malformed: ratio eps {float(eps):.3g} is beyond 2**63 (eps' is at most the "
                                "optimizer's eps)")
    divisor = siblings.get(q.get("divisor")) if isinstance(q.get("divisor"), str) else None
    if not qstate.is_qstate(divisor) or divisor.get("transform") != "sqrt":
        raise _refuse(pid, key, f"is malformed: divisor {q.get('divisor')!r:.40} names no sqrt-quantized state of this parameter "
                                "(a ratio state is divided by its exp_avg_sq)")
