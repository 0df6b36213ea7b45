"""What ``ckptq.estimate`` returns: an ``Estimate``, which ``ckptq estimate`` prints (``text()``) or writes as
JSON (``as_dict()``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Estimate:
    """Bytes per device (``per_device``: rows; ``totals``: per optimizer, see ``_totals``) and on disk
    (``checkpoint``); ``None`` where the input cannot say (activations of a bare parameter count)."""

    model: str
    params: int
    architecture: dict | None
    setup: dict
    per_device: dict = field(default_factory=dict)
    totals: dict = field(default_factory=dict)
    checkpoint: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        """The table ``ckptq estimate`` prints: GiB per device under the optimizer's fp32 state, ckptq 8-bit and
        4-bit, then the checkpoint on disk and any notes."""
        return _text(self.as_dict())


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:,.2f} GiB"


_OPTIMIZER_NAMES = {"adamw": "AdamW", "muon": "Muon", "sgd": "SGD", "lion": "Lion", "adafactor": "Adafactor"}


def _text(r: dict) -> str:
    from ..sources.reports import shown  # one printable line per name (a config path may hold anything)

    s, d, t, c = r["setup"], r["per_device"], r["totals"], r["checkpoint"]
    tokens = f"batch {s['batch_size']} x {s['seq_len']} tokens" if s["seq_len"] else f"batch {s['batch_size']}"
    lines = [f"{shown(r['model'])}: {r['params']:,} parameters; {s['precision']}, {tokens}, {s['attention']} attention, "
             f"{s['world_size']} device(s), ZeRO stage {s['zero_stage']}",
             f"per device{'':<24}{_OPTIMIZER_NAMES[s['optimizer']] + ' fp32':>14}{'ckptq 8-bit':>14}{'4-bit':>14}"]
    opts = (f"{s['optimizer']}_fp32", "ckptq_8bit", "ckptq_4bit")
    single = [("weights", "weights (compute dtype)"), ("master_weights", "master weights (fp32)"),
              ("gradients", "gradients"), ("gathered_for_compute", "gathered for compute"),
              ("activations", "activations"), ("activations_checkpointed", "activations, checkpointed"),
              ("loss_backward", "loss backward (transient)")]
    for key, label in single[:4]:
        lines.append(f"  {label:<32}{_gib(d[key]):>14}")
    lines.append(f"  {'optimizer state':<32}" + "".join(f"{_gib(d['optimizer_' + o]):>14}" for o in opts))
    for key, label in single[4:]:
        lines.append(f"  {label:<32}{_gib(d[key]):>14}")
    for key, label in (("model_states", "total, model states"), ("peak", "peak of a step"),
                       ("peak_checkpointed", "peak, act. checkpointing"), ("accumulating", "peak, grad. accumulation"),
                       ("accumulating_checkpointed", "peak, accum. + act. ckpt.")):
        lines.append(f"  {label:<32}" + "".join(f"{_gib(t[o][key]):>14}" for o in opts))
    lines.append(f"checkpoint on disk (all ranks): fp32 {_gib(c['fp32'])}, ckptq 8-bit {_gib(c['ckptq_8bit'])} "
                 f"({_gib(c['ckptq_8bit_compressed'])} with --compress), 4-bit {_gib(c['ckptq_4bit'])}")
    return "\n".join(lines + [f"note: {shown(n)}" for n in r["notes"]])
