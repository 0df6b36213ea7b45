"""ckptq estimate: parameter counts against models transformers builds from the same configs, the arithmetic
against hand-computed cases, activations against the tensors a real forward keeps, and bad input."""

import json
import math

import pytest
import torch
from click.testing import CliRunner

from ckptq.cli import main
from ckptq.errors import InputError, UsageError
from ckptq.footprint.memory import estimate, moment_bytes, state_bytes
from ckptq.footprint.activations import activation_bytes, layer_bytes_per_token
from ckptq.footprint.params import Architecture, Model, model_from_config, parse_count

SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, vocab_size=300)
CONFIGS = {
    "gpt2 tied": ("GPT2Config", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=128)),
    "gpt2 untied, n_inner": ("GPT2Config", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=128,
                                                n_inner=96, tie_word_embeddings=False)),
    "llama gqa": ("LlamaConfig", dict(SMALL, num_key_value_heads=2)),
    "llama biases, tied, head_dim": ("LlamaConfig", dict(SMALL, attention_bias=True, mlp_bias=True,
                                                         tie_word_embeddings=True, head_dim=32)),
    "mistral mqa": ("MistralConfig", dict(SMALL, num_key_value_heads=1)),
    "qwen2 tied": ("Qwen2Config", dict(SMALL, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(SMALL, num_key_value_heads=2, head_dim=24)),
}


def run(*args):
    return CliRunner().invoke(main, ["estimate", *map(str, args)], catch_exceptions=False)


