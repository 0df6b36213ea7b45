"""Activation memory of a decoder-only transformer: the tensors the forward pass keeps for the backward.

After Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" §4.1: one
GPT layer with 16-bit activations, dropout and no parallelism keeps ``s*b*h*(34 + 5*a*s/h)`` bytes
(sequence s, micro-batch b, width h, heads a): attention 11sbh + 5as²b, MLP 19sbh, two LayerNorms 4sbh.
Here the same count is taken tensor by tensor, so that it also holds for other widths and kernels:

- every tensor is ``p`` bytes per element (2 under bf16/fp16 mixed precision, 4 in fp32), masks 1 byte;
- grouped-query attention keeps keys and values at ``num_kv_heads * head_dim``;
- a gated MLP (SwiGLU) keeps 4 tensors of the intermediate width (gate output, its activation, up
  output, their product) where a plain one keeps 2; transformers' ``gelu_new`` (GPT-2's default) is
  written in Python ops and keeps 3 more;
- transformers' RMSNorm runs in fp32: it keeps its input upcast to fp32 and the normalized values, where
  a fused LayerNorm keeps only its input (both add fp32 statistics per token, which Korthikanti leaves out);
- ``attention="eager"`` (transformers' eager attention): the softmax output, a·s² per token (Llama-style
  models take it in fp32 and keep the cast copy too; with attention dropout its mask and output:
  Korthikanti's 5as²b at p=2); keys and values repeated to all heads, and the output projection's input
  is a copy of the attention output. ``"sdpa"`` (flash / memory-efficient kernels, PyTorch's SDPA on GPU
  and CPU): no s² term, keys and values at their own width; the kernel keeps its output (which is the
  output projection's input) and an fp32 log-sum-exp per head;
- outside the layers: the final norm, the head's input, the logits (held as the model's output) and the
  fp32 log-probabilities cross-entropy keeps, (p + 4)·V per token: at small widths and large vocabularies
  (GPT-2: V = 50257) this is the largest single term.

Full activation checkpointing (one checkpoint per layer) keeps each layer's input, ``p*s*b*h`` per layer
(Korthikanti's 2sbhL), and during the backward recomputes one layer at a time, whose activations are
added once. The backward begins with the loss: the gradient of the log-probabilities and of the logits,
fp32, while the log-probabilities are released; measured (torch's MemTracker, tools/bench/estimate_check.py),
this adds 4·V bytes per token to the activations at the start of the backward, the peak of a step.
"""

from __future__ import annotations

from .params import Architecture

# I-sized tensors an activation function keeps beyond its input (fused ones keep only the input).
# transformers' NewGELUActivation: 0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3))) keeps x * 0.5, tanh's
# output and 1 + tanh.
_EXTRA_ACT_SAVES = {"gelu_new": 3}


def _norm(a: Architecture, p: int, width: int, groups: int = 1) -> int:
    """Bytes a norm over ``groups`` vectors of ``width // groups`` keeps: RMSNorm its fp32 input, normalized
    values and fp32 1/rms per vector; LayerNorm its input and fp32 mean and 1/std per vector."""
    return (4 + p) * width + 4 * groups if a.norm == "rmsnorm" else p * width + 8 * groups


def layer_bytes_per_token(a: Architecture, seq_len: int, p: int, attention: str) -> int:
    """Bytes one decoder layer keeps per token for the backward (see the module docstring)."""
    h, q, kv = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    norms = 2 * _norm(a, p, h) + (_norm(a, p, q + kv, a.num_heads + a.num_kv_heads) if a.qk_norm else 0)
    if attention == "eager":  # keys and values repeated to every head; the output projection's input copied
        scores = p if a.family == "gpt2" else 4 + (p if p < 4 else 0)  # Llama-style: softmax in fp32, cast back
        scores += (1 + p) if a.attention_dropout else 0
        attn = p * h + p * 3 * q + p * q + seq_len * a.num_heads * scores
    else:  # the kernel's output is the output projection's input
        attn = p * h + p * (q + 2 * kv) + p * q + 4 * a.num_heads
    gated = 4 if a.gated_mlp else 2
    mlp = p * h + p * a.intermediate_size * (gated + _EXTRA_ACT_SAVES.get(a.hidden_act, 0))
    masks = 2 * h if a.dropout else 0  # after attention and after the MLP
    return norms + attn + mlp + masks


def head_bytes_per_token(a: Architecture, p: int) -> int:
    """Final norm, the head's input, logits and the loss's fp32 log-probabilities (and embedding dropout)."""
    return _norm(a, p, a.hidden_size) + p * a.hidden_size + (p + 4) * a.vocab_size + (a.hidden_size if a.dropout else 0)


def activation_bytes(a: Architecture, batch_size: int, seq_len: int, p: int, attention: str) -> dict:
    """Bytes for a micro-batch: {"none": kept without recomputation, "full": with one checkpoint per layer,
    "loss": the fp32 gradient of the logits the loss's backward allocates while they are all still kept}."""
    tokens = batch_size * seq_len
    layer = tokens * layer_bytes_per_token(a, seq_len, p, attention)
    head = tokens * head_bytes_per_token(a, p)
    return {"none": a.num_layers * layer + head,
            "full": a.num_layers * tokens * p * a.hidden_size + layer + head, "loss": tokens * 4 * a.vocab_size}
