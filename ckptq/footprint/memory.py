"""What a full fine-tuning run needs, per device and on disk: ``ckptq.estimate`` / ``ckptq estimate``.

Model states follow ZeRO's accounting (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", §3): under mixed precision a device holds the 16-bit weights the kernels use,
their 16-bit gradients, and the optimizer's fp32 master weights and moments; stage 1 shards the optimizer
state (master weights included), stage 2 the gradients too, stage 3 (FSDP's full sharding) the weights as
well. In fp32 there is no master copy: the weights are the master. Activations: ``ckptq.footprint.activations``.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace

import torch

from ..codec import checkpoint, policy
from ..errors import UsageError
from .activations import activation_bytes
from .config import MAX_POSITIONS
from .params import Model, load_model
from .report import Estimate

PRECISIONS = {"fp32": 4, "bf16-mixed": 2, "fp16-mixed": 2}  # bytes of the weights/activations kernels use
ATTENTIONS = ("sdpa", "eager")
FP32_MOMENTS = 8  # AdamW: exp_avg + exp_avg_sq, fp32
# AdamW4bit's state: two 4-bit codes per byte and one fp32 scale per block of 128 values of a row, about
# 1.06 bytes per parameter for both moments (``convert --bits 4`` stores 6 + 2 bits: the same bytes).
FOUR_BIT = {"bits": 4, "block_size": 128}
# The lossless stage (``convert --compress``), measured per role with ``ckptq info --json`` on
# ``tools/scripts/make_checkpoint.py --size small --steps 400`` converted with and without ``--compress``: the
# weights (and the few states kept fp32) 10.40 -> 8.76 MB, 1.19x (as MiniLM's pretrained fp32 weights in
# tools/bench/compress.py); the 8-bit moments 5.22 -> 4.88 MB, 1.07x (ratio-encoded first-moment codes
# are near their entropy and stay raw; the second moment's codes shrink ~1.14x). bf16 weights do better.
COMPRESS_GAIN = {"weights": 1.19, "moments": 1.07}


def moment_bytes(shape: tuple, bits: int, block_size: int) -> int:
    """Bytes of one quantized moment of a tensor of ``shape`` in the row layout (docs/FORMAT.md): each row
    (dim 0; a 1-D tensor is one row) ``bits`` per code, packed from a byte boundary, and one fp32 scale per
    block of the row, the last block of a row possibly short (the codebook, 1 KiB, is left out)."""
    rows, length = (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))
    return rows * (math.ceil(length * bits / 8) + 4 * math.ceil(length / block_size)) if length else 0


OPTIMIZERS = ("adamw", "muon", "sgd", "lion", "adafactor")
_MUON_SKIPS = ("embed", "wte", "wpe", "lm_head")  # Muon runs leave these (and 1-D tensors) to AdamW


def tensor_states(optimizer: str, name: str, shape: tuple) -> tuple[int, int]:
    """(moments of the parameter's shape, fp32 elements of factored statistics) ``optimizer`` keeps for one
    parameter tensor. AdamW two; SGD (momentum) and Lion one; Muon one for the hidden matrices and AdamW's
    two for embeddings, the head and 1-D tensors (as Moonlight and modded-nanogpt run it; a bare count is
    taken as hidden matrices); Adafactor (transformers' defaults: no first moment) a row and a column
    statistic for a matrix, kept exact (``ckptq.codec.roles``), and one second moment for a 1-D tensor."""
    if optimizer in ("sgd", "lion"):
        return 1, 0
    if optimizer == "muon":
        hidden = (len(shape) == 2 and not any(s in name for s in _MUON_SKIPS)) or not name
        return (1, 0) if hidden else (2, 0)
    if optimizer == "adafactor":
        if not name:  # a bare count: the statistics of a square matrix of that many values
            return 0, 2 * math.isqrt(math.prod(shape))
        if len(shape) < 2:
            return 1, 0
        return 0, math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
    return 2, 0


def state_bytes(model: Model, bits: int | None, block_size: int, min_size: int, sharded: bool,
                optimizer: str = "adamw") -> int:
    """The optimizer's state of every parameter, its moments at ``bits`` (None: fp32): tensors below ``min_size``
    elements keep fp32 state (``checkpoint.is_quantizable``, the rule convert and the optimizer apply);
    ``sharded`` (FSDP2, ZeRO over DTensors) so do 1-D tensors, whose one row is split across ranks
    (``dtensor.shardable``). Factored statistics stay fp32."""
    total = 0
    for name, shape, times in model.named_shape_counts():  # a decoder layer's shapes once, times the layers
        n = math.prod(shape)
        moments, factored = tensor_states(optimizer, name, tuple(shape))
        meta = torch.empty(shape, device="meta")
        quantized = bits and checkpoint.is_quantizable(meta, min_size) and (not sharded or len(shape) >= 2)
        one = moment_bytes(tuple(shape), bits, block_size) if quantized else 4 * n
        total += times * (moments * one + 4 * factored)
    return total


@dataclass
class Setup:
    batch_size: int = 1  # sequences per device per micro-step
    seq_len: int | None = None  # default: the config's context, at most 2048
    world_size: int = 1
    zero_stage: int = 0  # 0: nothing sharded (DDP); 1: optimizer state; 2: + gradients; 3: + weights (FSDP)
    precision: str = "bf16-mixed"
    attention: str = "sdpa"
    block_size: int = policy.DEFAULT_BLOCK_SIZE
    min_size: int = policy.DEFAULT_MIN_SIZE
    optimizer: str = "adamw"  # one of OPTIMIZERS: whose state is counted

    def check(self) -> None:
        """UsageError naming the first bad value."""
        if not isinstance(self.optimizer, str) or self.optimizer not in OPTIMIZERS:
            raise UsageError(f"optimizer {self.optimizer!r:.40} must be one of {', '.join(OPTIMIZERS)}")
        for name, (low, high) in _BOUNDS.items():
            if not (name == "seq_len" and self.seq_len is None):
                _check_count(name, getattr(self, name), low, high)
        if type(self.zero_stage) is not int or self.zero_stage not in (0, 1, 2, 3):
            raise UsageError(f"ZeRO stage {self.zero_stage!r:.40} must be 0, 1, 2 or 3")
        for name, choices in (("precision", PRECISIONS), ("attention", ATTENTIONS)):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in choices:
                raise UsageError(f"{name} {getattr(self, name)!r:.40} must be one of {', '.join(choices)}")
        if type(self.block_size) is not int:
            raise UsageError(f"block size {self.block_size!r:.40} must be a whole number (a power of two, 64..4096)")
        policy.check_block_size(self.block_size)


# Far beyond any run (the largest use ~10**5 devices, contexts of 10M tokens): a typo or an overflow is
# refused, no real setup is. No bound on min_size: a huge one only means that no state is quantized.
_BOUNDS = {"batch_size": (1, 2**24), "seq_len": (1, MAX_POSITIONS), "world_size": (1, 2**24), "min_size": (1, None)}
_WORDS = {"seq_len": "sequence length"}


def _check_count(name: str, value, low: int, high: int | None) -> None:
    words = _WORDS.get(name, name.replace("_", " "))
    if type(value) is not int:
        raise UsageError(f"{words} {value!r:.40} must be a whole number")
    if value < low:
        raise UsageError(f"{words} {value} must be at least {low}")
    if high is not None and value > high:
        raise UsageError(f"{words} {str(value)[:40]} is beyond {high:,}, far beyond any training run")


def _shard(nbytes: int, setup: Setup, from_stage: int) -> int:
    return -(-nbytes // setup.world_size) if setup.zero_stage >= from_stage else nbytes


def _optimizer_states(model: Model, setup: Setup) -> dict:
    """{"<optimizer>_fp32", "ckptq_8bit", "ckptq_4bit"}: the optimizer's state per device before sharding."""
    # a bare parameter count has no shapes: counted as tensors of whole rows, as real models' matrices are
    sharded = setup.world_size > 1 and setup.zero_stage >= 1 and model.tensors is not None
    opt = setup.optimizer
    return {f"{opt}_fp32": state_bytes(model, None, setup.block_size, setup.min_size, sharded, opt),
            "ckptq_8bit": state_bytes(model, 8, setup.block_size, setup.min_size, sharded, opt),
            "ckptq_4bit": state_bytes(model, FOUR_BIT["bits"], FOUR_BIT["block_size"], setup.min_size, sharded, opt)}


def _optimizer_states_keys(setup: Setup) -> tuple[str, str, str]:
    return f"{setup.optimizer}_fp32", "ckptq_8bit", "ckptq_4bit"


def _gathered(model: Model, setup: Setup, p: int) -> int:
    """Stage 3: weights of the units being all-gathered at once, in the compute dtype, and their unsharded
    gradients before the reduce-scatter. FSDP2-style wrapping assumed: the root unit (embeddings, final
    norm, head) stays gathered through the forward, one decoder layer runs and the next is prefetched."""
    if setup.zero_stage < 3 or setup.world_size == 1 or model.arch is None:
        return 0
    layer = sum(math.prod(s) for _, s in model.layer_tensors(0))
    root = model.count - layer * model.arch.num_layers
    return p * (root + 2 * layer) + p * layer


def _disk(model: Model, setup: Setup) -> dict:
    """A checkpoint of fp32 weights and the optimizer state as written (not sharded: all ranks together)."""
    weights, opt = 4 * model.count, setup.optimizer
    eight = state_bytes(model, 8, setup.block_size, setup.min_size, False, opt)
    four = state_bytes(model, FOUR_BIT["bits"], FOUR_BIT["block_size"], setup.min_size, False, opt)
    fp32 = state_bytes(model, None, setup.block_size, setup.min_size, False, opt)
    return {"fp32": weights + fp32, "ckptq_8bit": weights + eight,
            "ckptq_8bit_compressed": int(weights / COMPRESS_GAIN["weights"] + eight / COMPRESS_GAIN["moments"]),
            "ckptq_4bit": weights + four}


def _totals(rows: dict, optimizer: int) -> dict:
    """``peak``: one micro-batch per step, gradients freed after it (``zero_grad(set_to_none=True)``): the
    backward starts with every activation alive plus the loss's gradient and no gradients yet, and ends
    with all gradients and no activations. ``accumulating``: gradients live through the forward (gradient
    accumulation), so everything adds up. The optimizer step's own temporaries are not counted."""
    held = rows["weights"] + rows["master_weights"] + rows["gathered_for_compute"] + optimizer
    out = {"model_states": held + rows["gradients"]}
    for suffix, acts in (("", rows["activations"]), ("_checkpointed", rows["activations_checkpointed"])):
        live = None if acts is None else acts + rows["loss_backward"]
        out["peak" + suffix] = None if live is None else held + max(live, rows["gradients"])
        out["accumulating" + suffix] = None if live is None else held + rows["gradients"] + live
    return out


def estimate(model: str | os.PathLike | int, *, batch_size: int = 1, seq_len: int | None = None,
             world_size: int = 1, zero_stage: int = 0, precision: str = "bf16-mixed", attention: str = "sdpa",
             optimizer: str = "adamw", block_size: int = policy.DEFAULT_BLOCK_SIZE,
             min_size: int = policy.DEFAULT_MIN_SIZE) -> Estimate:
    """What full fine-tuning of ``model`` needs per device, and its checkpoints on disk: ``ckptq estimate``.

    ``model``: a Hugging Face ``config.json``, a folder holding one, or a parameter count (``"7B"``,
    ``125_000_000``: no shapes, so no activations). ``batch_size`` sequences of ``seq_len`` tokens per device and micro-step
    (default: the config's context, at most 2048); ``world_size`` devices, of which ZeRO ``zero_stage`` shards
    the optimizer state and master weights (1), + gradients (2), + weights (3, FSDP's full sharding);
    ``precision`` ``"bf16-mixed"``, ``"fp16-mixed"`` or ``"fp32"``; ``attention`` ``"sdpa"`` (no scores kept) or
    ``"eager"``; ``optimizer`` whose state is counted (``"adamw"``, ``"muon"``, ``"sgd"``, ``"lion"``,
    ``"adafactor"``), fp32 and as ckptq stores it 8-bit (``block_size``, ``min_size`` as in ``convert``) and
    4-bit. Returns an ``Estimate`` (bytes; ``text()`` is the table the CLI prints); UsageError naming a bad
    value, InputError for a config ckptq cannot count."""
    if isinstance(model, int) and not isinstance(model, bool):
        model = str(model)
    elif isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise UsageError(f"model {model!r:.40} must be a config.json path, a folder holding one, or a parameter "
                         "count such as '7B'")
    setup = Setup(batch_size, seq_len, world_size, zero_stage, precision, attention, block_size, min_size, optimizer)
    return estimate_for(model, setup)


def estimate_for(spec: str, setup: Setup) -> Estimate:
    """``estimate`` of ``spec`` (a ``config.json``, a folder holding one, or a parameter count like ``7B``)
    under ``setup``."""
    setup.check()
    model = load_model(spec)
    p = PRECISIONS[setup.precision]
    mixed = setup.precision != "fp32"
    notes = []
    if model.arch and setup.seq_len is None:
        setup = replace(setup, seq_len=min(model.arch.max_positions or 2048, 2048))
    elif model.arch and model.arch.max_positions and setup.seq_len > model.arch.max_positions:
        notes.append(f"sequence length {setup.seq_len} is beyond the model's context ({model.arch.max_positions})")
    rows = {"weights": _shard(p * model.count, setup, 3),
            "master_weights": _shard(4 * model.count, setup, 1) if mixed else 0,
            "gradients": _shard(p * model.count, setup, 2),
            "gathered_for_compute": _gathered(model, setup, p)}
    rows |= {f"optimizer_{k}": _shard(v, setup, 1) for k, v in _optimizer_states(model, setup).items()}
    if model.arch:
        acts = activation_bytes(model.arch, setup.batch_size, setup.seq_len, p, setup.attention)
        rows |= {"activations": acts["none"], "activations_checkpointed": acts["full"], "loss_backward": acts["loss"]}
    else:
        rows |= {"activations": None, "activations_checkpointed": None, "loss_backward": None}
        notes.append("activations (and under ZeRO-3 the weights gathered for compute) need the architecture: "
                     "give a config.json instead of a parameter count")
    totals = {opt: _totals(rows, rows[f"optimizer_{opt}"]) for opt in _optimizer_states_keys(setup)}
    arch = asdict(model.arch) if model.arch else None
    return Estimate(model.source, model.count, arch, asdict(setup), rows, totals, _disk(model, setup), notes)
