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

from stalepipe.delay.delayed_optimizer import DelayedOptimizer
from stalepipe.delay.emulator import DelayEmulator, microbatch_seed
from stalepipe.delay.mitigations import resolve_delay_config
from stalepipe.delay.policies import DELAY_POLICIES, DelaySchedule, Policy, wpipe_group

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
