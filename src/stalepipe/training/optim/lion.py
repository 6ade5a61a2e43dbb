"""Lion: evolved sign momentum (Chen et al., NeurIPS 2023, arXiv 2302.06675, Program 1):

    c_t = b1 m + (1 - b1) g_t
    p   <- p (1 - lr wd) - lr sign(c_t)
    m   <- b2 m + (1 - b2) g_t

Every coordinate moves by exactly lr (or 0), so Lion wants an LR 3-10x smaller and a weight decay
3-10x larger than AdamW's (the paper's tuning advice, keeping lr * wd comparable).
"""

from __future__ import annotations

import torch

from stalepipe.training.optim.base import ParamwiseOptimizer, group_hyper, zero_state


@torch.no_grad()
def lion_update(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """One Lion step, in place on `p` and `exp_avg`; `grad` is read only."""
    direction = exp_avg.lerp(grad, 1.0 - beta1).sign_()  # sign(b1 m + (1 - b1) g)
    p.mul_(1.0 - lr * weight_decay)
    p.add_(direction, alpha=-lr)
    exp_avg.lerp_(grad, 1.0 - beta2)  # m <- b2 m + (1 - b2) g


class Lion(ParamwiseOptimizer):
    """Lion for every parameter (see module docstring). Never modifies `p.grad`."""

    def __init__(
        self,
        params,
        *,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    def _update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        zero_state(state, p, "exp_avg")
        lion_update(p, p.grad, state["exp_avg"], **group_hyper(group))
