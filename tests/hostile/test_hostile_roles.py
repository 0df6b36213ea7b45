"""Hostile optimizer state read by role: zero-stride and overlapping views, odd groups and names, each refused in one
line (never exit 70, never an allocation out of proportion to the input), and the seeded campaigns of
tests/helpers/hostile_roles.py, run under a memory limit."""

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from ckptq.cli import main
from ckptq.codec import foreign
from ckptq.errors import StateMismatchError
from tests.helpers.hostile_roles import ROLE_KINDS, SHAPE, _bnb_state, _trained_state
from tests.helpers.paths import child_env


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def refused_in_one_line(path, *words):
    """info and convert refuse ``path`` in one line naming ``words``; nothing written, the input unchanged."""
    before = sorted(os.listdir(path.parent)), path.read_bytes()
    for args in (["info", path], ["convert", path]):
        r = cli(*args)
        assert r.exit_code not in (0, 70) and len(r.output.strip().splitlines()) == 1, r.output
        assert r.output.startswith("ckptq: error: ") and all(w in r.output for w in words), r.output
    assert (sorted(os.listdir(path.parent)), path.read_bytes()) == before


def _limited(code: str, limit_gib: int = 4) -> subprocess.CompletedProcess:
    """``code`` in a child whose address space is capped: an allocation of GiBs fails there at once."""
    head = ("import resource, warnings; warnings.filterwarnings('ignore'); "
            f"resource.setrlimit(resource.RLIMIT_AS, ({limit_gib} << 30, {limit_gib} << 30)); ")
    # env: the checkout on PYTHONPATH, so that the child imports tests.helpers whatever its cwd
    return subprocess.run([sys.executable, "-c", head + code], capture_output=True, text=True, timeout=600,
                          env=child_env())


def _zero_stride_bnb(numel=2**32, one_state=False) -> dict:
    """The issue's 3 KB bitsandbytes state: zero-stride state and absmax views claiming 2**32 codes."""
    q = {"state1": torch.zeros(1, dtype=torch.uint8).expand(numel), "qmap1": torch.linspace(-1, 1, 256),
         "absmax1": torch.ones(1).expand(numel // 256)}
    group = {"lr": 1e-3, "betas": (0.9, 0.0 if one_state else 0.999), "eps": 0.0 if one_state else 1e-8,
             "weight_decay": 0.0, "params": [0]}
    if not one_state:
        q |= {"state2": q["state1"], "qmap2": torch.linspace(0, 1, 256), "absmax2": q["absmax1"]}
    return {"state": {0: {"step": 3, foreign.BNB_NESTED: q}}, "param_groups": [group]}


def test_a_3kb_bitsandbytes_state_claiming_2_32_codes_is_refused_before_any_allocation(tmp_path):
    """``ckptq info`` tried to allocate 32 GiB (the OOM killer stopped it at 23.6 GB); the optimizers raised an
    untyped RuntimeError after the same allocation. Under a 4 GiB address-space limit: one line each."""
    path = tmp_path / "bnb.pt"
    torch.save({"optimizer": _zero_stride_bnb()}, path)
    assert os.path.getsize(path) < 8000
    code = (f"import torch, tests.helpers.hostile_roles as h, tests.hostile.test_hostile_roles as t; from ckptq.optim import AdamW8bit, SGD8bit; "
            f"print(h.cli('info', {str(path)!r})); print(h.cli('convert', {str(path)!r})); "
            "p = [torch.nn.Parameter(torch.zeros(64, 128))]\n"
            "for opt, sd in ((AdamW8bit(p), t._zero_stride_bnb()), (SGD8bit(p, momentum=0.9), t._zero_stride_bnb(one_state=True))):\n"
            "    try: opt.load_state_dict(sd)\n"
            "    except Exception as e: print(type(e).__name__, e)\n")
    r = _limited(code)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 4, r.stdout
    for line in lines[:2]:
        assert line.startswith("(3, 'ckptq: error: ") and "state1 is a view that repeats its bytes" in line, line
    for line in lines[2:]:
        assert line.startswith("StateMismatchError state of parameter 0: bitsandbytes state1 is a view"), line
    assert sorted(os.listdir(tmp_path)) == ["bnb.pt"]


@pytest.mark.parametrize("part", ["state1", "absmax1", "state2"])
def test_each_repeating_bitsandbytes_tensor_is_named(part):
    pstate, group = _bnb_state("nested", torch.Generator().manual_seed(0))
    q = pstate[foreign.BNB_NESTED]
    q[part] = torch.zeros(1, dtype=q[part].dtype).expand(q[part].shape)  # the right shape, one byte behind it
    with pytest.raises(foreign.InputError, match=f"bitsandbytes {part} is a view that repeats its bytes"):
        foreign.to_torch({"state": {0: pstate}, "param_groups": [group]})


def test_a_torchao_state_whose_codes_repeat_their_bytes_is_refused_at_load():
    from torchao.optim.subclass_8bit import OptimState8bit

    from ckptq.optim import AdamW8bit

    good = OptimState8bit.zeros(SHAPE, signed=True, block_size=256)
    bad = OptimState8bit(torch.zeros(1, dtype=torch.uint8).expand(2**32), torch.ones(1).expand(2**24), good.qmap, True)
    sd = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": bad, "exp_avg_sq": good}},
          "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
                            "params": [0]}]}
    opt = AdamW8bit([torch.nn.Parameter(torch.zeros(SHAPE))])
    with pytest.raises(StateMismatchError, match="torchao state exp_avg: its codes is a view that repeats its bytes"):
        opt.load_state_dict(sd)
    assert not opt.state


