"""The parameters of a model, from a Hugging Face ``config.json`` or a count: what ``ckptq estimate`` sizes.

For the architectures it knows, the parameter tensors of the ``*ForCausalLM`` model are listed with their
shapes, exactly as transformers builds them (tied embeddings counted once, biases where the family has
them, grouped-query attention's smaller key/value projections): ``tests/test_estimate.py`` checks the
count against models built from the same configs. Shapes matter beyond the count: states below
``min_size`` elements stay fp32 in 8-bit optimizers, and the activation formula needs the widths.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

from ..errors import InputError, UsageError

# model_type -> the family whose layout it has. "llama" covers Llama 2/3, Mistral (no MoE) and Qwen2/3:
# pre-norm RMSNorm decoder, rotary positions, gated (SwiGLU) MLP, optional grouped-query attention.
FAMILIES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama"}
_GPT2_FIELDS = ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions")
_LLAMA_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


@dataclass(frozen=True)
class Architecture:
    """The widths that decide parameter shapes and activation sizes (one decoder layer repeated)."""

    model_type: str
    family: str  # "gpt2" or "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int | None
    tied_embeddings: bool
    qkv_bias: bool
    out_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: an RMSNorm of head_dim on each query and key head
    dropout: bool  # residual/embedding dropout active in training (GPT-2's default 0.1)
    attention_dropout: bool
    hidden_act: str  # the MLP's activation function, as transformers names it

    @property
    def gated_mlp(self) -> bool:
        return self.family == "llama"

    @property
    def norm(self) -> str:
        return "layernorm" if self.family == "gpt2" else "rmsnorm"


@dataclass(frozen=True)
class Model:
    """What is being estimated: its parameter tensors (name, shape) if known, else only a count."""

    source: str
    count: int
    tensors: tuple[tuple[str, tuple[int, ...]], ...] | None = None
    arch: Architecture | None = None

    def layer_tensors(self, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        prefix = ("transformer.h." if self.arch.family == "gpt2" else "model.layers.") + f"{layer}."
        return [t for t in self.tensors if t[0].startswith(prefix)]


def parse_count(text: str) -> int | None:
    """``7B`` / ``125M`` / ``1.5b`` / ``350k`` / ``1000000`` -> parameters; None if ``text`` is not a count."""
    m = _COUNT.match(text)
    if not m:
        return None
    return int(round(float(m.group(1)) * _SCALE[m.group(2).lower()]))


def load_model(spec: str) -> Model:
    """A parameter count, a ``config.json``, or a folder holding one."""
    count = parse_count(spec)
    if count is not None:
        if count <= 0:
            raise UsageError(f"parameter count {spec!r} must be positive (e.g. 125M, 7B)")
        return Model(spec, count)
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise InputError(f"{spec}: no such config.json, folder with one, or parameter count (e.g. 7B, 125M)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e}); give a Hugging Face config.json") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: a config.json holds a JSON object, not {type(config).__name__}")
    return model_from_config(config, path)


def model_from_config(config: dict, source: str = "config") -> Model:
    arch = architecture(config, source)
    tensors = tuple(parameter_tensors(arch))
    return Model(source, sum(math.prod(s) for _, s in tensors), tensors, arch)


def _fields(config: dict, names: tuple[str, ...], source: str, kind: str) -> list[int]:
    missing = [n for n in names if n not in config]
    if missing:
        raise InputError(f"{source}: a {kind} config needs {', '.join(missing)}; the file lacks them")
    values = [config[n] for n in names]
    for n, v in zip(names, values):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise InputError(f"{source}: {n} is {v!r}; it must be a positive integer")
    return values


def architecture(config: dict, source: str = "config") -> Architecture:
    """The widths of a known architecture; InputError naming what is missing or unknown."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise InputError(f"{source}: model_type {model_type!r} is not one ckptq can count ({known}); "
                         "pass the parameter count instead, e.g. `ckptq estimate 7B`")
    if FAMILIES[model_type] == "gpt2":
        return _gpt2(config, source)
    return _llama(config, model_type, source)


