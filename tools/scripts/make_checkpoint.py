"""Train a small GPT-style LM on the CPU and save a nanoGPT-style checkpoint with AdamW state.

The checkpoint is test and benchmark input for ckptq: its optimizer state has the shape real ones
have (two param groups, tied embedding/head, betas (0.9, 0.95), weight decay 0.1, as in nanoGPT's
train.py). Tokens follow a Zipf law over a few thousand ids, so rare tokens' embedding rows get tiny
gradients and their second moments spread over many decades: the hard case for 8-bit state.

    PYTHONPATH=. python tools/scripts/make_checkpoint.py --size small --steps 400 --out /tmp/small.pt
"""

from __future__ import annotations

import argparse
import math

# size -> model and batch shape; "tiny" trains in a few seconds, "small" (~2.8 M params) in ~2 minutes.
SIZES = {
    "tiny": dict(vocab_size=1024, n_layer=2, n_head=2, n_embd=64, block_size=32, batch_size=8),
    "small": dict(vocab_size=4096, n_layer=4, n_head=4, n_embd=192, block_size=64, batch_size=16),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors answer here, before torch loads

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
LEARNING_RATE = 3e-3
ZIPF_EXPONENT = 1.1


class Block(nn.Module):
    """Pre-LayerNorm transformer block with causal self-attention and a 4x MLP."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, C]
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # [B, H, T, C/H]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's layout (wte, wpe, h, ln_f, lm_head) with the head tied to the token embedding."""

    def __init__(self, vocab_size: int, n_layer: int, n_head: int, n_embd: int, block_size: int):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                h=nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer)),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in nanoGPT
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # idx, targets: [B, T]
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # [B, T, V]
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def make_optimizer(model: nn.Module) -> torch.optim.AdamW:
    """nanoGPT's configure_optimizers: weight decay on >= 2-D tensors only."""
    params = [p for p in model.parameters() if p.requires_grad]  # parameters() dedupes the tied weight
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LEARNING_RATE, betas=BETAS)


def _transition_table(vocab_size: int, gen: torch.Generator) -> torch.Tensor:
    """A fixed random permutation: token t is usually followed by perm[t], so there is something to learn."""
    return torch.randperm(vocab_size, generator=gen)


def make_batch(vocab_size: int, batch_size: int, block_size: int, perm: torch.Tensor, gen: torch.Generator):
    """Zipf-distributed tokens where each position copies perm[previous] with probability 1/2."""
    ranks = torch.arange(1, vocab_size + 1, dtype=torch.float64)
    probs = ranks.pow(-ZIPF_EXPONENT)
    fresh = torch.multinomial(probs / probs.sum(), batch_size * (block_size + 1), replacement=True, generator=gen)
    seq = fresh.view(batch_size, block_size + 1)
    follow = torch.rand(batch_size, block_size, generator=gen) < 0.5
    for t in range(1, block_size + 1):
        seq[:, t] = torch.where(follow[:, t - 1], perm[seq[:, t - 1]], seq[:, t])
    return seq[:, :-1], seq[:, 1:]


def train(steps: int, size: str = "tiny", seed: int = 0) -> dict:
    """Train for ``steps`` AdamW steps and return a nanoGPT-style checkpoint dict (nothing is written)."""
    cfg = dict(SIZES[size])
    batch_size = cfg.pop("batch_size")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = GPT(**cfg)
    optimizer = make_optimizer(model)
    perm = _transition_table(cfg["vocab_size"], gen)
    loss = torch.tensor(math.inf)
    for _ in range(steps):
        x, y = make_batch(cfg["vocab_size"], batch_size, cfg["block_size"], perm, gen)
        loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "model_args": cfg,
        "iter_num": steps,
        "best_val_loss": loss.detach().clone(),
        "config": {"size": size, "seed": seed, "learning_rate": LEARNING_RATE, "betas": list(BETAS)},
    }


def main() -> None:
    args = build_parser().parse_args()
    ckpt = train(args.steps, args.size, args.seed)
    torch.save(ckpt, args.out)
    n = sum(p.numel() for p in ckpt["model"].values())
    print(f"wrote {args.out}: {args.steps} steps, {n:,} parameter values, final loss {ckpt['best_val_loss']:.3f}")


if __name__ == "__main__":
    main()
