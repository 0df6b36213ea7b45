"""The optimizer tests' small problem: a 64 x 96 least-squares layer, trained from one seed."""

from __future__ import annotations

import torch


def problem(seed: int = 0, shape: tuple[int, int] = (64, 96)):
    """(initial weights, inputs, targets) of the problem from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(shape, generator=g) * 0.1
    x, y = torch.randn(256, shape[1], generator=g), torch.randn(256, shape[0], generator=g)
    return w0, x, y


def train(make, steps: int = 30, seed: int = 0, w=None, opt=None):
    """The layer trained ``steps`` steps by ``make([w])`` (or by ``opt`` over ``w``, to go on from where they
    are); returns (weights, last loss, optimizer)."""
    w0, x, y = problem(seed)
    w = torch.nn.Parameter(w0.clone()) if w is None else w
    opt = make([w]) if opt is None else opt
    for _ in range(steps):
        loss = ((x @ w.T - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w.detach().clone(), loss.item(), opt
