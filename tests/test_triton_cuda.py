"""What only a GPU can check of the grouped Triton steps (tools/gpu_check.sh runs these; elsewhere they
skip): a step captured in a CUDA graph, with hyper and seeds on the device and gradients allocated inside
the capture, replays exactly as the eager step, bit for bit; and no step, the first included, ever waits
for the device (torch's sync debug mode raises on any synchronizing call). The same for the optimizer:
``AdamW8bit(capturable=True).step()`` captured and replayed equals its eager twin (and a capturable=False
run), and its steady steps never wait for the device.
"""

import pytest
import torch

from ckptq.kernels.contract import DenseGroup, StepGroup
from test_native import _assert_same
from test_triton_group import ALIGNED_SHAPES, SHAPES, _codebooks, _dense, _hyper, _members, _on

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
if torch.cuda.is_available():
    from ckptq.kernels import backend_triton, triton_group  # noqa: F401

WIDTHS, BLOCK = (6, 2, 4), 64


def _step_group(members, grads, hyper, seeds, books, cache):
    return StepGroup(tuple(members), tuple(grads), hyper, seeds, books, WIDTHS, BLOCK, True, False, cache)


def _fill(sources, hyper, seeds, step, gen):
    """New values in the static inputs of a step, in place (what a capturable optimizer does)."""
    for s in sources:
        s.copy_(torch.randn(s.numel(), generator=gen).to(s.dtype))
    hyper.copy_(_hyper(hyper.shape[0], step))
    seeds.copy_(torch.randint(0, 2**32, seeds.shape, generator=gen))


def _assert_equal(a_members, b_members):
    for a, b in zip(a_members, b_members):
        _assert_same(a.p, b.p)
        for x, y in zip(a.codes + a.absmax, b.codes + b.absmax):
            _assert_same(x, y)


def test_a_captured_grouped_step_replays_as_the_eager_one():
    gen = torch.Generator().manual_seed(0)
    members = _members(WIDTHS, torch.bfloat16, True, gen, SHAPES + ALIGNED_SHAPES)
    eager, graphed = [_on(m, "cuda") for m in members], [_on(m, "cuda") for m in members]
    params, moments = _dense(torch.float32, True, gen)
    dense_eager = ([p.cuda() for p in params], [tuple(t.cuda() for t in ms) for ms in moments])
    dense_graphed = ([p.cuda() for p in params], [tuple(t.cuda() for t in ms) for ms in moments])
    sources = [torch.empty(m.p.numel(), dtype=torch.bfloat16, device="cuda") for m in members]
    dense_sources = [torch.empty(p.numel(), device="cuda") for p in params]
    hyper, seeds = torch.empty(len(members), 10, device="cuda"), torch.empty(len(members), dtype=torch.int64, device="cuda")
    dense_hyper = torch.empty(len(params), 10, device="cuda")
    caches = {"eager": {}, "graphed": {}, "dense eager": {}, "dense graphed": {}}
    books = _codebooks(WIDTHS, True, "cuda")  # made before the capture: a host copy cannot be captured

    def step(which, quantized, dense):
        grads = [s.mul(1.0) for s in sources]  # under capture: new tensors in the graph's pool
        triton_group.adam_step_group(_step_group(quantized, grads, hyper, seeds, books, caches[which]))
        dense_grads = [s.mul(1.0) for s in dense_sources]
        triton_group.adam_dense_group(DenseGroup(tuple(dense[0]), tuple(dense_grads), tuple(dense[1]), dense_hyper,
                                                   False, caches["dense " + which]))

    _fill(sources + dense_sources, hyper, seeds, 1, gen)
    dense_hyper.copy_(_hyper(len(params), 1))
    step("eager", eager, dense_eager)
    step("graphed", graphed, dense_graphed)  # the eager step before capture: builds the cache, compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step("graphed", graphed, dense_graphed)
    _assert_equal(eager, graphed)  # capture runs nothing
    for k in (2, 3, 4):
        _fill(sources + dense_sources, hyper, seeds, k, gen)
        dense_hyper.copy_(_hyper(len(params), k))
        step("eager", eager, dense_eager)
        graph.replay()
        _assert_equal(eager, graphed)
        for a, b in zip(dense_eager[0] + sum(map(list, dense_eager[1]), []),
                        dense_graphed[0] + sum(map(list, dense_graphed[1]), [])):
            _assert_same(a, b)