def _hf_config(name, **overrides):
    transformers = pytest.importorskip("transformers")
    cls, kwargs = CONFIGS[name]
    return getattr(transformers, cls)(**{**kwargs, **overrides})


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_shapes_match_transformers(name):
    from transformers import AutoModelForCausalLM

    config = _hf_config(name)
    model = AutoModelForCausalLM.from_config(config)
    counted = model_from_config(config.to_dict())
    assert dict(counted.tensors) == {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert counted.count == sum(p.numel() for p in model.parameters())


def _saved_bytes(model, ids) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(saved.values())


@pytest.mark.parametrize("name,attention,dtype", [("llama gqa", "sdpa", torch.float32), ("llama gqa", "eager", torch.bfloat16),
                                                  ("qwen3", "sdpa", torch.bfloat16), ("qwen3", "eager", torch.float32),
                                                  ("gpt2 tied", "eager", torch.float32)])
def test_one_layer_keeps_what_the_formula_says(name, attention, dtype):
    """What one decoder layer keeps for the backward, measured as the difference between 2- and 1-layer
    models (the head, ids and rotary tables cancel), equals the estimate to the byte."""
    from transformers import AutoModelForCausalLM

    batch, seq = 2, 24
    ids = torch.randint(0, 300, (batch, seq), generator=torch.Generator().manual_seed(0))
    saved = {}
    for layers in (1, 2):
        key = "n_layer" if name.startswith("gpt2") else "num_hidden_layers"
        config = _hf_config(name, **{key: layers}, **({"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
                                                     if name.startswith("gpt2") else {}))
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).to(dtype).train()
        saved[layers] = _saved_bytes(model, ids)
    arch = model_from_config(config.to_dict()).arch
    p = torch.finfo(dtype).bits // 8
    assert saved[2] - saved[1] == batch * seq * layer_bytes_per_token(arch, seq, p, attention)


def _gpt(**changes) -> Architecture:
    fields = dict(model_type="gpt2", family="gpt2", vocab_size=1000, hidden_size=512, num_layers=3, num_heads=8,
                  num_kv_heads=8, head_dim=64, intermediate_size=2048, max_positions=1024, tied_embeddings=True,
                  qkv_bias=True, out_bias=True, mlp_bias=True, qk_norm=False, dropout=True, attention_dropout=True,
                  hidden_act="gelu")
    return Architecture(**{**fields, **changes})


def test_activations_reduce_to_korthikanti():
    """GPT layer, 16-bit, dropout, eager attention: s*b*h*(34 + 5*a*s/h) bytes (Korthikanti et al. 2022), plus
    the two LayerNorms' fp32 mean and 1/std per token, which the paper leaves out."""
    a, s, b = _gpt(), 128, 3
    korthikanti = 34 * 512 + 5 * 8 * s + 2 * 8
    assert layer_bytes_per_token(a, s, 2, "eager") == korthikanti
    head = 2 * 512 + 8 + 2 * 512 + 6 * 1000 + 512  # final LayerNorm, head input, logits + fp32 log-probs, embedding dropout
    acts = activation_bytes(a, b, s, 2, "eager")
    assert acts["none"] == s * b * (3 * korthikanti + head)
    assert acts["full"] == s * b * (3 * 2 * 512 + korthikanti + head)  # inputs + one layer recomputed
    # SDPA (flash): no s^2 scores or their dropout; an fp32 log-sum-exp per head instead
    assert layer_bytes_per_token(a, s, 2, "sdpa") == korthikanti - 5 * 8 * s + 4 * 8


def test_quantized_state_sizes():
    """The row layout's bytes: per row, packed codes from a byte boundary and one scale per block of the row
    (a 1-D tensor is one row); FSDP2 keeps a 1-D tensor's state fp32 (its one row is split across ranks)."""
    assert moment_bytes((1000,), 8, 256) == 1000 + 4 * 4
    assert moment_bytes((1001,), 4, 128) == 501 + 4 * 8  # two codes per byte, the last one half used
    assert moment_bytes((64, 100), 8, 256) == 64 * (100 + 4)  # rows of 100: one short block each
    assert moment_bytes((3, 5, 51), 4, 128) == 3 * (128 + 4 * 2)  # rows of 255 4-bit codes: 128 bytes, 2 blocks
    model = Model("hand", 64 * 256 + 100 + 64 * 100 + 5000,
                  (("w", (64, 256)), ("b", (100,)), ("odd", (64, 100)), ("flat", (5000,))))
    common = 2 * (16384 + 4 * 64) + 8 * 100 + 2 * 64 * (100 + 4)  # "b" is below min_size 4096: fp32 state
    assert state_bytes(model, 8, 256, 4096, sharded=False) == common + 2 * (5000 + 4 * 20)
    assert state_bytes(model, 8, 256, 4096, sharded=True) == common + 8 * 5000


def test_each_optimizer_counts_its_own_state():
    """--optimizer: SGD and Lion keep one moment per parameter, Muon one for the hidden matrices and AdamW's
    two for the embedding, head and 1-D tensors, Adafactor a row and a column per matrix (kept fp32) and one
    moment per 1-D tensor; each moment 8-bit where it is large enough, as convert stores it."""
    model = Model("hand", 512 * 64 + 64 * 256 + 256 + 5000 + 512 * 64,
                  (("model.embed_tokens.weight", (512, 64)), ("model.layers.0.mlp.weight", (64, 256)),
                   ("model.layers.0.norm.weight", (256,)), ("model.layers.0.flat", (5000,)), ("lm_head.weight", (512, 64))))
    emb, mlp, flat = 512 * (64 + 4), 64 * (256 + 4), 5000 + 4 * 20  # one 8-bit moment of each; the norm is small
    fp32 = {"adamw": 8 * model.count, "sgd": 4 * model.count, "lion": 4 * model.count,
            "muon": 8 * (2 * 512 * 64 + 256 + 5000) + 4 * 64 * 256,
            "adafactor": 4 * (512 + 64 + 64 + 256 + 512 + 64) + 4 * (256 + 5000)}
    eight = {"adamw": 2 * (2 * emb + mlp + flat) + 8 * 256, "sgd": 2 * emb + mlp + flat + 4 * 256,
             "muon": 2 * (2 * emb + flat) + mlp + 8 * 256,
             "adafactor": 4 * (512 + 64 + 64 + 256 + 512 + 64) + 4 * 256 + flat}
    eight["lion"] = eight["sgd"]
    for opt in fp32:
        assert state_bytes(model, None, 256, 4096, False, opt) == fp32[opt], opt
        assert state_bytes(model, 8, 256, 4096, False, opt) == eight[opt], opt


def test_estimate_takes_the_optimizer():
    r = estimate("1000M", optimizer="sgd")
    assert r.per_device["optimizer_sgd_fp32"] == 4 * 10**9 and r.checkpoint["fp32"] == 8 * 10**9
    assert r.per_device["optimizer_ckptq_8bit"] == 10**9 + 4 * math.ceil(10**9 / 256)
    assert set(r.totals) == {"sgd_fp32", "ckptq_8bit", "ckptq_4bit"}
    out = run("1000M", "--optimizer", "muon")
    assert out.exit_code == 0 and "Muon fp32" in out.output and "3.73 GiB" in out.output  # 4 B per parameter
    with pytest.raises(UsageError, match="optimizer 'adam8' must be one of adamw, muon"):
        estimate("1B", optimizer="adam8")
    assert run("1B", "--optimizer", "adam8").exit_code == 2


@pytest.mark.parametrize("stage,sharded", [(0, ()), (1, ("master_weights", "opt")), (2, ("master_weights", "opt", "gradients")),
                                           (3, ("master_weights", "opt", "gradients", "weights"))])
def test_zero_stages_shard_what_they_should(stage, sharded):
    r = estimate("1000M", world_size=4, zero_stage=stage)
    n, d = 10**9, r.per_device
    full = {"weights": 2 * n, "master_weights": 4 * n, "gradients": 2 * n, "opt": 8 * n}
    for key, value in full.items():
        got = d["optimizer_adamw_fp32"] if key == "opt" else d[key]
        assert got == (value // 4 if key in sharded else value), key
    eight, four = 2 * (n + 4 * math.ceil(n / 256)), 2 * (n // 2 + 4 * math.ceil(n / 128))
    assert d["optimizer_ckptq_8bit"] == (eight // 4 if stage else eight)
    assert d["optimizer_ckptq_4bit"] == (four // 4 if stage else four)
    assert r.totals["ckptq_8bit"]["model_states"] == sum(v for k, v in d.items() if not k.startswith(("optimizer", "act", "loss"))) \
        + d["optimizer_ckptq_8bit"]
    assert d["activations"] is None and r.notes  # a bare count has no widths


def test_fp32_has_no_master_copy_and_disk_sizes():
    r = estimate("2B", precision="fp32")
    n = 2 * 10**9
    assert r.per_device["weights"] == 4 * n and r.per_device["master_weights"] == 0 and r.per_device["gradients"] == 4 * n
    assert r.checkpoint["fp32"] == 12 * n
    assert r.checkpoint["ckptq_8bit"] == 4 * n + 2 * (n + 4 * math.ceil(n / 256))
    assert r.checkpoint["ckptq_8bit_compressed"] < r.checkpoint["ckptq_8bit"]


@pytest.mark.parametrize("batch,seq,dominant", [(8, 256, "activations"), (1, 1, "gradients")])
def test_peak_is_the_backward_start_or_its_end(tmp_path, batch, seq, dominant):
    """A step peaks at the start of the backward (activations + the loss's gradient, no gradients yet) or
    at its end (all gradients, no activations); with gradient accumulation both coexist."""
    r = estimate(_write(tmp_path, {"model_type": "llama", **SMALL}), batch_size=batch, seq_len=seq, precision="fp32")
    d, t = r.per_device, r.totals["adamw_fp32"]
    held = d["weights"] + d["optimizer_adamw_fp32"]
    live = d["activations"] + d["loss_backward"]
    assert d["loss_backward"] == batch * seq * 4 * 300
    assert t["peak"] == held + (live if dominant == "activations" else d["gradients"])
    assert (live > d["gradients"]) == (dominant == "activations")
    assert t["accumulating"] == held + d["gradients"] + live
    assert t["peak_checkpointed"] < t["peak"] or dominant == "gradients"


def test_stage3_gathers_root_and_layers(tmp_path):
    config = {"model_type": "llama", **SMALL}
    r = estimate(_write(tmp_path, config), world_size=2, zero_stage=3, seq_len=16)
    model = model_from_config(config)
    layer = sum(math.prod(s) for _, s in model.layer_tensors(0))
    root = model.count - 2 * layer
    assert r.per_device["gathered_for_compute"] == 2 * (root + 2 * layer) + 2 * layer


def _write(tmp_path, obj):
    path = tmp_path / "config.json"
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


def test_parse_count():
    assert parse_count("7B") == 7 * 10**9 and parse_count("125m") == 125 * 10**6 and parse_count("1.5b") == 15 * 10**8
    assert parse_count("350k") == 350_000 and parse_count("1000") == 1000 and parse_count("config.json") is None


def test_cli_table_json_and_folder(tmp_path):
    config = {"model_type": "qwen2", **SMALL, "num_key_value_heads": 2, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = run(tmp_path, "-b", 2, "-n", 4, "--zero-stage", 2, "--json")
    assert r.exit_code == 0
    rep = json.loads(r.output)
    assert rep["params"] == model_from_config(config).count and rep["setup"]["seq_len"] == 512
    assert rep["per_device"]["activations"] > rep["per_device"]["activations_checkpointed"] > 0
    text = run(tmp_path / "config.json", "-s", 128).output
    assert "x 128 tokens" in text and "optimizer state" in text and "checkpoint on disk" in text
    assert "note: sequence length 4096 is beyond the model's context (512)" in run(tmp_path, "-s", 4096).output


def test_ckptq_estimate_is_what_the_cli_prints(tmp_path):
    """``ckptq.estimate`` (lazy on the package, as convert is) returns the report the CLI prints and serializes;
    the model may be a path object or a whole parameter count as well as a string."""
    import ckptq

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **SMALL}))
    r = ckptq.estimate(tmp_path, batch_size=2, world_size=4, zero_stage=3)
    assert r.text() == run(tmp_path, "-b", 2, "-n", 4, "--zero-stage", 3).output.rstrip("\n")
    assert r.as_dict() == json.loads(run(tmp_path, "-b", 2, "-n", 4, "--zero-stage", 3, "--json").output)
    assert ckptq.estimate(7_000_000_000).params == ckptq.estimate("7B").params == 7 * 10**9
    with pytest.raises(UsageError, match="model 7.5 must be a config.json path"):
        ckptq.estimate(7.5)


@pytest.mark.parametrize("args,message", [
    (("/nonexistent/config.json",), "no such config.json"),
    (("{bad json",), "not valid JSON"),
    (("[1, 2]",), "holds a JSON object"),
    (({"model_type": "bert", "hidden_size": 8},), "model_type 'bert' is not one ckptq can count"),
    (({"model_type": "llama", "hidden_size": 64},), "llama config needs vocab_size, intermediate_size"),
    (({"model_type": "llama", **SMALL, "hidden_size": -64},), "hidden_size is -64"),
    (({"model_type": "llama", **SMALL, "num_key_value_heads": 3},), "num_key_value_heads 3"),
    (("0B",), "must be positive"),
    (("7B", "-b", -1), "batch size -1 must be at least 1"),
    (("7B", "-n", 0), "world size 0 must be at least 1"),
    (("7B", "-s", -5), "sequence length -5"),
    (("7B", "--zero-stage", 4), "ZeRO stage 4"),
    (("7B", "--block-size", 100), "block"),
])
def test_cli_bad_input_is_one_line(args, message, tmp_path):
    first = args[0]
    if isinstance(first, dict) or (isinstance(first, str) and first[:1] in "{["):
        args = (_write(tmp_path, first),) + args[1:]
    r = run(*args)
    assert r.exit_code != 0
    assert r.output.startswith("ckptq: error: ") and r.output.count("\n") == 1 and message in r.output, r.output
    assert "Traceback" not in r.output


def test_library_errors_are_typed(tmp_path):
    with pytest.raises(InputError):
        estimate(_write(tmp_path, {"model_type": "gpt2"}))
    with pytest.raises(UsageError):
        estimate("7B", precision="int8")


LLAMA = {"model_type": "llama", **SMALL}
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 500, "n_positions": 128}
DIGITS_400 = int("1" + "0" * 400)


@pytest.mark.parametrize("config,message", [
    # counts: positive whole numbers within a bound (no bool, string, fraction, NaN/Inf, zero or absurd size)
    ({**LLAMA, "max_position_embeddings": -5}, "max_position_embeddings is -5; give a whole number from 1 to 1,073,741,824"),
    ({**LLAMA, "max_position_embeddings": float("nan")}, "max_position_embeddings is nan; give a whole number"),
    ({**LLAMA, "max_position_embeddings": "4096"}, "max_position_embeddings is '4096'; give a whole number"),
    ({**LLAMA, "max_position_embeddings": 0}, "max_position_embeddings is 0; give a whole number from 1"),
    ({**LLAMA, "num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000; give a whole number from 1 to 65,536, "
                                            "a bound far beyond any published model"),
    ({**LLAMA, "num_hidden_layers": 2**62}, "num_hidden_layers is 4611686018427387904; give a whole number from 1 to 65,536"),
    ({**LLAMA, "num_hidden_layers": DIGITS_400}, "num_hidden_layers is 1000000000000000000000000000000000000...; give"),
    ({**LLAMA, "num_hidden_layers": float("inf")}, "num_hidden_layers is inf; give a whole number"),
    ({**LLAMA, "head_dim": 2**62}, "head_dim is 4611686018427387904; give a whole number from 1 to 65,536"),
    ({**LLAMA, "head_dim": True}, "head_dim is True; give a whole number"),
    ({**LLAMA, "head_dim": 16.5}, "head_dim is 16.5; give a whole number"),
    ({**LLAMA, "num_key_value_heads": True}, "num_key_value_heads is True; give a whole number"),
    ({**LLAMA, "num_key_value_heads": 0}, "num_key_value_heads is 0; give a whole number from 1 to 65,536, or leave it out"),
    ({**LLAMA, "vocab_size": 2**40}, "vocab_size is 1099511627776; give a whole number from 1 to 16,777,216"),
    ({**LLAMA, "intermediate_size": 2**62}, "intermediate_size is 4611686018427387904; give a whole number from 1 to 1,048,576"),
    ({**LLAMA, "hidden_size": 2}, "hidden_size 2 is smaller than num_attention_heads 4; give head_dim"),
    ({**GPT2, "n_inner": "96"}, "n_inner is '96'; give a whole number"),
    ({**GPT2, "n_positions": -1}, "n_positions is -1; give a whole number"),
    # flags, rates, names, the model type
    ({**LLAMA, "tie_word_embeddings": "no"}, "tie_word_embeddings is 'no'; give true or false"),
    ({**LLAMA, "attention_bias": 1}, "attention_bias is 1; give true or false"),
    ({**LLAMA, "attention_dropout": "0.1"}, "attention_dropout is '0.1'; give a number from 0 to 1"),
    ({**GPT2, "resid_pdrop": float("nan")}, "resid_pdrop is nan; give a number from 0 to 1"),
    ({**GPT2, "attn_pdrop": 2}, "attn_pdrop is 2; give a number from 0 to 1"),
    ({**LLAMA, "hidden_act": 3}, "hidden_act is 3; give a name such as 'silu'"),
    ({**LLAMA, "model_type": ["llama"]}, "model_type ['llama'] is not one ckptq can count"),
    # the file: nesting, integers beyond Python's conversion limit
    ('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested 100001 deep; a config.json nests"),
    ('{"model_type": "llama", "hidden_size": 1' + "0" * 5000 + "}", "not valid JSON (Exceeds the limit (4300 digits)"),
])
def test_every_config_field_is_checked_in_one_line(tmp_path, config, message):
    """Each of these was accepted (a wrong estimate, "-0.03 GiB", "nan GiB"), an "internal error" (exit 70,
    once with a C++ backtrace), or allocated per layer without bound (10**9 layers)."""
    r = run(_write(tmp_path, config))
    assert r.exit_code == 3 and r.output.count("\n") == 1, r.output
    assert r.output.startswith(f"ckptq: error: {tmp_path / 'config.json'}: ") and message in r.output, r.output


@pytest.mark.parametrize("args,message", [
    ((str(DIGITS_400),), "parameter count '1000000000000000000000000000000000000000' is beyond 1000T"),
    (("1001T",), "parameter count '1001T' is beyond 1000T"),
    (("7B", "-s", 2**30 + 1), "sequence length 1073741825 is beyond 1,073,741,824, far beyond any training run"),
    (("7B", "-b", 10**30), "batch size 1000000000000000000000000000000 is beyond 16,777,216"),
    (("7B", "-n", 2**24 + 1), "world size 16777217 is beyond 16,777,216"),
])
def test_absurd_options_are_one_line(args, message):
    r = run(*args)
    assert r.exit_code == 2 and r.output.startswith(f"ckptq: error: {message}") and r.output.count("\n") == 1, r.output


@pytest.mark.parametrize("setup,message", [
    ({"batch_size": True}, "batch size True must be a whole number"),
    ({"seq_len": 128.0}, "sequence length 128.0 must be a whole number"),
    ({"block_size": 256.0}, "block size 256.0 must be a whole number"),
    ({"zero_stage": True}, "ZeRO stage True must be 0, 1, 2 or 3"),
    ({"precision": ["fp32"]}, "precision ['fp32'] must be one of"),
])
def test_library_setup_values_are_typed(setup, message):
    with pytest.raises(UsageError) as e:
        estimate("7B", **setup)
    assert str(e.value).startswith(message)


def test_whole_floats_count_as_integers(tmp_path):
    """JSON writers that print 4096.0 describe the same model as 4096."""
    as_float = estimate(_write(tmp_path, {**LLAMA, "num_hidden_layers": 2.0, "hidden_size": 64.0})).as_dict()
    assert as_float == estimate(_write(tmp_path, LLAMA)).as_dict()


def test_cost_is_independent_of_the_layer_count(tmp_path, monkeypatch):
    """The estimate never lists the layers one by one: 65,536 layers (the bound) cost what 2 do, and the
    figures are the per-layer sums."""
    import tracemalloc

    from ckptq.footprint import params

    small = model_from_config({**LLAMA, "num_hidden_layers": 3})
    listed = Model(small.source, small.count, tuple(small.tensors), small.arch)  # every tensor, one by one
    for sharded in (False, True):
        assert state_bytes(listed, 8, 64, 1000, sharded) == state_bytes(small, 8, 64, 1000, sharded)
    assert small.count == sum(math.prod(s) for _, s in small.tensors)

    def listing(self):
        raise AssertionError("the estimate listed every layer")

    monkeypatch.setattr(params.Layered, "__iter__", listing)
    path = _write(tmp_path, {**LLAMA, "num_hidden_layers": 2**16})
    tracemalloc.start()
    try:
        deep = estimate(path, world_size=2, zero_stage=3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * 2**20, peak
    layer = sum(math.prod(s) for _, s in small.layer_tensors(0))
    assert deep.params == small.count + (2**16 - 3) * layer


def test_a_huge_file_is_no_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"{" + b" " * (16 << 20) + b"}")
    r = run(path)
    assert r.exit_code == 3 and r.output == f"ckptq: error: {path}: 16,777,218 bytes is no config.json (they are a " \
                                            "few KB); give the model's config.json\n", r.output
