"""The small model, param groups and training loop the tests share (nanoGPT in miniature), and counting
in an ``info --json`` report."""

import torch


class TinyLM(torch.nn.Module):
    """nanoGPT in miniature: token embedding tied with the output head, a LayerNorm, an MLP."""

    def __init__(self, vocab=96, dim=64):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.ln = torch.nn.LayerNorm(dim)
        self.fc = torch.nn.Linear(dim, 2 * dim)
        self.proj = torch.nn.Linear(2 * dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in nanoGPT

    def forward(self, idx):
        x = self.wte(idx)
        x = x + self.proj(torch.nn.functional.gelu(self.fc(self.ln(x))))
        return self.head(x)


def param_groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def batch(step, vocab=96):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, vocab, (8, 16), generator=g)
    return x, (x * 7 + 3) % vocab  # a learnable mapping


def train(model, opt, steps, start=0):
    losses = []
    for s in range(start, start + steps):
        x, y = batch(s)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def tensors(info: dict, role: str | None = None, bits: int | None = 0) -> int:
    """How many tensors an ``info --json`` report lists of ``role`` (None: any) at code width ``bits`` (0: any
    low-bit width, None: kept exact)."""
    return sum(r["tensors"] for r in info["states"] if role in (None, r["role"])
               and (r["bits"] == bits if bits != 0 else r["bits"] is not None))