@pytest.mark.parametrize("where", ("host", "device"))
def test_no_grouped_step_waits_for_the_device(where):
    """Hyper and seeds on the host (pinned, non-blocking copies) or on the device; new gradient tensors at
    every step (the gradient table is rewritten each time); the first step builds the cache."""
    gen = torch.Generator().manual_seed(1)
    members = [_on(m, "cuda") for m in _members(WIDTHS, torch.float32, True, gen, SHAPES)]
    params, moments = _dense(torch.bfloat16, False, gen)
    params, moments = [p.cuda() for p in params], [tuple(t.cuda() for t in ms) for ms in moments]
    cache, dense_cache, books = {}, {}, _codebooks(WIDTHS, True, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in (1, 2, 3):
            hyper, seeds = _hyper(len(members), step), torch.arange(len(members)) * 977
            dense_hyper = _hyper(len(params), step)
            if where == "device":
                hyper, seeds, dense_hyper = (t.to("cuda", non_blocking=True) for t in (hyper.pin_memory(),
                                             seeds.pin_memory(), dense_hyper.pin_memory()))
            grads = [torch.randn(m.p.numel(), device="cuda") for m in members]
            triton_group.adam_step_group(_step_group(members, grads, hyper, seeds, books, cache))
            dense_grads = [torch.randn(p.numel(), device="cuda", dtype=torch.bfloat16) for p in params]
            triton_group.adam_dense_group(DenseGroup(tuple(params), tuple(dense_grads), tuple(moments), dense_hyper,
                                                       False, dense_cache))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_eager_steps_between_replays_read_their_own_gradients():
    """Replays rewrite the gradient table with the addresses captured; an eager step of the same group
    afterwards, even with the gradients of its previous eager step, must put its own back."""
    gen = torch.Generator().manual_seed(2)
    members = _members(WIDTHS, torch.float32, True, gen, ALIGNED_SHAPES)
    eager, graphed = [_on(m, "cuda") for m in members], [_on(m, "cuda") for m in members]
    sources = [torch.empty(m.p.numel(), device="cuda") for m in members]
    kept = [torch.empty_like(s) for s in sources]  # the gradients of every eager step of the captured group
    hyper, seeds = torch.empty(len(members), 10, device="cuda"), torch.empty(len(members), dtype=torch.int64, device="cuda")
    books, reference_cache, cache = _codebooks(WIDTHS, True, "cuda"), {}, {}
    for k in range(1, 7):  # 1: eager (builds the cache), then replay, eager, replay, eager, replay
        _fill(sources, hyper, seeds, k, gen)
        triton_group.adam_step_group(_step_group(eager, [s.clone() for s in sources], hyper, seeds, books,
                                                   reference_cache))
        if k % 2:
            for g, s in zip(kept, sources):
                g.copy_(s)
            triton_group.adam_step_group(_step_group(graphed, kept, hyper, seeds, books, cache))
        else:
            if k == 2:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    triton_group.adam_step_group(_step_group(graphed, [s.mul(1.0) for s in sources], hyper, seeds,
                                                               books, cache))
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
    from test_capturable import _assert_same_state_dicts, _model

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
            _assert_same(a, b)
            _assert_same(a, c)
        _assert_same_state_dicts(opt.state_dict(), twin_opt.state_dict())
    assert float(opt.state[graphed[0]]["step"]) == 6.0


def test_capturable_optimizer_steps_do_not_wait_for_the_device():
    """Steps 2..4 of AdamW4bit(capturable=True) under torch's sync debug mode (any synchronizing call
    raises): two param groups whose float lrs a scheduler changes at every step (uploaded from pinned
    memory), new gradient tensors at every step."""
    from ckptq.optim import AdamW4bit
    from test_capturable import _model

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
