"""AdamW (Loshchilov & Hutter, ICLR 2019, arXiv 1711.05101), as a pure update.

The stand-alone `adamw` optimizer is `torch.optim.AdamW` (see `registry.py`); this function is the
AdamW part of the composite optimizers (Muon, MARS), which must live inside one optimizer object.
It follows torch's formulation (decoupled decay `p <- p (1 - lr wd)` first, then the bias-corrected
Adam step) so the AdamW parts of all optimizers mean the same thing.
"""

from __future__ import annotations

import math

import torch

from stalepipe.training.optim.base import ParamwiseOptimizer, count_step, group_hyper


@torch.no_grad()
def adamw_update(
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
    nesterov: bool = False,
) -> None:
    """One AdamW step on `p`, in place on `p`, `exp_avg`, `exp_avg_sq`; `grad` is only read.

    `step` is the 1-based index of this update (for bias correction). `nesterov=True` is NAdamW
    (Dozat's look-ahead; optim/nadamw.py has the rule).
    """
    p.mul_(1.0 - lr * weight_decay)  # decoupled weight decay (Alg. 2, line 12)
    exp_avg.lerp_(grad, 1.0 - beta1)  # m_t = b1 m + (1 - b1) g
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)  # v_t = b2 v + (1 - b2) g^2
    bias1 = 1.0 - beta1**step
    bias2 = 1.0 - beta2**step
    if nesterov:
        denom = exp_avg_sq.div(bias2).sqrt_().add_(eps)
        # Dozat (2016), Alg. 2: the gradient's share at b1^t, the momentum's one step ahead
        p.addcdiv_(grad, denom, value=-lr * (1.0 - beta1) / bias1)
        p.addcdiv_(exp_avg, denom, value=-lr * beta1 / (1.0 - beta1 ** (step + 1)))
        return
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / bias1)  # p -= lr m_hat / (sqrt(v_hat) + eps)


def adamw_step(p: torch.Tensor, state: dict, group: dict) -> None:
    """`adamw_update` of `p` with the hyperparameters of a composite's AdamW `group`
    (`lr, betas, eps, weight_decay`); `state` is created on the first call."""
    step = count_step(state, p, "exp_avg", "exp_avg_sq")
    adamw_update(
        p, p.grad, state["exp_avg"], state["exp_avg_sq"], step=step, **group_hyper(group, "eps")
    )


class CompositeOptimizer(ParamwiseOptimizer):
    """An optimizer whose groups run either its own algorithm (`algo == self.algo`) or AdamW
    (`algo == 'adamw'`: embeddings, head, norms), as Muon and MARS are used for LLMs. One
    object, one state dict. Subclasses implement `_algo_update`; `p.grad` is only read."""

    algo: str

    def __init__(self, param_groups: list[dict]) -> None:
        super().__init__(param_groups, defaults={})
        for group in self.param_groups:
            assert group.get("algo") in (self.algo, "adamw"), group.get("algo")

    def _update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        if group["algo"] == "adamw":
            adamw_step(p, state, group)
        else:
            self._algo_update(p, state, group)

    def _algo_update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        raise NotImplementedError
