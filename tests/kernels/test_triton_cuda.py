"""What only a GPU can check of the Triton template's grouped steps (tools/scripts/gpu_check.sh runs these; elsewhere
they skip): a step captured in a CUDA graph, with hyper and seeds on the device and gradients (and, for a
rule that writes its direction, outs) allocated inside the capture, replays exactly as the eager step, bit
for bit; and no step, the first included, ever waits for the device (torch's sync debug mode raises on any
synchronizing call). The same for the optimizer: ``AdamW8bit(capturable=True).step()`` captured and replayed
equals its eager twin (and a capturable=False run), and its steady steps never wait for the device.
"""

import pytest
import torch

from ckptq.kernels import rules
from ckptq.kernels.contract import Dense, Group
from tests.kernels.cases import BLOCK, SHAPES, assert_same, hyper, members, on, slots

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
if torch.cuda.is_available():
    from ckptq.kernels import triton_group

ALIGNED_SHAPES = ((3, 80), (2, 128), (96,), (0,))  # every row a multiple of 16: the vectorizing path
AMSGRAD = rules.ADAM.flag("amsgrad")
WIDTHS = (6, 2, 4)


def _adam(pdtype, gen, shapes):
    """(slots on the device, members on the CPU) of an amsgrad Adam group at WIDTHS."""
    return slots("adam", AMSGRAD, WIDTHS, device="cuda"), members(slots("adam", AMSGRAD, WIDTHS), pdtype, gen, shapes)


def _dense(pdtype, n_states, gen):
    params = [torch.randn(n, generator=gen).to(pdtype).cuda() for n in (1, 300, 2048 + 5, 0, 77, 2096)]
    return params, [tuple(torch.rand(p.numel(), generator=gen).cuda() * 1e-2 for _ in range(n_states)) for p in params]


def _fill(sources, rows, seeds, step, gen):
    """New values in the static inputs of a step, in place (what a capturable optimizer does)."""
    for s in sources:
        s.copy_(torch.randn(s.numel(), generator=gen).to(s.dtype))
    for h, rule in rows:
        h.copy_(hyper(rule, h.shape[0]) * (1 + 0.01 * step))
    seeds.copy_(torch.randint(0, 2**32, seeds.shape, generator=gen))


def _assert_equal(a_members, b_members):
    for a, b in zip(a_members, b_members):
        assert_same(a.p, b.p)
        for x, y in zip(a.codes + a.absmax, b.codes + b.absmax):
            assert_same(x, y)