@pytest.mark.parametrize("numel, block", [(8192, 256), (2**22 + 300, 256), (2**22 + 4096, 2048), (5000, 5000)])
def test_bitsandbytes_decoding_by_chunks_is_the_plain_formula(numel, block):
    """qmap[code] * absmax[i // block], decoded a chunk at a time (across a chunk boundary, and the one-scale
    ``max1`` form): the same fp32 values, bit for bit."""
    g = torch.Generator().manual_seed(numel)
    codes = torch.randint(0, 256, (numel,), generator=g, dtype=torch.uint8)
    qmap, scales = torch.linspace(-1, 1, 256), torch.rand(-(-numel // block), generator=g)
    want = qmap[codes.long()] * scales.repeat_interleave(block)[:numel]
    assert torch.equal(foreign._decoded(codes, qmap, scales, block), want)


# --- item 5: crafted role data, once exit 70 ("internal error") --------------------------------------------

def _rmsprop(**edit):
    sd = _trained_state("rmsprop centered", torch.Generator().manual_seed(0))
    for key, value in edit.items():
        if key == "grad_avg":
            sd["state"][0]["grad_avg"] = value
        else:
            sd["param_groups"][0][key] = value
    return sd


def _adam(dwd):
    sd = _trained_state("adam", torch.Generator().manual_seed(0))
    sd["param_groups"][0]["decoupled_weight_decay"] = dwd
    return sd


def _unhashable():
    sd = _trained_state("adamw", torch.Generator().manual_seed(0))
    sd["param_groups"][0]["params"] = [[0], 1]
    return sd


def _qmap_16x16():
    pstate, group = _bnb_state("nested", torch.Generator().manual_seed(0))
    pstate[foreign.BNB_NESTED]["qmap1"] = pstate[foreign.BNB_NESTED]["qmap1"].reshape(16, 16)
    return {"state": {0: pstate}, "param_groups": [group]}


CASES = {
    "centered RMSprop, grad_avg shape != square_avg": (lambda: _rmsprop(grad_avg=torch.rand(64, 127)),
                                                        ("grad_avg has shape (64, 127)", "square_avg")),
    "centered=torch.ones(2)": (lambda: _rmsprop(centered=torch.ones(2)), ("centered", "True or False")),
    "decoupled_weight_decay=torch.ones(2)": (lambda: _adam(torch.ones(2)), ("decoupled_weight_decay",)),
    "unhashable params id": (_unhashable, ("param group 0 lists a parameter id that is a list",)),
    "bitsandbytes qmap1 16x16": (_qmap_16x16, ("qmap1 has shape (16, 16)",)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_role_data_is_refused_in_one_line_naming_the_field(tmp_path, case):
    make, words = CASES[case]
    torch.save({"optimizer": make()}, tmp_path / "x.pt")
    refused_in_one_line(tmp_path / "x.pt", *words)


def test_a_param_group_flag_of_0_or_1_still_reads():
    """An older or hand-made state dict's ``centered=1`` / ``decoupled_weight_decay=0`` are flags, not damage."""
    from ckptq.codec import plan

    sd = _rmsprop(centered=1)
    assert plan.make_plan({"optimizer": sd}, None, 4096).quantized
    sd = _adam(0)
    assert plan.recognise_all({"optimizer": sd})[0].name == "torch.optim.Adam"


# --- item 6 --------------------------------------------------------------------------------------------------

def test_estimate_prints_a_folder_name_escaped(tmp_path):
    """A name holding ``\\x1b]0;PWNED\\x07`` (an xterm title change) reached stdout raw, piped or not."""
    folder = tmp_path / "m\x1b]0;PWNED\x07"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                                    "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}))
    r = cli("estimate", folder)
    assert r.exit_code == 0 and "\x1b" not in r.output and "\x07" not in r.output, repr(r.output)
    assert "m\\x1b]0;PWNED\\x07" in r.output.splitlines()[0]


# --- the campaigns ---------------------------------------------------------------------------------------------

TRIALS = {"foreign": 60, "roles": 80, "estimate": 40}


def test_role_campaigns_refuse_or_handle_every_trial_under_a_memory_limit(tmp_path):
    """Seeded trials per class (tests/helpers/hostile_roles.py) in a child whose address space is capped at 4 GiB:
    bitsandbytes and torchao states whose views claim up to 2**40 values, param groups and states of other
    types, folder names with control characters. No trial may end "other"."""
    r = _limited(f"import json, tests.helpers.hostile_roles as h; print(json.dumps(h.roles_campaign({TRIALS!r}, 34, {str(tmp_path)!r})))")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.splitlines()[-1])
    assert res.pop("examples") == [], res
    assert set(res) == set(ROLE_KINDS)
    for kind, n in TRIALS.items():
        assert sum(res[kind].values()) == n and set(res[kind]) <= {"refused", "handled"}, res
    assert res["foreign"].get("refused", 0) >= 55 and res["roles"].get("refused", 0) >= 20, res  # it does damage
