"""What the optimizer classes share: the step loop, lazily created state, group hyperparameters.

Each optimizer file keeps its math in a pure `*_update` function; its class only says how one
parameter's state and its group's hyperparameters feed that function (`_update`).
"""

from __future__ import annotations

from typing import Any

import torch


class ParamwiseOptimizer(torch.optim.Optimizer):
    """An optimizer whose step updates each parameter that has a gradient on its own, group by
    group: subclasses implement `_update(p, state, group)`. Never modifies `p.grad`.

    Not for optimizers that update several tensors in one call (torch's foreach / fused paths).
    """

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; `p.grad` is only read."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, self.state[p], group)
        return loss

    def _update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        raise NotImplementedError


def zero_state(state: dict, p: torch.Tensor, *buffers: str) -> dict:
    """`state`, given zero `buffers` shaped like `p` when it is empty (the first update)."""
    if not state:
        state.update({name: torch.zeros_like(p) for name in buffers})
    return state


def count_step(state: dict, p: torch.Tensor, *buffers: str) -> int:
    """Count one more update of `p` in `state["step"]` and return it (1-based, for bias
    correction); an empty `state` first gets `step` 0 and zero `buffers` shaped like `p`."""
    if not state:
        state["step"] = 0
        state.update({name: torch.zeros_like(p) for name in buffers})
    state["step"] += 1
    return state["step"]


def group_hyper(group: dict, *keys: str) -> dict[str, Any]:
    """A param group's `lr`, `weight_decay`, its `betas` as `beta1`, `beta2`, ... and `keys`,
    as keyword arguments of a pure `*_update` function."""
    hyper = {"lr": group["lr"], "weight_decay": group["weight_decay"]}
    hyper.update({f"beta{i}": b for i, b in enumerate(group.get("betas", ()), start=1)})
    hyper.update({key: group[key] for key in keys})
    return hyper
