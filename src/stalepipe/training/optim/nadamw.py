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

from stalepipe.training.optim.adamw import adamw_update
from stalepipe.training.optim.base import ParamwiseOptimizer, count_step, group_hyper


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
        adamw_update(
            p,
            p.grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            step=step,
            **group_hyper(group, "eps"),
            nesterov=True,
        )
