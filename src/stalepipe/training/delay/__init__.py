"""Gradient-delay policies, mitigations and the single-process delay emulator.

- `policies`: tau_s(k) and `DelaySchedule`, the one definition of staleness (docs/design.md,
  'The delay contract');
- `mitigations`: error feedback, Taylor compensation, sync-window resolution (pure math);
- `correctors`: weight prediction, PipeMare's LR schedule, adaptive momentum (pure math) and
  the per-stage param groups they need;
- `DelayedOptimizer`: wraps any optimizer for a plain training loop (a `torch.optim.Optimizer`);
- `split_stages`: any `nn.Module` into pipeline stages for it (`StageSplit`);
- `DelayEmulator`: the engine the training loop drives (fast and exact modes);
- `reference`: a slow, obvious implementation the tests compare both against.
"""

from typing import TYPE_CHECKING

from stalepipe.config.delay import DelayConfig
from stalepipe.config.registry import CORRECTORS, DELAY_POLICIES, CorrectorSpec
from stalepipe.lazy import lazy_getattr
from stalepipe.training.delay.policies import DelaySchedule, Policy, wpipe_group

if TYPE_CHECKING:  # what the lazy names below are, for type checkers (never run)
    from stalepipe.training.delay.delayed_optimizer import DelayedOptimizer
    from stalepipe.training.delay.emulator import DelayEmulator, microbatch_seed
    from stalepipe.training.delay.guard import StaleWeightsError
    from stalepipe.training.delay.mitigations import resolve_delay_config
    from stalepipe.training.delay.stages import StageSplit, split_stages
    from stalepipe.training.delay.wrapped import WrappedOptimizer

# Loaded on first use (PEP 562): the package root imports `delay.policies` to register the
# policies (config/registry.py), and that must not import torch through this file.
_LAZY = {
    "DelayedOptimizer": "stalepipe.training.delay.delayed_optimizer",
    "DelayEmulator": "stalepipe.training.delay.emulator",
    "microbatch_seed": "stalepipe.training.delay.emulator",
    "resolve_delay_config": "stalepipe.training.delay.mitigations",
    "StageSplit": "stalepipe.training.delay.stages",
    "split_stages": "stalepipe.training.delay.stages",
    "StaleWeightsError": "stalepipe.training.delay.guard",
    "WrappedOptimizer": "stalepipe.training.delay.wrapped",
}


__getattr__ = lazy_getattr("stalepipe.training.delay", _LAZY)


# The public API (docs/api.md: what is stable); everything else in the package is internal.
__all__ = [
    "CORRECTORS",
    "DELAY_POLICIES",
    "CorrectorSpec",
    "DelayConfig",
    "DelayEmulator",
    "DelaySchedule",
    "DelayedOptimizer",
    "Policy",
    "StageSplit",
    "StaleWeightsError",
    "WrappedOptimizer",
    "microbatch_seed",
    "resolve_delay_config",
    "split_stages",
    "wpipe_group",
]
