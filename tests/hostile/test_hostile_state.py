"""``load_state_dict`` of hostile optimizer state dicts: every field of every parameter's state is checked
before anything changes.

First each spoiled field with the one-line message it must give (AdamW8bit and AdamW4bit, amsgrad's state,
``to_torch_state_dict``, eps=inf where torch accepts it): each of these used to load, then fail at the first
step with a raw TypeError or ctypes.ArgumentError, write NaN into the parameters, or make the C and PyTorch
kernels disagree (a NaN in a 4-bit exp_avg_sq codebook changed ~500 codes), or fail only at ``ckptq expand``.

Then a campaign over the class: every field of a quantized state, the step, torch's fp32 moments, the param
groups' values and ids, and bitsandbytes' fields, each given every kind of bad value that fits it (another
type, None, NaN/inf/huge/negative numbers, tensors of other dtypes, lengths, layouts: sparse,
non-contiguous, meta).

In the campaign, each trial must end one of two ways: a one-line ``StateMismatchError`` naming the field,
with the optimizer unchanged; or a load after which the next step leaves every parameter finite, where the
bad value still means the intact one (a non-contiguous or flattened copy) bit for bit what the intact state
gives. Never another exception, at the load or at the step, and never non-finite parameters, except from fp32 moments in
torch's form (torch's own, or bitsandbytes' decoded), which load as given: NaN or negative second moments
(kept fp32 with a warning, as tests/codec/test_convert_inputs.py pins) and first moments so large that
m / eps overflows fp32 (ckptq divides before it scales by the step size; torch scales first). ~630
trials, ~6 s.
"""

import copy
import warnings

import pytest
import torch

from ckptq.codec import foreign
from ckptq.errors import ArgumentError, StateMismatchError
from ckptq.optim import AdamW4bit, AdamW8bit, to_torch_state_dict

NAN, INF = float("nan"), float("inf")


# --- each spoiled field, with its message -----------------------------------------------------------

def _stepped(cls, amsgrad=False):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 128, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))]
    opt = cls(params, min_size=1024, amsgrad=amsgrad)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt, params


def _set(key, **fields):
    return lambda sd: sd["state"][0][key].update(fields)


def _poke(key, field, index, value):
    def spoil(sd):
        sd["state"][0][key][field][index] = value
    return spoil


def _retype(key, field, dtype):
    return lambda sd: sd["state"][0][key].update({field: sd["state"][0][key][field].to(dtype)})


SPOILED = {  # field -> (spoil the state dict, what the message says)
    "step NaN": (lambda sd: sd["state"][0].update(step=torch.tensor(NAN)), "'step' of parameter 0 is nan, not a finite count"),
    "step negative": (lambda sd: sd["state"][0].update(step=torch.tensor(-1.0)), "'step' of parameter 0 is -1.0, not a finite"),
    "step inf": (lambda sd: sd["state"][0].update(step=INF), "'step' of parameter 0 is inf, not a finite count"),
    "step beyond float": (lambda sd: sd["state"][0].update(step=10**400), "'step' of parameter 0 is inf, not a finite count"),
    "block_size float": (lambda sd: [sd["state"][0][k].update(block_size=256.0) for k in ("exp_avg", "exp_avg_sq")],
                         "'exp_avg' of parameter 0 is malformed: block_size 256.0 is not an int among 64, 128, 256"),
    "bits bool": (_set("exp_avg_sq", bits=True), "'exp_avg_sq' of parameter 0 is malformed: bits True is not an int among 8, 6, 4, 2"),
    "absmax float64": (_retype("exp_avg_sq", "absmax", torch.float64), "is malformed: absmax is torch.float64, where the kernels read float32"),
    "absmax NaN": (_poke("exp_avg_sq", "absmax", 3, NAN), "'exp_avg_sq' of parameter 0 is malformed: absmax holds 1 NaN or infinite scales"),
    "absmax inf": (_poke("exp_avg", "absmax", 0, INF), "'exp_avg' of parameter 0 is malformed: absmax holds 1 NaN or infinite scales"),
    "absmax negative": (_poke("exp_avg_sq", "absmax", 0, -1.0), "is malformed: absmax holds negative scales (min -1.0)"),
    "qmap NaN": (_poke("exp_avg_sq", "qmap", 5, NAN), "'exp_avg_sq' of parameter 0 is malformed: qmap holds NaN or infinite codes"),
    "qmap float64": (_retype("exp_avg", "qmap", torch.float64), "'exp_avg' of parameter 0 is malformed: qmap is torch.float64 ("),
    "qmap unsorted": (lambda sd: sd["state"][0]["exp_avg_sq"].update(qmap=sd["state"][0]["exp_avg_sq"]["qmap"].flip(0)),
                      "is malformed: qmap is not sorted ascending without repeats"),
    "dtype unknown": (_set("exp_avg_sq", dtype="nope"), "is malformed: dtype 'nope' is not the name of a floating-point dtype"),
    "dtype not a name": (_set("exp_avg", dtype=5), "is malformed: dtype 5 is not the name of a floating-point dtype"),
    "transform unknown": (_set("exp_avg_sq", transform="log"), "is malformed: transform 'log' is not one of none, sqrt, ratio"),
    "layout unknown": (_set("exp_avg_sq", layout="cols"), "is malformed: layout 'cols' is not one of"),
    "ratio eps NaN": (_set("exp_avg", eps=NAN), "'exp_avg' of parameter 0 is malformed: ratio eps nan is not a finite number >= 0"),
    "ratio eps inf": (_set("exp_avg", eps=INF), "is malformed: ratio eps inf is not a finite number >= 0"),
    "ratio eps negative": (_set("exp_avg", eps=-1e-8), "is malformed: ratio eps -1e-08 is not a finite number >= 0"),
    "shape of floats": (_set("exp_avg_sq", shape=(64.0, 128.0)), "is malformed: shape (64.0, 128.0) is not a sequence of ints >= 0"),
    "fp32 moment of ints": (lambda sd: sd["state"][1].update(exp_avg=sd["state"][1]["exp_avg"].long()),
                            "'exp_avg' of parameter 1 is a torch.int64 tensor, where Adam's moments are floating point"),
    "group eps inf": (lambda sd: sd["param_groups"][0].update(eps=INF), "param group 0 of the state dict: Invalid epsilon value: inf"),
}


