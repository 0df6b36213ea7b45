"""The parameters of a model, from a Hugging Face ``config.json`` or a count: what ``ckptq estimate`` sizes.

For the architectures it knows, the parameter tensors of the ``*ForCausalLM`` model are listed with their
shapes, exactly as transformers builds them (tied embeddings counted once, biases where the family has
them, grouped-query attention's smaller key/value projections): ``tests/sources/test_estimate.py`` checks the
count against models built from the same configs. Shapes matter beyond the count: states below
``min_size`` elements stay fp32 in 8-bit optimizers, and the activation formula needs the widths.
The layers are described once and counted (``Layered``), so that nothing costs more with more layers.
Every field read is checked first (``config``).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from ..errors import InputError, UsageError
from .config import MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, Fields, read_config

# model_type -> the family whose layout it has. "llama" covers Llama 2/3, Mistral (no MoE) and Qwen2/3:
# pre-norm RMSNorm decoder, rotary positions, gated (SwiGLU) MLP, optional grouped-query attention.
FAMILIES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama"}
_GPT2_FIELDS = ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions")
_LLAMA_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
MAX_COUNT = 10**15  # 1000T parameters: 500x the largest published models; exact as a float


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
class Layered:
    """A decoder's parameter tensors in closed form: those ``before`` and ``after`` the layers, and one
    layer's (names within it), which the model repeats ``repeat`` times as ``{prefix}{i}.{name}``.
    Iterating lists every (name, shape) in transformers' order (one entry per layer's tensor: for
    inspection and tests); ``shape_counts`` sizes the model without visiting the layers."""

    before: tuple[tuple[str, tuple[int, ...]], ...]
    layer: tuple[tuple[str, tuple[int, ...]], ...]
    after: tuple[tuple[str, tuple[int, ...]], ...]
    prefix: str
    repeat: int

    def __iter__(self):
        yield from self.before
        for i in range(self.repeat):
            yield from ((f"{self.prefix}{i}.{name}", shape) for name, shape in self.layer)
        yield from self.after

    def shape_counts(self) -> list[tuple[tuple[int, ...], int]]:
        return [(s, times) for _, s, times in self.named_shape_counts()]

    def named_shape_counts(self) -> list[tuple[str, tuple[int, ...], int]]:
        """(name, shape, how many tensors): the layers' tensors once, named within a layer, times the layers."""
        return [(n, s, 1) for n, s in self.before] + [(n, s, self.repeat) for n, s in self.layer] + \
            [(n, s, 1) for n, s in self.after]


@dataclass(frozen=True)
class Model:
    """What is being estimated: its parameter tensors (name, shape) if known, else only a count."""

    source: str
    count: int
    tensors: tuple[tuple[str, tuple[int, ...]], ...] | Layered | None = None
    arch: Architecture | None = None

    def shape_counts(self) -> list[tuple[tuple[int, ...], int]]:
        """(shape, how many parameter tensors have it): from a config in closed form (cost independent of
        the layer count); a bare count is one tensor of that many elements."""
        if not self.tensors:
            return [((self.count,), 1)]
        if isinstance(self.tensors, Layered):
            return self.tensors.shape_counts()
        return [(s, 1) for _, s in self.tensors]

    def named_shape_counts(self) -> list[tuple[str, tuple[int, ...], int]]:
        """As ``shape_counts``, with the tensors' names ("" for a bare count)."""
        if not self.tensors:
            return [("", (self.count,), 1)]
        if isinstance(self.tensors, Layered):
            return self.tensors.named_shape_counts()
        return [(n, s, 1) for n, s in self.tensors]

    def layer_tensors(self, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"{self.tensors.prefix}{layer}.{name}", shape) for name, shape in self.tensors.layer]


def parse_count(text: str) -> int | None:
    """``7B`` / ``125M`` / ``1.5b`` / ``350k`` / ``1000000`` -> parameters; None if ``text`` is not a count."""
    m = _COUNT.match(text)
    if not m:
        return None
    value = float(m.group(1)) * _SCALE[m.group(2).lower()]  # inf for 400 digits
    if not value <= MAX_COUNT:
        raise UsageError(f"parameter count {text.strip()[:40]!r} is beyond 1000T ({MAX_COUNT:.0e}), far beyond any "
                         "model; give e.g. 125M or 7B")
    return int(round(value))


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
    return model_from_config(read_config(path), path)


def model_from_config(config: dict, source: str = "config") -> Model:
    arch = architecture(config, source)
    tensors = parameter_tensors(arch)
    return Model(source, sum(math.prod(s) * times for s, times in tensors.shape_counts()), tensors, arch)


