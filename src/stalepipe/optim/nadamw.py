"""NAdamW: Adam with Nesterov momentum (Dozat, "Incorporating Nesterov Momentum into Adam",
ICLR 2016 workshop) and decoupled weight decay (Loshchilov & Hutter, ICLR 2019), the optimizer
Ajanthan et al. (ICML 2025) pair with their per-stage momentum, at beta1 = 0.99.

With a constant beta1 (Dozat's rule without the momentum schedule mu_t), per step t >= 1:

    p     <- p (1 - lr wd)                                       decoupled decay
    m_t   =  b1 m + (1 - b1) g_t,   v_t = b2 v + (1 - b2) g_t^2
    m_hat =  b1 m_t / (1 - b1^(t+1)) + (1 - b1) g_t / (1 - b1^t)  Nesterov look-ahead
    p     <- p - lr m_hat / (sqrt(v_t / (1 - b2^t)) + eps)

torch.optim.NAdam(decoupled_weight_decay=True) is this rule only in the limit of a large
`momentum_decay`: its schedule is mu_t = b1 (1 - 0.5 * 0.96^(t psi)), so psi = 0 ("off") gives
mu_t = b1 / 2, not b1; at psi = 1e9 the power underflows to 0 and mu_t = b1 exactly (the tests
compare with torch there). torch keeps prod(mu_t) as a tensor of the default dtype (float32:
agreement to ~1e-6 relative; float64: to rounding), so the two are close, not bitwise equal.
"""

from __future__ import annotations

import torch

from stalepipe.optim.base import ParamwiseOptimizer, count_step, group_hyper


@torch.no_grad()
def nadamw_update(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One NAdamW step on `p` (module docstring), in place on `p`, `exp_avg`, `exp_avg_sq`;
    `grad` is only read. `step` is the 1-based index of this update."""
    p.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)  # m_t = b1 m + (1 - b1) g
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)  # v_t = b2 v + (1 - b2) g^2
    denom = exp_avg_sq.div(1.0 - beta2**step).sqrt_().add_(eps)
    # Dozat (2016), Alg. 2: the gradient's share at b1^t, the momentum's one step ahead
    p.addcdiv_(grad, denom, value=-lr * (1.0 - beta1) / (1.0 - beta1**step))
    p.addcdiv_(exp_avg, denom, value=-lr * beta1 / (1.0 - beta1 ** (step + 1)))


class NAdamW(ParamwiseOptimizer):
    """NAdamW for every parameter (module docstring). Never modifies `p.grad`.

    Not for: torch's NAdam momentum schedule (`momentum_decay`); use torch.optim.NAdam."""

    def __init__(
        self,
        params,
        *,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.99, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        step = count_step(state, p, "exp_avg", "exp_avg_sq")
        nadamw_update(
            p, p.grad, state["exp_avg"], state["exp_avg_sq"], step=step, **group_hyper(group, "eps")
        )