@pytest.mark.parametrize("cls", [AdamW8bit, AdamW4bit])
@pytest.mark.parametrize("field", sorted(SPOILED))
def test_each_spoiled_field_is_refused_before_anything_changes(cls, field):
    spoil, match = SPOILED[field]
    opt, params = _stepped(cls)
    before = copy.deepcopy(opt.state_dict())
    sd = copy.deepcopy(before)
    spoil(sd)
    with pytest.raises(StateMismatchError) as info:
        opt.load_state_dict(sd)
    message = str(info.value)
    assert match in message and "\n" not in message, message
    if not field.startswith("group"):
        assert "load an intact state dict (or delete state[" in message  # the fix
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for key in ("exp_avg", "exp_avg_sq"):
        for part in ("codes", "absmax", "qmap"):
            assert torch.equal(after["state"][0][key][part], before["state"][0][key][part])
    assert torch.equal(after["state"][1]["exp_avg"], before["state"][1]["exp_avg"])


def test_amsgrad_state_is_checked_too():
    opt, _ = _stepped(AdamW8bit, amsgrad=True)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["max_exp_avg_sq"]["absmax"][0] = NAN
    with pytest.raises(StateMismatchError, match="'max_exp_avg_sq' of parameter 0 is malformed: absmax holds 1 NaN or infinite"):
        opt.load_state_dict(sd)


def test_intact_state_dicts_still_load_and_step_identically():
    for cls in (AdamW8bit, AdamW4bit):
        opt, params = _stepped(cls)
        twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        twin = cls(twin_params, min_size=1024)
        twin.load_state_dict(copy.deepcopy(opt.state_dict()))
        for p, q in zip(params, twin_params):
            p.grad = q.grad = torch.ones_like(p)
        opt.step(), twin.step()
        assert all(torch.equal(p, q) for p, q in zip(params, twin_params))


def test_decoding_for_torch_checks_the_fields_too():
    """``to_torch_state_dict`` / ``expand_on_load`` would have handed torch's AdamW NaN moments."""
    opt, _ = _stepped(AdamW8bit)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg_sq"]["absmax"][0] = NAN
    with pytest.raises(StateMismatchError, match="'exp_avg_sq' of parameter 0 is malformed: absmax holds 1 NaN or infinite"):
        to_torch_state_dict(sd)


