"""Adan: adaptive Nesterov momentum (Xie et al., TPAMI 2024, arXiv 2208.06677), following the
authors' code (github.com/sail-sg/Adan) and its convention that the code's betas are one minus the
paper's (code (0.98, 0.92, 0.99) = paper (0.02, 0.08, 0.01)).

With g_t the gradient and d_t = g_t - g_{t-1} (d_1 = 0: the previous gradient starts as g_1):

    m_t = b1 m + (1 - b1) g_t                          (gradient EMA)
    e_t = b2 e + (1 - b2) d_t                          (gradient-difference EMA)
    n_t = b3 n + (1 - b3) (g_t + b2 d_t)^2             (second moment of the Nesterov gradient)
    u_t = (m_t / (1 - b1^t) + b2 e_t / (1 - b2^t)) / (sqrt(n_t / (1 - b3^t)) + eps)
    p   <- (p - lr u_t) / (1 + lr wd)                  (proximal decay, Alg. 1; the default)
    p   <- p (1 - lr wd) - lr u_t                      (AdamW-style decay, `no_prox=True`)

The previous gradient is a copy kept in the state (`prev_grad`); unlike the reference code, which
scales `p.grad` in place for its optional global clipping, nothing here writes to `p.grad`
(clipping belongs to the training loop).
"""

from __future__ import annotations

import math

import torch

from stalepipe.training.optim.base import ParamwiseOptimizer, count_step, group_hyper


@torch.no_grad()
def adan_update(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_diff: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    prev_grad: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    beta3: float,
    eps: float,
    weight_decay: float,
    no_prox: bool = False,
) -> None:
    """One Adan step, in place on `p` and the four state tensors; `grad` is read only.

    `step` is 1-based; `prev_grad` must hold g_{t-1} (g_1 itself at step 1) and is overwritten
    with `grad`.
    """
    diff = grad - prev_grad  # d_t = g_t - g_{t-1}
    exp_avg.lerp_(grad, 1.0 - beta1)  # m_t
    exp_avg_diff.lerp_(diff, 1.0 - beta2)  # e_t (the paper's v_k)
    nesterov = diff.mul_(beta2).add_(grad)  # g_t + b2 d_t (reuses diff's memory)
    exp_avg_sq.mul_(beta3).addcmul_(nesterov, nesterov, value=1.0 - beta3)  # n_t
    denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta3**step)).add_(eps)
    if no_prox:
        p.mul_(1.0 - lr * weight_decay)
    p.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1**step))
    p.addcdiv_(exp_avg_diff, denom, value=-lr * beta2 / (1.0 - beta2**step))
    if not no_prox:
        p.div_(1.0 + lr * weight_decay)  # theta = (1 + lr wd)^-1 [theta - eta_k o (...)]
    prev_grad.copy_(grad)


class Adan(ParamwiseOptimizer):
    """Adan for every parameter (see module docstring). Never modifies `p.grad`."""

    def __init__(
        self,
        params,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float, float] = (0.98, 0.92, 0.99),
        eps: float = 1e-8,
        weight_decay: float = 0.02,
        no_prox: bool = False,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, no_prox=no_prox)
        super().__init__(params, defaults)

    def _update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        fresh = not state
        step = count_step(state, p, "exp_avg", "exp_avg_diff", "exp_avg_sq")
        if fresh:
            state["prev_grad"] = p.grad.detach().clone()  # d_1 = 0
        adan_update(
            p,
            p.grad,
            state["exp_avg"],
            state["exp_avg_diff"],
            state["exp_avg_sq"],
            state["prev_grad"],
            step=step,
            **group_hyper(group, "eps", "no_prox"),
        )