def test_a_captured_grouped_step_replays_as_the_eager_one():
    """An Adam group, a Muon-like group (momentum, its direction to outs made inside the capture) and a
    dense group, captured together."""
    gen = torch.Generator().manual_seed(0)
    adam_slots, adam_members = _adam(torch.bfloat16, gen, SHAPES + ALIGNED_SHAPES)
    muon_slots = slots("momentum", 0, (4,), device="cuda")
    muon_members = members(slots("momentum", 0, (4,)), torch.float32, gen)
    quantized = {which: ([on(m, "cuda") for m in adam_members], [on(m, "cuda") for m in muon_members])
                 for which in ("eager", "graphed")}
    params, states = _dense(torch.float32, 3, gen)
    dense = {which: ([p.clone() for p in params], [tuple(t.clone() for t in s) for s in states])
             for which in ("eager", "graphed")}
    sources = [torch.empty(m.p.numel(), dtype=torch.bfloat16, device="cuda") for m in adam_members]
    muon_sources = [torch.empty(m.p.numel(), device="cuda") for m in muon_members]
    dense_sources = [torch.empty(p.numel(), device="cuda") for p in params]
    adam_hyper = torch.empty(len(adam_members), len(rules.ADAM.fields), device="cuda")
    muon_hyper = torch.empty(len(muon_members), len(rules.MOMENTUM.fields), device="cuda")
    dense_hyper = torch.empty(len(params), len(rules.ADAM.fields), device="cuda")
    seeds = torch.empty(len(adam_members), dtype=torch.int64, device="cuda")
    caches = {(which, k): {} for which in ("eager", "graphed") for k in range(3)}
    outs = {}

    def step(which):
        adam, muon = quantized[which]
        grads = [s.mul(1.0) for s in sources]  # under capture: new tensors in the graph's pool
        triton_group.step(Group("adam", AMSGRAD, tuple(adam), tuple(grads), (), adam_hyper, seeds, adam_slots, BLOCK,
                                caches[which, 0]))
        outs[which] = tuple(torch.empty(m.p.numel(), device="cuda") for m in muon)
        triton_group.step(Group("momentum", 0, tuple(muon), tuple(s.mul(1.0) for s in muon_sources), outs[which],
                                muon_hyper, seeds[: len(muon)], muon_slots, BLOCK, caches[which, 1]))
        ps, ss = dense[which]
        triton_group.dense(Dense("adam", AMSGRAD, tuple(ps), tuple(s.mul(1.0) for s in dense_sources), tuple(ss), (),
                                 dense_hyper, caches[which, 2]))

    rows = [(adam_hyper, rules.ADAM), (muon_hyper, rules.MOMENTUM), (dense_hyper, rules.ADAM)]
    _fill(sources + muon_sources + dense_sources, rows, seeds, 1, gen)
    step("eager")
    step("graphed")  # the eager step before capture: builds the cache, compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step("graphed")
    for k in (2, 3, 4):
        _fill(sources + muon_sources + dense_sources, rows, seeds, k, gen)
        step("eager")
        graph.replay()
        for a, b in zip(quantized["eager"], quantized["graphed"]):
            _assert_equal(a, b)
        for a, b in zip(outs["eager"], outs["graphed"]):
            assert_same(a, b)
        (pa, sa), (pb, sb) = dense["eager"], dense["graphed"]
        for a, b in zip(pa + sum(map(list, sa), []), pb + sum(map(list, sb), [])):
            assert_same(a, b)


@pytest.mark.parametrize("where", ("host", "device"))
def test_no_grouped_step_waits_for_the_device(where):
    """Hyper and seeds on the host (pinned, non-blocking copies) or on the device; new gradient tensors at
    every step (the call table is rewritten each time); the first step builds the cache."""
    gen = torch.Generator().manual_seed(1)
    adam_slots, cpu_members = _adam(torch.float32, gen, SHAPES)
    quantized = [on(m, "cuda") for m in cpu_members]
    params, states = _dense(torch.bfloat16, 2, gen)
    cache, dense_cache = {}, {}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in (1, 2, 3):
            h, seeds = hyper(rules.ADAM, len(quantized)) * step, torch.arange(len(quantized)) * 977
            dense_h = hyper(rules.ADAM, len(params)) * step
            if where == "device":
                h, seeds, dense_h = (t.pin_memory().to("cuda", non_blocking=True) for t in (h, seeds, dense_h))
            grads = [torch.randn(m.p.numel(), device="cuda") for m in quantized]
            triton_group.step(Group("adam", AMSGRAD, tuple(quantized), tuple(grads), (), h, seeds, adam_slots, BLOCK,
                                    cache))
            dense_grads = [torch.randn(p.numel(), device="cuda", dtype=torch.bfloat16) for p in params]
            triton_group.dense(Dense("adam", 0, tuple(params), tuple(dense_grads), tuple(states), (), dense_h,
                                     dense_cache))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_eager_steps_between_replays_read_their_own_gradients():
    """Replays rewrite the call table with the addresses captured; an eager step of the same group
    afterwards, even with the gradients of its previous eager step, must put its own back."""
    gen = torch.Generator().manual_seed(2)
    adam_slots, cpu_members = _adam(torch.float32, gen, ALIGNED_SHAPES)
    eager, graphed = [on(m, "cuda") for m in cpu_members], [on(m, "cuda") for m in cpu_members]
    sources = [torch.empty(m.p.numel(), device="cuda") for m in eager]
    kept = [torch.empty_like(s) for s in sources]  # the gradients of every eager step of the captured group
    h = torch.empty(len(eager), len(rules.ADAM.fields), device="cuda")
    seeds = torch.empty(len(eager), dtype=torch.int64, device="cuda")
    reference_cache, cache = {}, {}

    def group(ms, grads, kept_cache):
        return Group("adam", AMSGRAD, tuple(ms), tuple(grads), (), h, seeds, adam_slots, BLOCK, kept_cache)

    for k in range(1, 7):  # 1: eager (builds the cache), then replay, eager, replay, eager, replay
        _fill(sources, [(h, rules.ADAM)], seeds, k, gen)
        triton_group.step(group(eager, [s.clone() for s in sources], reference_cache))
        if k % 2:
            for g, s in zip(kept, sources):
                g.copy_(s)
            triton_group.step(group(graphed, kept, cache))
        else:
            if k == 2:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    triton_group.step(group(graphed, [s.mul(1.0) for s in sources], cache))
            graph.replay()
        _assert_equal(eager, graphed)


