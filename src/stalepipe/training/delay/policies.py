"""Delay policies and the delay schedule: the one definition of gradient staleness
(docs/design.md, 'The delay contract').

A `Policy` says how stale each stage's weights are outside synchronous windows, as a pure
function of (stage, step, num_stages). A `DelaySchedule` is that policy bound, once, to a run:
the number of stages, the run length and the sync windows. It answers every question the
engines ask (tau, the version a stage reads, the versions still needed after a step, the
largest staleness, whether a step is synchronous); the emulator, the pipeline runtime, the
schedule generators, the timing simulator and the reports all take one instead of loose
arguments. The gradient of step k is taken at the weights of stage s from step
`max(k - tau_s(k), 0)` (so steps 0 and 1 of 2bw both see W_0).

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

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from stalepipe.config import ConfigError, DelayConfig, TrainConfig
from stalepipe.config.registry import DELAY_POLICIES

UNBOUNDED = 2**62  # total_steps of a run whose length is unknown (no cooldown then)


@dataclass(frozen=True)
class Policy:
    """A delay policy: `tau(stage, step, num_stages)` outside sync windows, and its bound
    `max_tau(stage, num_stages)` over all steps (how many versions a stage keeps, minus one).
    A policy may depend on the step; `max_tau` must bound it."""

    name: str
    tau: Callable[[int, int, int], int]
    max_tau: Callable[[int, int], int]
    stage_rule: Callable[[int], None] = lambda num_stages: None  # raises for a bad stage count
    # its schedule updates after every microbatch (PipeDream as published), not once a batch:
    # the cluster model charges a global batch m updates (`sim.parallel`)
    per_microbatch: bool = False


def _constant(name: str, fn: Callable[[int, int], int], **kw) -> Policy:
    return Policy(name, lambda s, k, P: fn(s, P), fn, **kw)


def wpipe_group(stage: int, num_stages: int) -> int:
    """WPipe's group of `stage` (a model partition): 0 for the first half, 1 for the second.

    WPipe (Yang et al., ICLR 2022) places two partitions on each of its P/2 workers, one per
    group; the reference code chains the workers twice (`g = g + g`) and calls position
    i < L // 2 group G0. Only an even number of partitions has that structure.
    """
    _wpipe_stages(num_stages)
    return 0 if stage < num_stages // 2 else 1


def _wpipe_stages(num_stages: int) -> None:
    if num_stages % 2:
        raise ConfigError(
            f"delay.policy wpipe needs an even pipeline.num_stages (WPipe splits the model into "
            f"two equal groups of partitions, two per worker), got {num_stages}"
        )


# The two names the rest of stalepipe may say: the synchronous baseline (what a record without
# a delay section ran) and the paper's asynchronous arm, PipeDream-2BW's one-step delay (the one
# its claims, the verdict and the map judge); anything else asks a policy what it does.
SYNC, PAPER_ASYNC = "sync", "2bw"

# The delay policies by name (`fixed:N` besides), registered for the config to validate against
# (config/registry.py); this module is torch-free for that reason.
DELAY_POLICIES.register(_constant(SYNC, lambda s, P: 0))
DELAY_POLICIES.register(_constant(PAPER_ASYNC, lambda s, P: 1))
DELAY_POLICIES.register(_constant("pipedream", lambda s, P: P - 1 - s, per_microbatch=True))
# G0 is double-buffered: W_{t+1} = W_t - lr * grad(W_{t-1}) on G0; G1 is always fresh.
DELAY_POLICIES.register(
    _constant("wpipe", lambda s, P: 1 if wpipe_group(s, P) == 0 else 0, stage_rule=_wpipe_stages)
)


_DEPTHS = (2, 4, 8)  # the pipeline depths a policy's properties are read at


def never_delays(policy: str) -> bool:
    """Whether `policy` never delays a gradient at any depth (sync, fixed:0): what a
    synchronous baseline is. Asked of the policy, so a registered one answers for itself."""
    p = parse_policy(policy)
    return all(p.max_tau(s, P) == 0 for P in _DEPTHS for s in range(P))


def same_delay_at_any_depth(policy: str) -> bool:
    """Whether `policy` delays every stage by one number at every depth (2bw, fixed:N): its runs
    at one P stand for any P; PipeDream's and WPipe's delays depend on the stage and P."""
    p = parse_policy(policy)
    return len({p.max_tau(s, P) for P in _DEPTHS for s in range(P)}) == 1


def parse_policy(policy: str) -> Policy:
    """The `Policy` named `policy` (a registry name or `fixed:N`)."""
    if policy.startswith("fixed:"):
        n = policy.split(":", 1)[1]
        if not n.isdigit():
            raise ConfigError(f"delay.policy fixed:N needs an integer N >= 0, got {policy!r}")
        delay = int(n)
        return _constant(policy, lambda s, P: delay)
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


@dataclass(frozen=True)
class DelaySchedule:
    """`policy` bound to a run of `total_steps` steps on `num_stages` stages, with its sync
    windows: the first `sync_start` steps and the last `sync_cooldown` steps (a count if >= 1,
    else a fraction of the run) have tau = 0. Built once, by `DelaySchedule.build` (the one
    constructor: from a `DelayConfig` or a policy name); every engine and report asks it.

    Not for: a run whose length is unknown and has a cooldown (`total_steps=None` refuses one).
    """

    policy: str
    num_stages: int
    total_steps: int = UNBOUNDED
    sync_start: int = 0
    sync_cooldown: float = 0.0
    # Derived in __post_init__: the parsed policy, the cooldown's length, the per-stage bound.
    _policy: Policy = field(init=False, repr=False, compare=False)
    cooldown: int = field(init=False, compare=False)
    max_tau: tuple[int, ...] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ConfigError(f"pipeline.num_stages must be >= 1, got {self.num_stages}")
        if self.total_steps < 1:
            raise ConfigError(f"train.num_steps must be >= 1, got {self.total_steps}")
        if self.sync_start < 0:
            raise ConfigError(f"delay.sync_start must be >= 0, got {self.sync_start}")
        if self.total_steps == UNBOUNDED and self.sync_cooldown:
            raise ConfigError("delay.sync_cooldown needs total_steps (the run length)")
        pol = parse_policy(self.policy)
        pol.stage_rule(self.num_stages)
        set_ = object.__setattr__  # frozen: derived fields are set once, here
        set_(self, "_policy", pol)
        set_(self, "cooldown", cooldown_steps(self.sync_cooldown, self.total_steps))
        set_(self, "max_tau", tuple(pol.max_tau(s, self.num_stages) for s in self.stages))

    @classmethod
    def build(
        cls,
        delay: DelayConfig | str,
        num_stages: int,
        total_steps: int | None = None,
        *,
        train: TrainConfig | None = None,
    ) -> DelaySchedule:
        """The one way to make a delay schedule: the policy and sync windows of `delay` (a
        `DelayConfig`, or a bare policy name: no windows) on `num_stages` stages over
        `total_steps` steps (None: a run of unknown length, which allows no cooldown). A
        cooldown aligned with WSD's decay (`delay.sync_cooldown_wsd`) needs `train` (the
        `TrainConfig` whose decay phase it is)."""
        steps = UNBOUNDED if total_steps is None else total_steps
        if isinstance(delay, str):
            return cls(delay, num_stages, steps)
        if delay.sync_cooldown_wsd:
            if train is None:
                raise ConfigError(
                    "delay.sync_cooldown_wsd needs the train config (its WSD decay phase) to "
                    "resolve the cooldown: pass train=... (to DelayedOptimizer: "
                    "delay=DelaySchedule.build(delay_cfg, num_stages, steps, train=train_cfg))"
                )
            # here, not at the top: mitigations loads torch, and the package root imports
            # this module (it must stay torch-free, config/registry.py)
            from stalepipe.training.delay.mitigations import resolve_delay_config

            delay = resolve_delay_config(delay, train)
        return cls(
            delay.policy, num_stages, steps, int(delay.sync_start), float(delay.sync_cooldown)
        )

    def with_total_steps(self, total_steps: int) -> DelaySchedule:
        """The same policy and windows over `total_steps` steps (a fractional cooldown scales)."""
        return dataclasses.replace(self, total_steps=total_steps)

    @property
    def stages(self) -> range:
        return range(self.num_stages)

    @property
    def delayed(self) -> bool:
        """Whether some stage is ever stale (False: the run is synchronous throughout)."""
        return max(self.max_tau) > 0

    @property
    def uniform(self) -> bool:
        """Whether every stage has the same staleness (sync, 2bw, fixed:N): the trajectory
        then does not depend on where the stages are cut."""
        return len(set(self.max_tau)) == 1

    def in_sync_window(self, step: int) -> bool:
        """True when `step` lies in the synchronous start or the synchronous cooldown (a
        cooldown runs on past the end; without one, steps past the end are delayed)."""
        return step < self.sync_start or (
            self.cooldown > 0 and step >= self.total_steps - self.cooldown
        )

    def tau(self, stage: int, step: int) -> int:
        """tau_s(k): how many steps old the weights of `stage` are when step `step`'s
        gradient is computed."""
        assert 0 <= stage < self.num_stages, (stage, self.num_stages)
        if self.in_sync_window(step):
            return 0
        return self._policy.tau(stage, step, self.num_stages)

    def taus(self, step: int) -> list[int]:
        """tau_s(step) for every stage."""
        if self.in_sync_window(step):
            return [0] * self.num_stages
        return [self._policy.tau(s, step, self.num_stages) for s in self.stages]

    def version(self, stage: int, step: int) -> int:
        """The weight version (W_v, v = updates applied) step `step`'s gradient sees on
        `stage`: max(step - tau, 0), so the first steps of a delayed run see W_0."""
        return max(step - self.tau(stage, step), 0)

    def versions(self, step: int) -> list[int]:
        """`version(s, step)` for every stage."""
        return [max(step - t, 0) for t in self.taus(step)]

    def versions_needed_after(
        self, stages: Iterable[int], step: int, predict: bool = False
    ) -> set[int]:
        """Past versions (v <= `step`) that some later step j > `step` reads on any of `stages`
        (with `predict`, weight prediction's W_{v-1} beside every stale W_v read, v >= 1).

        After update `step` the newest weights are W_{step+1}; a version is worth keeping only
        if a future gradient is computed at it. Steps beyond step + max tau read W_{step+1} or
        newer, so the set has at most max tau elements: a stage keeps at most tau + 1 versions
        in all, and none inside sync windows that no delayed step follows.

        Steps past the end of the run count too (as delayed steps, unless a cooldown runs to
        the end): the final checkpoint keeps what a longer run would read, so it can be
        extended (`rundir.resume`).
        """
        stages = list(stages)
        depth = max((self.max_tau[s] for s in stages), default=0)
        needed = set()
        for j in range(step + 1, step + depth + 1 + int(predict and depth > 0)):
            for s in stages:
                tau = self.tau(s, j)
                v = max(j - tau, 0)
                if v <= step:
                    needed.add(v)
                if predict and tau > 0 and 1 <= v <= step + 1:
                    needed.add(v - 1)
        return needed

    def versions_held_at(self, stages: Iterable[int], step: int, predict: bool = False) -> set[int]:
        """The stored versions a state at the start of `step` holds for `stages` (those steps
        >= `step` still read): what a checkpoint at `step` must carry."""
        return set() if step == 0 else self.versions_needed_after(stages, step - 1, predict)
