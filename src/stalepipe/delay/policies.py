"""Delay policies: the one definition of gradient staleness (GUIDE section 2).

`staleness(policy, stage, step, num_stages, total_steps)` is a pure function that the emulator,
the pipeline runtime, the schedule generators, the timing simulator and the reports all call.
The gradient of step k is taken at the weights of stage s from step `max(k - tau_s(k), 0)`.

Policies (tau_s(k) outside sync windows):
    sync        0                     GPipe / 1F1B with a flush every step
    2bw         1                     PipeDream-2BW (Narayanan et al., ICML 2021)
    pipedream   P-1-s                 PipeDream (Narayanan et al., SOSP 2019): first stage stalest
    fixed:N     N                     uniform delay, for delay sweeps
    wpipe       1 for s < P/2         WPipe (Yang et al., ICLR 2022): the model is cut into P
                0 for s >= P/2        partitions forming two groups, G0 = the first half and
                                      G1 = the second half, interleaved on P/2 workers. G0 is
                                      double-buffered (stale by one update), G1 updates before
                                      its next forward (fresh). P must be even. See docs/delay.md.

Sync windows (mitigations): tau = 0 for the first `sync_start` steps and the last
`sync_cooldown` steps (a count if >= 1, else a fraction of `total_steps`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from stalepipe.config import ConfigError

PolicyFn = Callable[[int, int], int]  # (stage, num_stages) -> tau outside sync windows


def _sync(stage: int, num_stages: int) -> int:
    return 0


def _2bw(stage: int, num_stages: int) -> int:
    return 1


def _pipedream(stage: int, num_stages: int) -> int:
    return num_stages - 1 - stage


def wpipe_group(stage: int, num_stages: int) -> int:
    """WPipe's group of `stage` (a model partition): 0 for the first half, 1 for the second.

    WPipe (Yang et al., ICLR 2022) places two partitions on each of its P/2 workers, one per
    group; the reference code chains the workers twice (`g = g + g`) and calls position
    i < L // 2 group G0. Only an even number of partitions has that structure.
    """
    if num_stages % 2:
        raise ConfigError(
            f"delay.policy wpipe needs an even pipeline.num_stages (WPipe splits the model into "
            f"two equal groups of partitions, two per worker), got {num_stages}"
        )
    return 0 if stage < num_stages // 2 else 1


def _wpipe(stage: int, num_stages: int) -> int:
    # G0 is double-buffered: W_{t+1} = W_t - lr * grad(W_{t-1}) on G0; G1 is always fresh.
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
    if sync_cooldown < 0:
        raise ConfigError(f"delay.sync_cooldown must be >= 0, got {sync_cooldown}")
    if sync_cooldown >= 1:
        return int(sync_cooldown)
    return int(round(sync_cooldown * total_steps))


def in_sync_window(
    step: int, total_steps: int, sync_start: int = 0, sync_cooldown: float = 0.0
) -> bool:
    """True when `step` lies in the synchronous start or the synchronous cooldown."""
    if sync_start < 0:
        raise ConfigError(f"delay.sync_start must be >= 0, got {sync_start}")
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
    fn = parse_policy(policy)  # validates the policy even inside a sync window
    tau = fn(stage, num_stages)
    if in_sync_window(step, total_steps, sync_start, sync_cooldown):
        return 0
    return tau


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


def versions_needed_after(
    policy: str,
    stages: Iterable[int],
    step: int,
    num_stages: int,
    total_steps: int,
    sync_start: int = 0,
    sync_cooldown: float = 0.0,
) -> set[int]:
    """Past versions (v <= `step`) that some later step j > `step` reads on any of `stages`.

    After update `step` the newest weights are W_{step+1}; a version is worth keeping only if a
    future gradient is computed at it. Steps beyond step + max tau read W_{step+1} or newer, so
    the set has at most max tau elements: a stage keeps at most tau + 1 versions in all, and
    none inside sync windows that no delayed step follows.
    """
    stages = list(stages)
    depth = max((max_staleness(policy, num_stages)[s] for s in stages), default=0)
    needed = set()
    for j in range(step + 1, min(step + depth, total_steps - 1) + 1):
        for s in stages:
            v = version_used(policy, s, j, num_stages, total_steps, sync_start, sync_cooldown)
            if v <= step:
                needed.add(v)
    return needed
