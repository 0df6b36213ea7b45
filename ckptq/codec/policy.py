"""Which optimizer states go low-bit and how, decided in one place: the checks of the user's choices
(budget, block size, min size; the facts themselves are in ``ckptq.codec.defaults``), then, per state key
and code width, the codebook and transform a state gets (``Policy``), the widths a ``convert --bits 4``
file gives each state (``convert_width``), and eps' of the first moment's ratio transform
(``ckptq.codec.qstate`` explains it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import UsageError
from . import codebooks, roles, scalar_math
from .defaults import check_block_size  # noqa: F401 (re-exported: policy.check_block_size)
from .defaults import (BLOCK_SIZES, BUDGETS, DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZES, DEFAULT_MIN_SIZE,  # noqa: F401
                       LAYOUTS, MOMENT_KEYS, RATIO_PAIRS, RATIO_TRANSFORM, SECOND_MOMENTS, TRANSFORMS)


def check_budget(bits: int) -> int:
    """``bits``, the bits per value a user asks for (8 or 4), or UsageError."""
    if type(bits) is not int or bits not in BUDGETS:
        raise UsageError(f"{bits}-bit state is not supported; use bits=8 or bits=4")
    return bits


def default_block_size(bits: int) -> int:
    """The block size new states get under this budget (``BUDGETS``) unless told otherwise."""
    return DEFAULT_BLOCK_SIZES[check_budget(bits)]


def check_min_size(min_size) -> int:
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise UsageError(f"min size {min_size!r} must be a whole number of at least 1")
    return min_size


# Codebooks by name; files record the values, so a name only decides what new files get.
CODEBOOKS = {
    "power-signed-2.5": functools.partial(codebooks.power_map, True, 2.5),
    "power-unsigned-3": functools.partial(codebooks.power_map, False, 3.0),
    "power-signed-1.5": functools.partial(codebooks.power_map, True, 1.5),
    "4bit-power-signed-1.5": functools.partial(codebooks.power_map, True, 1.5, 4),
    "4bit-geometric-1.3": functools.partial(codebooks.geometric_map, 4, 1.3),
    "4bit-lloyd-gaussian": codebooks.lloyd_gaussian_map,
    "6bit-lloyd-gaussian": codebooks.lloyd_gaussian_map_6bit,
    "2bit-geometric-3": functools.partial(codebooks.geometric_map, 2, 3.0),
    "power-unsigned-2": functools.partial(codebooks.power_map, False, 2.0),
    "4bit-geometric-1.2": functools.partial(codebooks.geometric_map, 4, 1.2),
}
@dataclass(frozen=True)
class Policy:
    codebook: str  # a key of CODEBOOKS
    transform: str  # one of TRANSFORMS

    def qmap(self) -> torch.Tensor:
        return CODEBOOKS[self.codebook]()


# Chosen by the Adam *update* error u = m_hat / (sqrt(v_hat) + eps) (tools/bench/fidelity.py, figures in
# README): an element's share of ||u|| does not shrink with its magnitude, so small entries of a
# block need relative precision, and large ones most of the codes.
# Second moments are stored as sqrt(v) on an unsigned power map (sqrt(v)/absmax = (k/255)**3): a
# block whose v spans 2k decades needs only k decades of codebook, small entries keep their precision
# and only values below ~1e-15 of the block's absmax v collapse to 0 (the zero-point problem of Li et
# al., NeurIPS 2023). First moments and other states use a signed power map ((k/127)**2.5).
POLICIES = {
    "exp_avg": Policy("power-signed-2.5", "none"),
    "exp_avg_sq": Policy("power-unsigned-3", "sqrt"),
    "max_exp_avg_sq": Policy("power-unsigned-3", "sqrt"),
}
DEFAULT_POLICY = Policy("power-signed-2.5", "none")
# exp_avg when its sibling exp_avg_sq is quantized too: stored relative to it (see the module docstring)
RATIO_POLICY = Policy("power-signed-1.5", RATIO_TRANSFORM)

# 4-bit states (16-entry codebooks, AdamW4bit's), chosen the same way; figures in README. The update
# error is the ratio's own rounding error, so the ratio gets the codebook of least squared error for
# block-normalized Gaussian values (codebooks.LLOYD_GAUSSIAN_128). Second moments keep the sqrt transform
# on 1.3**(k - 15): the step rounds them stochastically, and on (k/15)**3 (gaps of 8x near 0, a level at
# 0) that put small elements' sqrt(v) a factor of several off; equal 30% gaps and no zero kept resumed
# training within 0.1% of fp32 on three seeds, where (k/15)**3 reached 0.102% (tools/bench/resume_fidelity.py).
POLICIES_4BIT = {
    "exp_avg": Policy("4bit-power-signed-1.5", "none"),
    "exp_avg_sq": Policy("4bit-geometric-1.3", "sqrt"),
    "max_exp_avg_sq": Policy("4bit-geometric-1.3", "sqrt"),
}
# 2-bit states: only second moments that divide a 6-bit ratio in a converted file get them (``convert_width``).
POLICY_2BIT = Policy("2bit-geometric-3", "sqrt")
# By code width: (policies by state key, the policy of other keys); 6 bits holds ratios only.
PLAIN_POLICIES = {8: (POLICIES, DEFAULT_POLICY), 4: (POLICIES_4BIT, Policy("4bit-power-signed-1.5", "none")),
                  2: ({}, POLICY_2BIT)}
RATIO_POLICIES = {8: RATIO_POLICY, 6: Policy("6bit-lloyd-gaussian", RATIO_TRANSFORM),
                  4: Policy("4bit-lloyd-gaussian", RATIO_TRANSFORM)}


# The roles of other optimizers than Adam (``ckptq.codec.roles``), by code width. Chosen by the update error
# of one real step of each optimizer from the decoded state, on checkpoints of a tiny GPT trained 300 steps
# with it (tools/bench/optimizer_fidelity.py --sweep; the table is in docs/FORMAT.md, "Roles"):
# - first moments alone: at 8 bits ±(k/127)^1.5 was best on all six optimizers (SGD 0.51% worst tensor,
#   Muon 6.4%, Lion 7.2%, against 0.58%, 8.2%, 8.3% on Adam's ±(k/127)^2.5 and 0.88%, 10.1%, 9.2% on
#   bitsandbytes' dynamic map); at 4 bits the 16-level Lloyd-Max map (SGD 7.6% against 8.3% for ±(k/7)^1.5).
# - second moments alone (square_avg, sum, variance): sqrt on (k/255)^3 as Adam's, within 0.05 points of
#   the best (sqrt on (k/255)^2) and keeping twice its decades from 0 (the zero-point problem); at 4 bits
#   sqrt on 1.2^(k-15), no zero (RMSprop 1.7%, Adagrad 5.8%, against 2.4% and 7.8% on 1.3^(k-15)).
# - max-norms (exp_inf, divided by as they are): (k/255)^2 (0.48%, against 0.54% on (k/255)^3); 4 bits
#   1.2^(k-15) (5.3%, against 7.7% on 1.3^(k-15)).
ROLE_POLICIES = {
    8: {roles.FIRST: Policy("power-signed-1.5", "none"), roles.SECOND: Policy("power-unsigned-3", "sqrt"),
        roles.MAX_NORM: Policy("power-unsigned-2", "none")},
    4: {roles.FIRST: Policy("4bit-lloyd-gaussian", "none"), roles.SECOND: Policy("4bit-geometric-1.2", "sqrt"),
        roles.MAX_NORM: Policy("4bit-geometric-1.2", "none")},
}
KNOWN_OPTIMIZERS = ("torch.optim Adam, AdamW, NAdam, RAdam, Adamax, SGD, RMSprop, Adagrad, Muon and Adafactor, "
                    "lion-pytorch's Lion, transformers' Adafactor and bitsandbytes' optimizers")


def policy_for(key: str, bits: int = 8, role: str | None = None) -> Policy:
    """The policy of a state stored on its own (not as a ratio) with codes of ``bits`` bits: by its ``role``
    (``ckptq.codec.roles``) for other optimizers than Adam, else by its Adam state key."""
    if role not in (None, roles.ADAM):
        if bits not in ROLE_POLICIES or role not in ROLE_POLICIES[bits]:
            raise UsageError(f"{role} states take 8 or 4 bits, not {bits}")
        return ROLE_POLICIES[bits][role]
    if bits not in PLAIN_POLICIES:
        raise UsageError(f"{bits}-bit codes hold ratio states only; store {key!r} with 8, 4 or 2 bits")
    table, default = PLAIN_POLICIES[bits]
    return table.get(key, default)


def ratio_policy(bits: int = 8) -> Policy:
    if bits not in RATIO_POLICIES:
        raise UsageError(f"ratio states take 8, 6 or 4 bits, not {bits}")
    return RATIO_POLICIES[bits]


def convert_width(bits: int, key: str, ratio: bool = False, divisor: bool = False, role: str | None = None) -> int:
    """The code width ``ckptq convert`` gives a state under a budget of ``bits`` per value (``BUDGETS``):
    8 bits, every state 8. 4 bits: a first moment stored as a ratio (``ratio``) 6 and the second moment it
    divides (``divisor``) 2, which keeps 8 bits per parameter for the pair; any other state 4, whatever its
    ``role`` (no other optimizer's update cancels one state's error the way Adam's ratio does).

    Why 6 + 2 in a file: the update error a checkpoint carries is the ratio's own rounding error (v's
    cancels out), and at 4 bits per value no code brings it below 6.25% (a Gaussian's rate-distortion
    bound); 6 bits reach 2.3-2.6% where 4 gave 9-10% (bitsandbytes 8-bit: 3.0-6.7%; tools/bench/fidelity.py).

    Why not in training: the 4-bit optimizer requantizes its state at every step, and sqrt(v) on 4 levels
    cannot follow v (README): rounded to nearest, each element's level freezes where the first steps put
    it (from scratch: mean loss +4.4% over the last 100 of 400 steps), rounded stochastically it resumed
    at +0.15% of fp32's loss, where 4 + 4 stays within 0.07%. So ``AdamW4bit`` keeps 4 + 4 and
    requantizes a 6 + 2 file on load (``ckptq.optim.state_io``)."""
    if check_budget(bits) == 8:
        return 8
    if ratio:
        return 6
    return 2 if divisor and key in RATIO_PAIRS.values() else 4


def budget_of(widths) -> int | None:
    """The budget (``BUDGETS``) that states of these code widths were written under: 8 when all are 8,
    4 when none is; None for none or a mix."""
    widths = set(widths)
    if widths == {8}:
        return 8
    return 4 if widths and 8 not in widths else None


# eps' never below this: with eps = 0, an element whose v is 0 (its m is 0 too) would give r = 0/0 = NaN
# and spoil its whole block's scale; a tiny positive eps' gives r = 0 and changes nothing else.
MIN_RATIO_EPS = 1e-30


def ratio_eps(eps: float, beta2: float, step: float) -> float:
    """eps' that makes v's quantization error cancel out of the update at ``step`` (see above)."""
    return ratio_eps_of(scalar_math.HOST, float(eps), float(beta2), float(step))


def ratio_eps_of(x, eps, beta2, step):
    """``ratio_eps`` in the math namespace ``x`` (``ckptq.codec.scalar_math``): floats on the host, float64
    tensors of steps on the device (``capturable=True``), the same bits on the CPU."""
    value = x.where(step > 0, eps * x.sqrt(1.0 - x.pow(beta2, step)), eps)
    return x.maximum(value, MIN_RATIO_EPS)


def ratio_eps_for(group: dict, step) -> float:
    """eps' for a param from its optimizer param_group (torch's eps/betas defaults) and its step."""
    step = float(step.item() if isinstance(step, torch.Tensor) else (step or 0))
    return ratio_eps(group.get("eps", 1e-8), tuple(group.get("betas", (0.9, 0.999)))[1], step)
