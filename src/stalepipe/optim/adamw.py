"""AdamW (Loshchilov & Hutter, ICLR 2019, arXiv 1711.05101), as a pure update.

The stand-alone `adamw` optimizer is `torch.optim.AdamW` (see `registry.py`); this function is the
AdamW part of the composite optimizers (Muon, MARS), which must live inside one optimizer object.
It follows torch's formulation (decoupled decay `p <- p (1 - lr wd)` first, then the bias-corrected
Adam step) so the AdamW parts of all optimizers mean the same thing.
"""

from __future__ import annotations

import math

import torch


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
) -> None:
    """One AdamW step on `p`, in place on `p`, `exp_avg`, `exp_avg_sq`; `grad` is only read.

    `step` is the 1-based index of this update (for bias correction).
    """
    p.mul_(1.0 - lr * weight_decay)  # decoupled weight decay (Alg. 2, line 12)
    exp_avg.lerp_(grad, 1.0 - beta1)  # m_t = b1 m + (1 - b1) g
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)  # v_t = b2 v + (1 - b2) g^2
    bias1 = 1.0 - beta1**step
    bias2 = 1.0 - beta2**step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / bias1)  # p -= lr m_hat / (sqrt(v_hat) + eps)


def adamw_state(p: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """Fresh AdamW state for `p`."""
    return {
        "step": 0,
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }


def adamw_group_step(group: dict, state: dict) -> None:
    """Apply `adamw_update` to every parameter with a gradient in a composite's AdamW `group`.

    `state` is the optimizer's per-parameter state mapping.
    """
    beta1, beta2 = group["betas"]
    for p in group["params"]:
        if p.grad is None:
            continue
        st = state[p]
        if not st:
            st.update(adamw_state(p))
        st["step"] += 1
        adamw_update(
            p,
            p.grad,
            st["exp_avg"],
            st["exp_avg_sq"],
            step=st["step"],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )


class CompositeOptimizer(torch.optim.Optimizer):
    """An optimizer whose groups run either its own algorithm (`algo == self.algo`) or AdamW
    (`algo == 'adamw'`: embeddings, head, norms), as Muon and MARS are used for LLMs. One
    object, one state dict. Subclasses implement `_step_group`; `p.grad` is only read."""

    algo: str

    def __init__(self, param_groups: list[dict]) -> None:
        super().__init__(param_groups, defaults={})
        for group in self.param_groups:
            assert group.get("algo") in (self.algo, "adamw"), group.get("algo")

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; `p.grad` is only read."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algo"] == "adamw":
                adamw_group_step(group, self.state)
            else:
                self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        raise NotImplementedError
