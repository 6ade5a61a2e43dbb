"""An accelerate training loop under sync / 2bw / 2bw+EF: `accelerator.prepare` takes the
`DelayedOptimizer` as it takes any torch optimizer (it is one), and the LR scheduler with it.

    python examples/accelerate_2bw.py              # a few seconds on CPU
    accelerate launch examples/accelerate_2bw.py   # the same script, as accelerate runs it

The only delay-specific line is `with delayed.stale_weights():` around the forward and
`accelerator.backward`.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn

from stalepipe.config import DelayConfig
from stalepipe.delay import DelayedOptimizer, split_stages

ARMS = {"sync": ("sync", False), "2bw": ("2bw", False), "2bw+EF": ("2bw", True)}


def regression(n: int = 512, dim: int = 16) -> torch.utils.data.TensorDataset:
    """y = a fixed random two-layer network of x, plus noise."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    w1, w2 = torch.randn(dim, 32, generator=g), torch.randn(32, 1, generator=g) / 6
    return torch.utils.data.TensorDataset(
        x, torch.tanh(x @ w1) @ w2 + 0.01 * torch.randn(n, 1, generator=g)
    )


def train(arm: str, args: argparse.Namespace) -> float:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 1),
    )
    policy, ef = ARMS[arm]
    base = torch.optim.AdamW(model.parameters(), lr=args.lr)
    delayed = DelayedOptimizer(
        base, split_stages(model, args.stages), DelayConfig(policy=policy, ef=ef), args.steps
    )
    sched = torch.optim.lr_scheduler.LambdaLR(delayed, lambda k: 1 - k / args.steps)
    data = torch.utils.data.DataLoader(
        regression(), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    model, opt, data, sched = accelerator.prepare(model, delayed, data, sched)
    step = 0
    while step < args.steps:
        for x, y in data:
            with delayed.stale_weights():
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            if step == args.steps:
                break
    assert delayed.step_count == args.steps
    x, y = regression().tensors
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args()
    print("final training loss (accelerate, DelayedOptimizer)")
    for arm in ARMS:
        print(f"{arm:<7} {train(arm, args):.4f}")


if __name__ == "__main__":
    main()
