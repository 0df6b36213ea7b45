"""Candidate fixes for issue 23 (from-scratch drift of AdamW8bit / AdamW4bit), as extra variants of
``tools/resume_fidelity.py --from-scratch`` and ``tools/step_bias.py``. Experiments only: nothing here
changes ckptq; the variants patch the optimizer's step plan or the PyTorch reference kernel while their own
optimizer steps, and only for it.

  sr8    AdamW8bit with stochastic rounding of both moments at 8 bits too (the contract's rounding, which
         the optimizer uses only under 8 bits): the step plan's kernel groups get seeds. Every backend
         already implements this bit for bit.
  uv4    AdamW4bit on the PyTorch reference kernel with sqrt(v)'s stochastic rounding unbiased in v = s * s
         instead of in s: P(up) = (y^2 - q_lo^2) / (q_hi^2 - q_lo^2), so E[q^2] = y^2 (the first moment's
         ratio as before, unbiased in r). Only the PyTorch backend: a real fix needs it in C and Triton.
  uv8    sr8 with sqrt(v) unbiased in v as uv4 (PyTorch reference kernel).
  unoiseS  fp32 AdamW whose parameter update (the step's whole change, decay included) is multiplied per
         element by 1 + S * N(0, 1) (every tensor), S a float like 0.005: an unbiased, independent-per-step
         perturbation of the update of a chosen relative size, the control for step_bias's u_err.
  snoiseM_V  fp32 AdamW whose stored moments are perturbed after every step, zero-mean: exp_avg *= 1 + M *
         N(0, 1), exp_avg_sq *= exp(V * N(0, 1) - V^2 / 2) (E = 1, stays positive), on tensors of 4096
         elements or more (those ckptq quantizes). The perturbation persists through the moving averages
         as a requantized state's error does: the control for a zero-mean state error of step_bias's
         r_err / v_err size, e.g. snoise0.13_0 (m only) or snoise0.13_0.3.
  lrX    fp32 AdamW with every lr multiplied by X (e.g. lr0.97): how much a systematically shorter or longer
         step moves the loss (the control for step_bias's u_bias).

    python tools/fidelity_experiments.py resume_fidelity --from-scratch --preset issue23 --seeds 0,1,2 \\
        --variants ckptq4,uv4 --windows 300
    python tools/fidelity_experiments.py step_bias --preset issue23 --variant uv4 --steps 300
    python tools/fidelity_experiments.py embedding_rows ckptq 300    # the tied embedding's rows, issue23 seed 0

``embedding_rows VARIANT [STEPS]``: step_bias's run in ``--preset issue23`` (seed 0), then the token
embedding's (wte, tied to the head) decoded sqrt(v) against the fp32 shadow and its update bias, per row,
grouped by the byte's frequency in the text: which rows carry wte's bias.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import resume_fidelity as rf  # noqa: E402

from ckptq.kernels import backend_torch  # noqa: E402
from ckptq.optim import AdamW4bit, AdamW8bit, grouping  # noqa: E402

_UNBIASED_V = {"on": False}  # set while a uv* optimizer steps
_original_sort = grouping.StepPlan._sort
_original_step_rows = backend_torch.step_rows


def _sort(self, opt, members):
    """StepPlan._sort, then seeds for every kernel group of an optimizer marked ``_fid_seeded``."""
    _original_sort(self, opt, members)
    if getattr(opt, "_fid_seeded", False):
        for kg in self.groups:
            kg.seeded = True


def stochastic_codes_v(x, absmax, nearest, qmap, u):
    """backend_torch.stochastic_codes, unbiased in x * x: P(up) = (y^2 - q_lo^2) / (q_hi^2 - q_lo^2)."""
    top = qmap.numel() - 1
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    y = x / safe[:, None]
    c = nearest.to(torch.int64)
    lo = (c - (y < qmap[c]).to(torch.int64)).clamp_(0, top)
    q_lo, q_hi = qmap[lo], qmap[(lo + 1).clamp(max=top)]
    up = u * (q_hi * q_hi - q_lo * q_lo) < y * y - q_lo * q_lo
    return torch.where(lo == top, top, lo + up.to(torch.int64)).to(torch.uint8)


def step_rows(p, g, h, states, ratio, maximize, seed=None, first=0):
    """backend_torch.step_rows (same math, same order), with sqrt(v) rounded by ``stochastic_codes_v``
    while a uv* optimizer steps."""
    if not _UNBIASED_V["on"] or seed is None:
        return _original_step_rows(p, g, h, states, ratio, maximize, seed, first)
    m_state, v_state, *x_state = states
    if x_state:
        raise NotImplementedError("uv* variants: no amsgrad")
    s = backend_torch._decode_rows(v_state)
    m = backend_torch._decode_rows(m_state)
    if ratio:
        m = m * (s + h[8])
    p32, m, v, _ = backend_torch.adam_math(p.float(), g.float(), m, s * s, None, h, maximize)
    s = backend_torch.ieee_sqrt(v)
    r = m / (s + h[9])
    us = backend_torch.uniforms(first, r.numel(), seed, r.device)
    new = ()
    for x, state, u, rounding in ((r, m_state, us[0], backend_torch.stochastic_codes),
                                  (s, v_state, us[1], stochastic_codes_v)):
        codes, absmax = backend_torch.quantize_rows(x, state.thresholds)
        new += ((rounding(x, absmax, codes, state.encode, u.view(x.shape)), absmax),)
    return p32, new


grouping.StepPlan._sort = _sort
backend_torch.step_rows = step_rows


class _UnbiasedV:
    """Mixin: the step runs on the PyTorch reference kernel with sqrt(v) rounded unbiased in v."""

    @torch.no_grad()
    def step(self, closure=None):
        _UNBIASED_V["on"] = True
        try:
            return super().step(closure)
        finally:
            _UNBIASED_V["on"] = False


class UV4(_UnbiasedV, AdamW4bit):
    pass


class UV8(_UnbiasedV, AdamW8bit):
    pass


class UpdateNoiseAdamW(torch.optim.AdamW):
    """fp32 AdamW whose per-step parameter change is multiplied elementwise by 1 + sigma * N(0, 1)."""

    def __init__(self, params, sigma: float, seed: int, **kwargs):
        super().__init__(params, **kwargs)
        self.sigma, self.gen = sigma, torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def step(self, closure=None):
        before = [p.detach().clone() for g in self.param_groups for p in g["params"] if p.grad is not None]
        out = super().step(closure)
        live = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p, p0 in zip(live, before):
            noise = torch.randn(p.shape, generator=self.gen).mul_(self.sigma).add_(1.0)
            p.copy_(p0 + (p - p0) * noise)
        return out


class StateNoiseAdamW(torch.optim.AdamW):
    """fp32 AdamW whose exp_avg / exp_avg_sq get zero-mean multiplicative noise after every step."""

    def __init__(self, params, m_sigma: float, v_sigma: float, seed: int, **kwargs):
        super().__init__(params, **kwargs)
        self.m_sigma, self.v_sigma, self.gen = m_sigma, v_sigma, torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state.get(p)
                if not st or p.numel() < 4096:  # ckptq's min_size: smaller tensors keep fp32 state
                    continue
                if self.m_sigma:
                    st["exp_avg"].mul_(torch.randn(p.shape, generator=self.gen).mul_(self.m_sigma).add_(1.0))
                if self.v_sigma:
                    z = torch.randn(p.shape, generator=self.gen)
                    st["exp_avg_sq"].mul_(z.mul_(self.v_sigma).sub_(self.v_sigma**2 / 2).exp_())
        return out


def _sr8(groups, lr, seed):
    opt = AdamW8bit(groups, lr=lr)
    opt._fid_seeded = True
    return opt


def _uv8(groups, lr, seed):
    opt = UV8(groups, lr=lr, backend="torch")
    opt._fid_seeded = True
    return opt


rf.SCRATCH_FACTORIES.update({
    "sr8": _sr8,
    "uv4": lambda groups, lr, seed: UV4(groups, lr=lr, backend="torch"),
    "uv8": _uv8,
})


def _scaled_lr(x: float):
    def make(groups, lr, seed):
        for g in groups:
            g["lr"] = g["lr"] * x
        return torch.optim.AdamW(groups, lr=lr * x)
    return make


def register_update_noise(names) -> None:
    """Register every ``unoiseS``, ``snoiseM_V`` and ``lrX`` in ``names`` (floats)."""
    for name in names:
        if name.startswith("snoise") and name not in rf.SCRATCH_FACTORIES:
            m_sigma, v_sigma = (float(x) for x in name[len("snoise"):].split("_"))
            rf.SCRATCH_FACTORIES[name] = (lambda a, b: lambda groups, lr, seed:
                                          StateNoiseAdamW(groups, a, b, seed + 1299709, lr=lr))(m_sigma, v_sigma)
        if name.startswith("lr") and name[2:3].isdigit() and name not in rf.SCRATCH_FACTORIES:
            rf.SCRATCH_FACTORIES[name] = _scaled_lr(float(name[2:]))
        if name.startswith("unoise") and name not in rf.SCRATCH_FACTORIES:
            sigma = float(name[len("unoise"):])
            rf.SCRATCH_FACTORIES[name] = (lambda s: lambda groups, lr, seed:
                                          UpdateNoiseAdamW(groups, s, seed + 104729, lr=lr))(sigma)


def embedding_rows(variant: str, steps: int = 300) -> None:
    """``embedding_rows`` (module docstring): per-row sqrt(v) bias and update bias of wte at the last step."""
    import step_bias as sb

    last = {}
    measure = sb.measure

    def keep_wte(prev, new, exact, sh, u_star):
        if sh["v"].numel() == 256 * 128:  # the byte model's wte (the only tensor of that size)
            last.update(s=new["s"].clone(), ref=sh["v"].sqrt(), u=exact["u"].clone(), u_star=u_star.clone())
        return measure(prev, new, exact, sh, u_star)

    sb.measure = keep_wte
    args = sb.parse_args(["--preset", "issue23", "--variant", variant, "--steps", str(steps), "--seed", "0"])
    torch.set_num_threads(args.threads)
    sb.train(args)
    s, ref = last["s"].view(256, 128), last["ref"].view(256, 128)
    ok = (s > 0) & (ref > 0)
    logs = torch.where(ok, (s / ref).log(), torch.zeros_like(s))
    row_bias = (logs.sum(1) / ok.sum(1).clamp(min=1)).exp() - 1
    u, us = last["u"].view(256, 128), last["u_star"].view(256, 128)
    row_ubias = ((u - us) * us).sum(1) / us.square().sum(1).clamp(min=1e-30)
    text = rf.english_text()
    freq = torch.bincount(text, minlength=256).double() / text.numel()
    order, present = freq.argsort(descending=True), int((freq > 0).sum())
    groups = [("top 16 bytes", order[:16]), ("bytes 17-48", order[16:48]),
              (f"bytes 49-{present} (rare)", order[48:present]), ("absent from the text", order[present:])]
    print(f"{variant}, issue23, seed 0, step {steps}: wte rows by the byte's frequency in the text\n")
    print("| rows | count | share of text | sqrt(v) vs fp32 (median row) | u_bias (median row) |")
    print("|---|---:|---:|---:|---:|")
    for name, idx in groups:
        if len(idx):
            print(f"| {name} | {len(idx)} | {100 * freq[idx].sum():.2f}% | {100 * row_bias[idx].median():+.2f}% | "
                  f"{100 * row_ubias[idx].median():+.2f}% |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    if len(sys.argv) < 2 or sys.argv[1] not in ("resume_fidelity", "step_bias", "embedding_rows"):
        raise SystemExit(__doc__)
    tool, argv = sys.argv[1], sys.argv[2:]
    if tool == "embedding_rows":
        embedding_rows(argv[0], int(argv[1]) if len(argv) > 1 else 300)
        return
    words = [w for a in argv for w in a.split(",")]
    register_update_noise(words)
    if tool == "resume_fidelity":
        rf.main(argv)
    else:
        import step_bias

        step_bias.main(argv)


if __name__ == "__main__":
    main()
