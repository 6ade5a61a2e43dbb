"""The delay any PyTorch loop can wear: stalepipe's stable API (docs/api.md).

    from stalepipe.delay import DelayedOptimizer, split_stages

The names are those of `stalepipe.training.delay.__all__`, where they are implemented; users
import them from here, so the training wing's layout can change under them. Loaded on first
use, as there: importing this module loads no torch.
"""

from typing import TYPE_CHECKING, Any

from stalepipe.training import delay as _impl

if TYPE_CHECKING:  # what the names are, for type checkers (never run)
    from stalepipe.training.delay import (
        CORRECTORS,
        DELAY_POLICIES,
        CorrectorSpec,
        DelayConfig,
        DelayedOptimizer,
        DelayEmulator,
        DelaySchedule,
        Policy,
        StageSplit,
        StaleWeightsError,
        WrappedOptimizer,
        microbatch_seed,
        resolve_delay_config,
        split_stages,
        wpipe_group,
    )

# The same list as `stalepipe.training.delay.__all__` (tests/delay/test_public_api.py checks it),
# spelled out so that a type checker sees each name as exported.
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


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(_impl, name)
    raise AttributeError(f"module 'stalepipe.delay' has no attribute {name!r}")