def _positive_float(config: dict, key: str, default: float) -> float:
    v = config.get(key, default)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _gpt2(config: dict, source: str) -> Architecture:
    vocab, h, layers, heads, positions = _fields(config, _GPT2_FIELDS, source, "gpt2")
    inner = config.get("n_inner") or 4 * h
    if h % heads:
        raise InputError(f"{source}: n_embd {h} is not a multiple of n_head {heads}")
    dropout = any(_positive_float(config, k, 0.1) > 0 for k in ("resid_pdrop", "embd_pdrop"))
    return Architecture("gpt2", "gpt2", vocab, h, layers, heads, heads, h // heads, inner, positions,
                        bool(config.get("tie_word_embeddings", True)), True, True, True, False, dropout,
                        _positive_float(config, "attn_pdrop", 0.1) > 0, str(config.get("activation_function", "gelu_new")))


def _llama(config: dict, model_type: str, source: str) -> Architecture:
    vocab, h, inter, layers, heads = _fields(config, _LLAMA_FIELDS, source, model_type)
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    if not isinstance(kv, int) or kv <= 0 or heads % kv:
        raise InputError(f"{source}: num_key_value_heads {kv!r} must be a positive divisor of num_attention_heads {heads}")
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise InputError(f"{source}: head_dim {head_dim!r} must be a positive integer")
    qkv_bias = model_type == "qwen2" or bool(config.get("attention_bias", False))  # Qwen2 always has them
    out_bias = model_type != "qwen2" and bool(config.get("attention_bias", False))
    return Architecture(model_type, "llama", vocab, h, layers, heads, kv, head_dim, inter,
                        config.get("max_position_embeddings"), bool(config.get("tie_word_embeddings", False)),
                        qkv_bias, out_bias, bool(config.get("mlp_bias", False)), model_type == "qwen3", False,
                        _positive_float(config, "attention_dropout", 0.0) > 0, str(config.get("hidden_act", "silu")))


def _linear(name: str, n_in: int, n_out: int, bias: bool, transposed: bool = False):
    """nn.Linear weights are [out, in]; GPT-2's Conv1D keeps [in, out]."""
    yield name + ".weight", (n_in, n_out) if transposed else (n_out, n_in)
    if bias:
        yield name + ".bias", (n_out,)


def parameter_tensors(a: Architecture):
    """(name, shape) of every parameter of the ``*ForCausalLM`` model, a tied head counted once."""
    h = a.hidden_size
    if a.family == "gpt2":
        yield from (("transformer.wte.weight", (a.vocab_size, h)), ("transformer.wpe.weight", (a.max_positions, h)))
        for i in range(a.num_layers):
            p = f"transformer.h.{i}."
            yield from ((p + "ln_1.weight", (h,)), (p + "ln_1.bias", (h,)))
            yield from _linear(p + "attn.c_attn", h, 3 * h, True, True)
            yield from _linear(p + "attn.c_proj", h, h, True, True)
            yield from ((p + "ln_2.weight", (h,)), (p + "ln_2.bias", (h,)))
            yield from _linear(p + "mlp.c_fc", h, a.intermediate_size, True, True)
            yield from _linear(p + "mlp.c_proj", a.intermediate_size, h, True, True)
        yield from (("transformer.ln_f.weight", (h,)), ("transformer.ln_f.bias", (h,)))
    else:
        yield "model.embed_tokens.weight", (a.vocab_size, h)
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        for i in range(a.num_layers):
            p = f"model.layers.{i}."
            yield from _linear(p + "self_attn.q_proj", h, q, a.qkv_bias)
            yield from _linear(p + "self_attn.k_proj", h, kv, a.qkv_bias)
            yield from _linear(p + "self_attn.v_proj", h, kv, a.qkv_bias)
            yield from _linear(p + "self_attn.o_proj", q, h, a.out_bias)
            if a.qk_norm:
                yield from ((p + "self_attn.q_norm.weight", (a.head_dim,)), (p + "self_attn.k_norm.weight", (a.head_dim,)))
            for name in ("gate_proj", "up_proj"):
                yield from _linear(p + "mlp." + name, h, a.intermediate_size, a.mlp_bias)
            yield from _linear(p + "mlp.down_proj", a.intermediate_size, h, a.mlp_bias)
            yield from ((p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)))
        yield "model.norm.weight", (h,)
    if not a.tied_embeddings:
        yield "lm_head.weight", (a.vocab_size, h)