def test_eps_inf_is_refused_where_torch_accepts_it():
    """torch's Adam(W) accepts eps=inf (every update 0, weight decay alone acts); in 8-bit state exp_avg is
    stored relative to sqrt(exp_avg_sq) + eps, which decodes to NaN: refused, at every door, saying why."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], eps=INF)  # accepted by torch
    with pytest.raises(ArgumentError, match=r"Invalid epsilon value: inf \(must be finite: torch.optim.Adam\(W\) accepts"):
        AdamW8bit([torch.nn.Parameter(torch.zeros(2))], eps=INF)
    opt = AdamW8bit([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ArgumentError, match="param group 1: Invalid epsilon value: inf"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "eps": INF})


# --- the campaign: every field, every kind of bad value ---------------------------------------------

# what a refusal's message must mention for each field (a field may be refused through a sibling it contradicts)
NAMES = {"bits": ("bits", "-bit"), "block_size": ("block_size", "absmax"), "shape": ("shape", "codes", "absmax"),
         "lr": ("lr", "learning rate"), "betas": ("beta",), "eps": ("eps",), "params": ("param",),
         "state1": ("state1", "'exp_avg' of parameter 0 has shape"), "state2": ("state2",), "qmap1": ("qmap1",),
         "qmap2": ("qmap2",),
         "absmax1": ("absmax1", "scales"), "absmax2": ("absmax2", "scales")}


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values, not contiguous."""
    out = torch.empty((*t.shape, 2), dtype=t.dtype)[..., 0]
    return out.copy_(t)


SCALARS = {"None": None, "text": "x", "bool": True, "int 7": 7, "float NaN": NAN, "float inf": INF, "-1.0": -1.0,
           "2**70": 2**70, "list": [1, 2], "dict": {}, "0-dim tensor": torch.tensor(1.0), "NaN tensor": torch.tensor(NAN)}
TENSORS = {  # kind -> (bad copy of a tensor, whether it still means the same values)
    "non-contiguous": (_strided, True),
    "flattened": (lambda t: t.reshape(-1), True),
    "sparse": (lambda t: t.to_sparse(), False),
    "meta": (lambda t: t.to("meta"), False),
    "float64": (lambda t: t.double(), False),
    "int64": (lambda t: t.long(), False),
    "one short": (lambda t: t.reshape(-1)[:-1].clone(), False),
    "one more": (lambda t: torch.cat([t.reshape(-1), t.reshape(-1)[:1]]), False),
    "NaN": (lambda t: torch.full_like(t, NAN) if t.is_floating_point() else None, False),
    "inf": (lambda t: torch.full_like(t, INF) if t.is_floating_point() else None, False),
    "3e38": (lambda t: torch.full_like(t, 3e38) if t.is_floating_point() else None, False),
    "-3e38": (lambda t: torch.full_like(t, -3e38) if t.is_floating_point() else None, False),
    "negated": (lambda t: -t.abs() - 1 if t.is_floating_point() else None, False),
    "empty": (lambda t: t.reshape(-1)[:0].clone(), False),
}


def _kinds(value):
    """(kind, bad value, same meaning) for one field's intact value."""
    out = [(kind, bad, False) for kind, bad in SCALARS.items()]
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        out += [(kind, make(value), same) for kind, (make, same) in TENSORS.items()]
    return [(kind, bad, same) for kind, bad, same in out if bad is not None or kind == "None"]


def _trained():
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 128, generator=gen)), torch.nn.Parameter(torch.randn(5, 3, generator=gen))]
    opt = AdamW8bit(params, min_size=1024)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def _bnb(intact: dict) -> dict:
    """The state dict with parameter 0's state as bitsandbytes 0.45 keeps it (codes in the param's shape)."""
    sd = copy.deepcopy(intact)
    gen = torch.Generator().manual_seed(1)
    q = {"state1": torch.randint(0, 256, (64, 128), generator=gen, dtype=torch.uint8),
         "state2": torch.randint(128, 256, (64, 128), generator=gen, dtype=torch.uint8),
         "qmap1": torch.linspace(-1, 1, 256), "qmap2": torch.linspace(0, 1, 256) ** 2,
         "absmax1": torch.rand(32, generator=gen) * 1e-3, "absmax2": torch.rand(32, generator=gen) * 1e-6}
    sd["state"][0] = {"step": torch.tensor(3.0), "__bnb_optimizer_quant_state__": q}
    return sd


def _fields(sd: dict) -> list[tuple[str, callable, object]]:
    """(name, setter into a copy of ``sd``, intact value) of every field the campaign spoils."""
    out = []

    def at(path):
        def put(d, value):
            holder = d
            for k in path[:-1]:
                holder = holder[k]
            holder[path[-1]] = value
        holder = sd
        for k in path:
            holder = holder[k]
        return put, holder

    for key in ("exp_avg", "exp_avg_sq"):
        for name in sorted(set(sd["state"][0][key]) - {"ckptq"}):
            out.append((f"{key}.{name}", *at(("state", 0, key, name))))
    for pid in (0, 1):
        out.append((f"state {pid}.step", *at(("state", pid, "step"))))
    for key in ("exp_avg", "exp_avg_sq"):
        out.append((f"state 1.{key}", *at(("state", 1, key))))
    for name in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "params"):
        out.append((f"group.{name}", *at(("param_groups", 0, name))))
    return out


