"""Gradient-delay policies, mitigations and the single-process delay emulator.

- `policies`: tau_s(k) and `DelaySchedule`, the one definition of staleness (docs/design.md,
  'The delay contract');
- `mitigations`: error feedback, Taylor compensation, sync-window resolution (pure math);
- `correctors`: weight prediction, PipeMare's LR schedule, adaptive momentum (pure math) and
  the per-stage param groups they need;
- `DelayedOptimizer`: wraps any optimizer for a plain training loop;
- `DelayEmulator`: the engine the training loop drives (fast and exact modes);
- `reference`: a slow, obvious implementation the tests compare both against.
"""

from stalepipe.config.registry import DELAY_POLICIES
from stalepipe.delay.policies import DelaySchedule, Policy, wpipe_group
from stalepipe.lazy import lazy_getattr

# Loaded on first use (PEP 562): the package root imports `delay.policies` to register the
# policies (config/registry.py), and that must not import torch through this file.
_LAZY = {
    "DelayedOptimizer": "stalepipe.delay.delayed_optimizer",
    "DelayEmulator": "stalepipe.delay.emulator",
    "microbatch_seed": "stalepipe.delay.emulator",
    "resolve_delay_config": "stalepipe.delay.mitigations",
}


__getattr__ = lazy_getattr("stalepipe.delay", _LAZY)


__all__ = [
    "DELAY_POLICIES",
    "DelayEmulator",
    "DelaySchedule",
    "DelayedOptimizer",
    "Policy",
    "microbatch_seed",
    "resolve_delay_config",
    "wpipe_group",
]
