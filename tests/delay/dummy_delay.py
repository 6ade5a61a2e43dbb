"""A delay policy and a corrector in one test module, registered when it is imported: what adding
each takes outside the package (docs/design.md, 'Recipes'). `test_registering.py` finds both in
the config, `stalepipe train --help`, a sweep grid and a report, with no other file changed.

- policy 'alternate': every other step is stale by one, tau_s(k) = k mod 2 on every stage;
- corrector 'stale_scale': a staleness-aware step (Zhang et al., IJCAI 2016, "Staleness-aware
  async-SGD", divide the learning rate by the staleness), here on the stale gradient:
  g <- g / (1 + c tau_s), c = `delay.stale_scale` (0 = off).

Torch-free like every spec: the corrector works on the tensors it is given.
"""

from __future__ import annotations

from stalepipe.config import CORRECTORS, DELAY_POLICIES, CorrectorSpec, Setting
from stalepipe.training.delay import Policy


def alternate_tau(stage: int, step: int, num_stages: int) -> int:
    """Stale by one on odd steps, fresh on even ones."""
    return step % 2


POLICY = DELAY_POLICIES.register(Policy("alternate", alternate_tau, lambda stage, P: 1))


def scale_stale_gradients(cfg, params, taus, step) -> None:
    """g <- g / (1 + c tau_s) on every stage whose gradient is stale, in place."""
    for stage_params, tau in zip(params, taus, strict=True):
        for p in stage_params:
            if tau and p.grad is not None:
                p.grad.div_(1 + cfg.stale_scale * tau)


STALE_SCALE = Setting(
    name="stale_scale",
    type=float,
    default=0.0,
    help="staleness-aware gradient scale c: g / (1 + c tau_s) (0 = off)",
    ok=lambda v: v >= 0,
    allowed=">= 0",
)
CORRECTOR = CORRECTORS.register(
    CorrectorSpec(
        name="stale_scale", settings=(STALE_SCALE,), phase="gradient", apply=scale_stale_gradients
    )
)