def _words(field: str) -> tuple:
    name = field.rsplit(".", 1)[-1]
    if field.startswith("state 1.") and name != "step":
        return (f"'{name}'",)
    return NAMES.get(name, (name,))


def _snapshot(opt) -> tuple:
    """A fresh optimizer's: no state, its groups' values."""
    return len(opt.state), [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _trial(weights, base: dict, put, bad, grads) -> tuple[str, str, list | None]:
    """(outcome, message, parameters after the step)."""
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = AdamW8bit(params, min_size=1024, lr=2e-3)  # not base's lr: a load that changed the groups shows
    before = _snapshot(opt)
    sd = copy.deepcopy(base)
    put(sd, bad)
    try:
        opt.load_state_dict(sd)
    except StateMismatchError as e:
        unchanged = before == _snapshot(opt)
        return ("refused" if unchanged else "refused, but changed the optimizer"), str(e), None
    except Exception as e:  # noqa: BLE001 -- what the campaign must never see
        return f"raw {type(e).__name__} at load", str(e)[:200], None
    for p, g in zip(params, grads):
        p.grad = g.clone()
    try:
        opt.step()
    except Exception as e:  # noqa: BLE001
        return f"raw {type(e).__name__} at the step", str(e)[:200], None
    finite = all(bool(torch.isfinite(p).all()) for p in params)
    return ("stepped" if finite else "non-finite parameters"), "", [p.detach().clone() for p in params]


FP32_MAX = float(torch.finfo(torch.float32).max)


def _as_given(sd: dict, eps: float = 1e-8) -> bool:
    """Whether the state dict holds fp32 moments in torch's form (bitsandbytes' decoded) that step to
    non-finite values as given: NaN or infinite, negative second moments, or |m| / eps beyond fp32."""
    for pstate in sd["state"].values():
        moments = foreign.to_torch_state(pstate) or pstate
        m, v = moments.get("exp_avg"), moments.get("exp_avg_sq")
        if not all(isinstance(t, torch.Tensor) and t.layout == torch.strided and t.is_floating_point() for t in (m, v)):
            continue
        if not (torch.isfinite(m).all() and torch.isfinite(v).all()) or (v < 0).any() or m.abs().max() / eps > FP32_MAX:
            return True
    return False


def _campaign(weights, base: dict, fields) -> tuple[dict, list]:
    grads = [torch.randn(w.shape, generator=torch.Generator().manual_seed(7)) * 1e-2 for w in weights]
    intact = _trial(weights, base, lambda sd, v: None, None, grads)[2]
    counts, bad_outcomes = {}, []
    for field, put, value in fields:
        for kind, bad, same in _kinds(value):
            outcome, message, after = _trial(weights, base, put, bad, grads)
            if outcome == "refused" and ("\n" in message or not any(w in message for w in _words(field))):
                outcome = "refused without naming the field in one line"
            if outcome == "stepped" and same and not all(torch.equal(a, b) for a, b in zip(after, intact)):
                outcome = "stepped to other values than the intact state"
            if outcome == "non-finite parameters" and field.startswith(("state 1.e", "bnb.")):
                sd = copy.deepcopy(base)
                put(sd, bad)
                if _as_given(sd):
                    outcome = "torch's fp32 moments as given"
            counts[outcome] = counts.get(outcome, 0) + 1
            if outcome not in ("refused", "stepped", "torch's fp32 moments as given"):
                bad_outcomes.append((field, kind, outcome, message))
    return counts, bad_outcomes


def test_every_field_of_an_optimizer_state_dict_is_refused_by_name_or_steps_finitely():
    weights, sd = _trained()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "kept in fp32": the fp32 moments 8 bits would damage
        counts, bad = _campaign(weights, sd, _fields(sd))
    assert not bad, bad[:8]
    assert counts["refused"] > 250 and counts["stepped"] > 20, counts  # the campaign does damage what it tests


def test_every_field_of_a_bitsandbytes_state_is_refused_by_name_or_steps_finitely():
    weights, intact = _trained()
    sd = _bnb(intact)
    q = sd["state"][0]["__bnb_optimizer_quant_state__"]
    fields = [(f"bnb.{name}", (lambda n: lambda d, v: d["state"][0]["__bnb_optimizer_quant_state__"].__setitem__(n, v))(name),
               value) for name, value in q.items()]
    fields.append(("bnb.step", lambda d, v: d["state"][0].__setitem__("step", v), sd["state"][0]["step"]))
    counts, bad = _campaign(weights, sd, fields)
    assert not bad, bad[:8]
    assert counts["refused"] > 60 and counts["stepped"] > 5, counts
