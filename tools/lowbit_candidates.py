"""Candidate 4-bit layouts for training from scratch (#31.2), as ``tools/resume_fidelity.py`` variants.

AdamW4bit keeps Adam's first moment as a 4-bit ratio m / (sqrt(v) + eps') and sqrt(v) at 4 bits, both
requantized with stochastic rounding at every step: about 1.06 bytes per parameter. #23 found its loss
drifting from fp32's by -2.1 ... -7.5% at 1000 steps, reproduced by fp32 AdamW with the same zero-mean
noise on exp_avg: the 16-level ratio's rounding noise, carried from step to step in m. The candidates here
keep the budget (<= 1.1 B/param) and cut that noise:

  ckptq4-62   the ratio at 6 bits (64 levels: a quarter of the rounding step) over sqrt(v) at 2 bits, as
              ``ckptq convert --bits 4`` stores a checkpoint: 1.0 B of codes + 2 scales per 128 values
              (1.06 B/param), both rounded stochastically

    python tools/resume_fidelity.py ... --variants ckptq4,ckptq4-62   (after ``import lowbit_candidates``)
    python tools/lowbit_candidates.py --preset issue23 --seeds 0,1,2,3,4 --steps 1000 --windows 300,1000 \\
        --variants ckptq4-62 --threads 1

Each is the library's AdamW4bit with its state laid out differently at creation; the step kernels take
each moment's width and block size as stored, so nothing else changes.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import resume_fidelity as rf  # noqa: E402

from ckptq.codec import dtensor, plan, policy, quant  # noqa: E402
from ckptq.optim import AdamW4bit  # noqa: E402


class Split62(AdamW4bit):
    """AdamW4bit with the ratio at 6 bits and sqrt(v) at 2 (``ckptq convert --bits 4``'s layout)."""

    widths = {"exp_avg": 6, "exp_avg_sq": 2}

    def _quantize_moments(self, dense: dict, group: dict, step: float) -> dict:
        m, v = (dtensor.local(dense[k]).float() for k in ("exp_avg", "exp_avg_sq"))
        eps = policy.ratio_eps_for(group, step)
        assert plan.ratio_fits(m, v, eps)
        return {"exp_avg": quant.quantize_ratio(m, v, eps, self.block_size, bits=self.widths["exp_avg"]),
                "exp_avg_sq": quant.quantize_state(v, "exp_avg_sq", self.block_size, bits=self.widths["exp_avg_sq"])}


rf.SCRATCH_FACTORIES["ckptq4-62"] = lambda groups, lr, seed: Split62(groups, lr=lr)

if __name__ == "__main__":
    rf.main()
