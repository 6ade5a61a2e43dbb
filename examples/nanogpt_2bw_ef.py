"""A nanoGPT-style training loop under a one-step gradient delay (PipeDream-2BW) and error
feedback: the loop is yours, `DelayedOptimizer` is the only change.

    python examples/nanogpt_2bw_ef.py              # ~3 s on a CPU core: sync / 2bw / 2bw+EF
    python examples/nanogpt_2bw_ef.py --steps 300 --stages 4

The model is a small GPT over Shakespeare's characters (the excerpt shipped with stalepipe),
split into pipeline stages by `split_stages`; the LR schedule is torch's `LambdaLR` on the
delayed optimizer itself, with gradient clipping, as in nanoGPT's `train.py`.
"""

from __future__ import annotations

import argparse
import math
from importlib import resources

import torch
from torch import nn
from torch.nn import functional as F

from stalepipe.config import DelayConfig
from stalepipe.delay import DelayedOptimizer, split_stages


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.size(1)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as nanoGPT: split_stages handles it

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def shakespeare() -> torch.Tensor:
    text = (resources.files("stalepipe") / "training/data/excerpt/hamlet.txt").read_text()
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def get_batch(data: torch.Tensor, step: int, batch: int, seq: int, split: str):
    n = int(0.9 * len(data))
    part = data[:n] if split == "train" else data[n:]
    g = torch.Generator().manual_seed(step if split == "train" else 10**6 + step)
    ix = torch.randint(len(part) - seq - 1, (batch,), generator=g)
    x = torch.stack([part[i : i + seq] for i in ix])
    y = torch.stack([part[i + 1 : i + seq + 1] for i in ix])
    return x, y


def train(arm: str, args: argparse.Namespace, data: torch.Tensor) -> float:
    torch.manual_seed(0)
    model = GPT(256, args.dim, args.layers, 2, args.seq)
    policy, ef = {"sync": ("sync", False), "2bw": ("2bw", False), "2bw+EF": ("2bw", True)}[arm]
    base = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    opt = DelayedOptimizer(
        base, split_stages(model, args.stages), DelayConfig(policy=policy, ef=ef), args.steps
    )
    warmup = max(1, args.steps // 10)

    def lr_at(k: int) -> float:  # linear warmup, cosine decay (nanoGPT's get_lr, as a factor)
        return min(1.0, (k + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * k / args.steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)  # on the delayed optimizer itself
    for step in range(args.steps):
        x, y = get_batch(data, step, args.batch, args.seq, "train")
        with opt.stale_weights():  # forward and backward at the weights the pipeline would use
            loss = model(x, y)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    model.eval()
    with torch.no_grad():
        return sum(model(*get_batch(data, i, 16, args.seq, "val")).item() for i in range(4)) / 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    data = shakespeare()
    print("final validation loss (nanoGPT-style loop, DelayedOptimizer)")
    for arm in ("sync", "2bw", "2bw+EF"):
        print(f"{arm:<7} {train(arm, args, data):.4f}")


if __name__ == "__main__":
    main()
