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
  within what the step decodes to finite values: a sqrt state's values at most sqrt(fp32 max) (the step
  squares them: a scale of 3e38 made v inf and the parameters NaN after one step), a ratio's times its
  divisor's (+ eps') at most fp32's max. Every state ckptq writes from finite moments is within both.
- ``qmap``: float32, 2**bits entries, finite, strictly ascending: the kernels binary-search it, and with
  a NaN entry the C and PyTorch backends picked different codes.
- ``dtype``: a floating-point dtype name; ``transform``: one ckptq decodes; ``shape``: non-negative ints.
- ratio states: ``eps`` a number >= 0, finite in fp32 (or the 0-dim tensor a capturable step keeps),
  and ``divisor`` naming the sibling sqrt state it divides by.
- fp32 moments (torch's): dense floating tensors. Their values are loaded as torch's AdamW would take
  them (``state_io`` keeps moments that 8 bits would damage in fp32, and says so).
"""

from __future__ import annotations

import math
import numbers

import torch

from ..codec import dtensor, policy, qstate
from ..errors import FormatError, StateMismatchError
from ..format.dtypes import float_dtype_from_name


FP32_MAX = float(torch.finfo(torch.float32).max)
SQRT_MAX = FP32_MAX**0.5  # the largest sqrt state value whose square (the second moment) is finite in fp32


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
    if q["transform"] == "sqrt" and largest_value(q) > SQRT_MAX:
        raise _refuse(pid, key, f"is malformed: absmax {float(dtensor.local(q['absmax']).max()):.3g} decodes values up to "
                                f"{largest_value(q):.3g}, whose squares (the second moment) overflow fp32")


def largest_value(q: dict) -> float:
    """The largest magnitude a qstate's codes can decode to (before its transform): max absmax * max |qmap|
    (0 for a meta or empty state)."""
    scales, qmap = dtensor.local(q["absmax"]), q["qmap"]
    if scales.is_meta or qmap.is_meta or not scales.numel():
        return 0.0
    return float(scales.max()) * float(qmap.abs().max())


def _check_dense(pid, key: str, value: torch.Tensor) -> None:
    """A moment torch's way: a dense floating tensor."""
    if value.layout != torch.strided:
        raise _refuse(pid, key, f"is a {value.layout} tensor, where Adam's moments are dense (save it with .to_dense())")
    if not (value.is_floating_point() or value.is_complex()):
        raise _refuse(pid, key, f"is a {value.dtype} tensor, where Adam's moments are floating point")


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
    if eps > FP32_MAX:
        raise _refuse(pid, key, f"is malformed: ratio eps {float(eps):.3g} is beyond fp32, which the kernels take it in")
    divisor = siblings.get(q.get("divisor")) if isinstance(q.get("divisor"), str) else None
    if not qstate.is_qstate(divisor) or divisor.get("transform") != "sqrt":
        raise _refuse(pid, key, f"is malformed: divisor {q.get('divisor')!r:.40} names no sqrt-quantized state of this parameter "
                                "(a ratio state is divided by its exp_avg_sq)")
    first = largest_value(q) * (largest_value(divisor) + float(eps))  # m = r * (s + eps'), at most
    if first > FP32_MAX:
        raise _refuse(pid, key, f"is malformed: absmax {float(dtensor.local(q['absmax']).max()):.3g} with its divisor's "
                                f"decodes first moments up to {first:.3g}, beyond fp32")