def architecture(config: dict, source: str = "config") -> Architecture:
    """The widths of a known architecture, every field checked (``config.Fields``); InputError naming
    what is missing, unknown or out of range."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise InputError(f"{source}: model_type {model_type!r:.40} is not one ckptq can count ({known}); "
                         "pass the parameter count instead, e.g. `ckptq estimate 7B`")
    if FAMILIES[model_type] == "gpt2":
        return _gpt2(Fields(config, source))
    return _llama(Fields(config, source), model_type)


def _gpt2(f: Fields) -> Architecture:
    f.require(_GPT2_FIELDS, "gpt2")
    vocab, h, layers = f.count("vocab_size", MAX_VOCAB), f.count("n_embd", MAX_WIDTH), f.count("n_layer", MAX_LAYERS)
    heads, positions = f.count("n_head", MAX_HEADS), f.count("n_positions", MAX_POSITIONS)
    inner = f.count("n_inner", MAX_WIDTH, 4 * h)
    if h % heads:
        raise InputError(f"{f.source}: n_embd {h} is not a multiple of n_head {heads}")
    dropout = any(f.rate(k, 0.1) > 0 for k in ("resid_pdrop", "embd_pdrop"))
    return Architecture("gpt2", "gpt2", vocab, h, layers, heads, heads, h // heads, inner, positions,
                        f.flag("tie_word_embeddings", True), True, True, True, False, dropout,
                        f.rate("attn_pdrop", 0.1) > 0, f.text("activation_function", "gelu_new"))


def _llama(f: Fields, model_type: str) -> Architecture:
    f.require(_LLAMA_FIELDS, model_type)
    vocab, h = f.count("vocab_size", MAX_VOCAB), f.count("hidden_size", MAX_WIDTH)
    inter, layers = f.count("intermediate_size", MAX_WIDTH), f.count("num_hidden_layers", MAX_LAYERS)
    heads = f.count("num_attention_heads", MAX_HEADS)
    kv = f.count("num_key_value_heads", MAX_HEADS, heads)
    if heads % kv:
        raise InputError(f"{f.source}: num_key_value_heads {kv} must be a positive divisor of num_attention_heads {heads}")
    head_dim = f.count("head_dim", MAX_HEADS, h // heads)
    if head_dim == 0:  # transformers' default, hidden_size // num_attention_heads, is 0
        raise InputError(f"{f.source}: hidden_size {h} is smaller than num_attention_heads {heads}; give head_dim")
    attention_bias = f.flag("attention_bias", False)
    qkv_bias = model_type == "qwen2" or attention_bias  # Qwen2 always has them
    out_bias = model_type != "qwen2" and attention_bias
    return Architecture(model_type, "llama", vocab, h, layers, heads, kv, head_dim, inter,
                        f.count("max_position_embeddings", MAX_POSITIONS, None), f.flag("tie_word_embeddings", False),
                        qkv_bias, out_bias, f.flag("mlp_bias", False), model_type == "qwen3", False,
                        f.rate("attention_dropout", 0.0) > 0, f.text("hidden_act", "silu"))


def _linear(name: str, n_in: int, n_out: int, bias: bool, transposed: bool = False):
    """nn.Linear weights are [out, in]; GPT-2's Conv1D keeps [in, out]."""
    yield name + ".weight", (n_in, n_out) if transposed else (n_out, n_in)
    if bias:
        yield name + ".bias", (n_out,)


def parameter_tensors(a: Architecture) -> Layered:
    """(name, shape) of every parameter of the ``*ForCausalLM`` model, a tied head counted once."""
    h = a.hidden_size
    head = (("lm_head.weight", (a.vocab_size, h)),) if not a.tied_embeddings else ()
    if a.family == "gpt2":
        layer = (("ln_1.weight", (h,)), ("ln_1.bias", (h,)), *_linear("attn.c_attn", h, 3 * h, True, True),
                 *_linear("attn.c_proj", h, h, True, True), ("ln_2.weight", (h,)), ("ln_2.bias", (h,)),
                 *_linear("mlp.c_fc", h, a.intermediate_size, True, True),
                 *_linear("mlp.c_proj", a.intermediate_size, h, True, True))
        return Layered((("transformer.wte.weight", (a.vocab_size, h)), ("transformer.wpe.weight", (a.max_positions, h))),
                       layer, (("transformer.ln_f.weight", (h,)), ("transformer.ln_f.bias", (h,)), *head),
                       "transformer.h.", a.num_layers)
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    qk_norm = (("self_attn.q_norm.weight", (a.head_dim,)), ("self_attn.k_norm.weight", (a.head_dim,))) if a.qk_norm else ()
    layer = (*_linear("self_attn.q_proj", h, q, a.qkv_bias), *_linear("self_attn.k_proj", h, kv, a.qkv_bias),
             *_linear("self_attn.v_proj", h, kv, a.qkv_bias), *_linear("self_attn.o_proj", q, h, a.out_bias), *qk_norm,
             *_linear("mlp.gate_proj", h, a.intermediate_size, a.mlp_bias),
             *_linear("mlp.up_proj", h, a.intermediate_size, a.mlp_bias),
             *_linear("mlp.down_proj", a.intermediate_size, h, a.mlp_bias),
             ("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,)))
    return Layered((("model.embed_tokens.weight", (a.vocab_size, h)),), layer, (("model.norm.weight", (h,)), *head),
                   "model.layers.", a.num_layers)
