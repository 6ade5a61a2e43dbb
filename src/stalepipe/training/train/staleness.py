"""Staleness measured in a run (issue 51, item 4; `log.staleness`): per pipeline stage, the
relative size of the update just applied, `|W_k+1 - W_k| / |W_k+1|`, and the cosine between the
gradient this update applied and the one before it. A one-step delay hurts where the update
is large against the weights and consecutive gradients disagree (a low cosine): these are the
numbers a GPU user can measure in a short run at 135M-360M and set beside the ladder's.

Measured only at log steps (`StepPlan.logs`), so the cost is two extra copies of the stage's
weights and gradients at those steps and none elsewhere: the gradient of the step before a log
step is kept, the weights before the log step's update are kept, and both are compared after
it. Nothing it does touches the weights, the gradients or the optimizer: a run with it equals
one without, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Params = Sequence[torch.nn.Parameter]


def _flat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in ts]) if ts else torch.zeros(1)


class StalenessProbe:
    """The per-stage metrics of one run; `stages` the parameters of each pipeline stage."""

    def __init__(self, stages: Sequence[Params]) -> None:
        self.stages = [list(p) for p in stages]
        self._grads: list[torch.Tensor] | None = None  # the previous step's, when kept
        self._grads_next: list[torch.Tensor] | None = None
        self._weights: list[torch.Tensor] | None = None
        self._now: list[torch.Tensor] = []

    def before_update(self, step: int, logs: bool, logs_next: bool) -> None:
        """Called after the gradients of `step` are final, before its update: keeps what the
        log step's comparison needs."""
        if not (logs or logs_next):
            self._grads_next = None
            return
        grads = [_flat([p.grad for p in ps if p.grad is not None]) for ps in self.stages]
        if logs:
            self._weights = [_flat(ps) for ps in self.stages]
            self._now = grads
        self._grads_next = grads if logs_next else None

    def after_update(self, step: int, logs: bool) -> dict[str, float]:
        """The metrics of a log step (after its update), `{}` elsewhere."""
        out: dict[str, float] = {}
        if logs and self._weights is not None:
            for s, ps in enumerate(self.stages):
                after = _flat(ps)
                out[f"update_rel/s{s}"] = float((after - self._weights[s]).norm() / after.norm())
                prev = self._grads[s] if self._grads is not None else None
                out[f"grad_cos/s{s}"] = _cosine(self._now[s], prev)
        self._grads, self._weights = self._grads_next, None
        return out


def _cosine(a: torch.Tensor, b: torch.Tensor | None) -> float:
    if b is None or a.numel() != b.numel():
        return math.nan
    den = float(a.norm() * b.norm())
    return float(a @ b) / den if den > 0 else math.nan
