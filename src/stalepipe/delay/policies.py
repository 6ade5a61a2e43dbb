"""Delay policies: the one definition of gradient staleness (GUIDE section 2).

`staleness(policy, stage, step, num_stages, total_steps)` is a pure function that the emulator,
the pipeline runtime, the schedule generators, the timing simulator and the reports all call.
The gradient of step k is taken at the weights of stage s from step `max(k - tau_s(k), 0)`.

Policies (tau_s(k) outside sync windows):
    sync        0                     GPipe / 1F1B with a flush every step
    2bw         1                     PipeDream-2BW (Narayanan et al., ICML 2021)
    pipedream   P-1-s                 PipeDream (Narayanan et al., SOSP 2019): first stage stalest
    fixed:N     N                     uniform delay, for delay sweeps
    wpipe       1 for s < ceil(P/2)   WPipe (Yang et al., ICLR 2022): two stage groups; the first
                0 otherwise           group's next-cycle forwards run ahead of the current
                                      cycle's backwards (stale by one), the second group updates
                                      before its next forward (fresh). See docs/delay.md.

Sync windows (mitigations): tau = 0 for the first `sync_start` steps and the last
`sync_cooldown` steps (a count if >= 1, else a fraction of `total_steps`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from stalepipe.config import ConfigError

PolicyFn = Callable[[int, int], int]  # (stage, num_stages) -> tau outside sync windows


def _sync(stage: int, num_stages: int) -> int:
    return 0


def _2bw(stage: int, num_stages: int) -> int:
    return 1


def _pipedream(stage: int, num_stages: int) -> int:
    return num_stages - 1 - stage


def wpipe_group(stage: int, num_stages: int) -> int:
    """WPipe's group of `stage`: 0 for the first ceil(P/2) stages, 1 for the rest."""
    return 0 if stage < math.ceil(num_stages / 2) else 1


def _wpipe(stage: int, num_stages: int) -> int:
    return 1 if wpipe_group(stage, num_stages) == 0 else 0


DELAY_POLICIES: dict[str, PolicyFn] = {
    "sync": _sync,
    "2bw": _2bw,
    "pipedream": _pipedream,
    "wpipe": _wpipe,
}


def parse_policy(policy: str) -> PolicyFn:
    """The per-stage delay function of `policy` (a registry name or `fixed:N`)."""
    if policy.startswith("fixed:"):
        n = policy.split(":", 1)[1]
        if not n.isdigit():
            raise ConfigError(f"delay.policy fixed:N needs an integer N >= 0, got {policy!r}")
        delay = int(n)
        return lambda stage, num_stages: delay
    if policy not in DELAY_POLICIES:
        raise ConfigError(
            f"unknown delay policy {policy!r}; choose from {', '.join(DELAY_POLICIES)} or fixed:N"
        )
    return DELAY_POLICIES[policy]


def cooldown_steps(sync_cooldown: float, total_steps: int) -> int:
    """Number of final steps without delay: `sync_cooldown` itself if >= 1, else a fraction."""
    if sync_cooldown >= 1:
        return int(sync_cooldown)
    return int(round(sync_cooldown * total_steps))


def in_sync_window(
    step: int, total_steps: int, sync_start: int = 0, sync_cooldown: float = 0.0
) -> bool:
    """True when `step` lies in the synchronous start or the synchronous cooldown."""
    return step < sync_start or step >= total_steps - cooldown_steps(sync_cooldown, total_steps)


def staleness(
    policy: str,
    stage: int,
    step: int,
    num_stages: int,
    total_steps: int,
    sync_start: int = 0,
    sync_cooldown: float = 0.0,
) -> int:
    """tau_s(k): how many steps old the weights of `stage` are when step `step`'s gradient is
    computed. Pure; the version used is `max(step - tau, 0)` (see `version_used`)."""
    assert 0 <= stage < num_stages, (stage, num_stages)
    if in_sync_window(step, total_steps, sync_start, sync_cooldown):
        return 0
    return parse_policy(policy)(stage, num_stages)


def version_used(
    policy: str,
    stage: int,
    step: int,
    num_stages: int,
    total_steps: int,
    sync_start: int = 0,
    sync_cooldown: float = 0.0,
) -> int:
    """Index of the weight version (W_v, v = number of updates applied) that step `step`'s
    gradient sees on `stage`; clamped at 0 so the first steps of a delayed run see W_0."""
    tau = staleness(policy, stage, step, num_stages, total_steps, sync_start, sync_cooldown)
    return max(step - tau, 0)


def max_staleness(policy: str, num_stages: int) -> list[int]:
    """Per-stage largest tau outside sync windows: a stage keeps tau + 1 weight versions."""
    fn = parse_policy(policy)
    return [fn(s, num_stages) for s in range(num_stages)]
