"""MARS-AdamW: variance reduction for preconditioned optimizers (Yuan et al., ICML 2025,
arXiv 2411.10438), following the authors' code (github.com/AGI-Arena/MARS, `mars-adamw`).

For matrix parameters, with g_t the gradient given to this step and g_{t-1} the one given to the
previous step:

    c_t = g_t + gamma * b1 / (1 - b1) * (g_t - g_{t-1})      (variance-reduced gradient)
    c_t <- c_t / max(1, ||c_t||)                              (clip the per-tensor norm to 1)
    m   <- b1 m + (1 - b1) c_t ;  v <- b2 v + (1 - b2) c_t^2
    p   <- p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

"Previous gradient": this is the *approximate* MARS (the reference's default `is_approx=True`):
g_{t-1} is the previous batch's gradient at the previous weights, as handed to the optimizer,
not a second gradient of the previous batch at the current weights (the exact variant costs an
extra forward/backward). Under a delay emulator it is therefore the previous *stale* gradient.
It is a copy kept in the state (`last_grad`, zeros before the first step, as in the reference),
so it is checkpointed and never aliases `p.grad`.

1-D parameters, the embedding and the head use AdamW (groups with `algo='adamw'`), as the
reference does for 1-D parameters (`optimize_1d=False`); the reference applies MARS to every
2-D tensor including the embedding, we keep embedding/head on AdamW like Muon.
"""

from __future__ import annotations

import math

import torch

from stalepipe.training.optim.adamw import CompositeOptimizer
from stalepipe.training.optim.base import count_step, group_hyper


@torch.no_grad()
def mars_update(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    last_grad: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    gamma: float,
) -> None:
    """One MARS-AdamW step, in place on `p`, `exp_avg`, `exp_avg_sq` and `last_grad` (which
    holds g_{t-1} on entry and g_t on exit); `grad` is read only. `step` is 1-based."""
    c = grad + (gamma * beta1 / (1.0 - beta1)) * (grad - last_grad)  # c_t
    c.div_(c.norm().clamp(min=1.0))  # ||c_t|| <= 1 (no host sync)
    exp_avg.lerp_(c, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(c, c, value=1.0 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2**step)).add_(eps)
    p.mul_(1.0 - lr * weight_decay)
    p.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1**step))
    last_grad.copy_(grad)


class MARS(CompositeOptimizer):
    """MARS-AdamW for groups with `algo='mars'` (`lr, betas, eps, weight_decay, gamma`), AdamW for
    groups with `algo='adamw'` (`lr, betas, eps, weight_decay`). Never modifies `p.grad`."""

    algo = "mars"

    def _algo_update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        step = count_step(state, p, "exp_avg", "exp_avg_sq", "last_grad")
        mars_update(
            p,
            p.grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            state["last_grad"],
            step=step,
            **group_hyper(group, "eps", "gamma"),
        )