def _cuda_grads(params, k):
    gen = torch.Generator().manual_seed(k)
    return [torch.randn(p.shape, generator=gen).cuda() for p in params]


@pytest.mark.parametrize("bits", (8, 4))
def test_a_captured_optimizer_step_replays_as_its_eager_twin(bits):
    """AdamW8bit/4bit(capturable=True).step() captured once in a CUDA graph after two eager steps and
    replayed with new gradients copied into the static ones: parameters and state (step counts, codes,
    scales, eps') equal an eager twin's bit for bit at every replay, and the parameters equal a
    capturable=False run's. A tensor lr on the device, changed in place between replays, takes effect."""
    from ckptq.optim import AdamW8bit
    from tests.optim.test_capturable import _assert_same_state_dicts, _model

    runs = []
    for capturable in (True, True, False):  # the graphed one, its eager twin, a host-scalar run
        params, groups = _model(device="cuda")
        for g in groups:
            g["lr"] = torch.tensor(g.get("lr", 1e-3), device="cuda")
        opt = AdamW8bit(groups, min_size=64, capturable=capturable, bits=bits)
        for p in params:
            p.grad = torch.zeros_like(p)  # static gradients, refilled in place
        runs.append((params, opt))

    def fill(k):
        for params, _ in runs:
            for p, g in zip(params, _cuda_grads(params, k)):
                p.grad.copy_(g)

    for k in range(2):
        fill(k)
        for _, opt in runs:
            opt.step()
    (graphed, opt), (twin, twin_opt), (host, host_opt) = runs
    fill(2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for k in range(2, 6):
        fill(k)
        if k == 4:
            for _, o in runs:
                for g in o.param_groups:
                    g["lr"].fill_(5e-4)
        graph.replay()
        twin_opt.step()
        host_opt.step()
        for a, b, c in zip(graphed, twin, host):
            assert_same(a, b)
            assert_same(a, c)
        _assert_same_state_dicts(opt.state_dict(), twin_opt.state_dict())
    assert float(opt.state[graphed[0]]["step"]) == 6.0


def test_capturable_optimizer_steps_do_not_wait_for_the_device():
    """Steps 2..4 of AdamW4bit(capturable=True) under torch's sync debug mode (any synchronizing call
    raises): two param groups whose float lrs a scheduler changes at every step (uploaded from pinned
    memory), new gradient tensors at every step."""
    from ckptq.optim import AdamW4bit
    from tests.optim.test_capturable import _model

    params, groups = _model(device="cuda")
    opt = AdamW4bit(groups, min_size=64, capturable=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    grads = [_cuda_grads(params, k) for k in range(4)]
    for p, g in zip(params, grads[0]):
        p.grad = g
    opt.step()
    schedule.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in (1, 2, 3):
            for p, g in zip(params, grads[k]):
                p.grad = g
            opt.step()
            schedule.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert float(opt.state[params[0]]["step"]) == 4.0
