"""Token overhead at sync's final loss, the target a user means by "matches sync"
(docs/design.md, 'What we report'). Pure functions on curves, no I/O.

Per seed, with S the synchronous run's val curve (tokens, loss) and D_1, D_2, ... the delayed
arm's runs of that seed at each planned length (1x, and longer runs of the same configuration
where a sweep planned them: `stalepipe sweep length`, or any run equal but for its number of
steps):

- **targets**: `final` = S's final val loss; `99%` / `95%` / `90%` = S's first eval loss minus
  that share of S's drop from its first to its final eval. A target S reaches inside warmup is
  not used (every arm's multiplier is about 1 there): it reads "in warmup".
- `T_S(L)`: the tokens at which S first reaches L (`overhead.tokens_to_reach`, interpolated
  between evals). `T_D(L)`: the fewest tokens at which any of the delayed runs of that seed
  first reaches L: a longer planned run counts as the budget it took (the run a team would
  plan), never extrapolated.
- **multiplier** = T_D(L) / T_S(L); a seed whose delayed runs never reach L is "> x", with x
  the longest run's tokens over T_S(L): a lower bound, not a number.
- Over seeds (paired): the geometric mean and a Student-t interval on the logarithms when every
  seed reached the target; otherwise the status names how many did not and the bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stalepipe.analysis.overhead import Curve, log_t_interval, tokens_to_reach

SHARES = (("99%", 0.99), ("95%", 0.95), ("90%", 0.90))
TARGET_NAMES = ("final", *(name for name, _ in SHARES))


def target_losses(sync: Curve) -> dict[str, float]:
    """The targets of one synchronous curve: its final loss and the shares of its drop."""
    if len(sync) < 2:
        return {}
    first, final = sync[0][1], sync[-1][1]
    out = {"final": final}
    for name, share in SHARES:
        out[name] = first - share * (first - final)
    return out


@dataclass(frozen=True)
class SeedTarget:
    """One seed at one target."""

    seed: int
    target: float
    tokens_sync: float
    tokens_delayed: float  # nan: none of the delayed runs got there
    bound: float  # the longest delayed run's tokens / tokens_sync (a lower bound if not reached)
    in_warmup: bool

    @property
    def multiplier(self) -> float:
        return self.tokens_delayed / self.tokens_sync


def seed_target(
    seed: int, sync: Curve, delayed: Sequence[Curve], target: float, warmup_tokens: float
) -> SeedTarget:
    """`target` for one seed: sync's tokens to it, the delayed runs' fewest (module doc)."""
    t_sync = tokens_to_reach(sync, target)
    reached = [t for c in delayed if math.isfinite(t := tokens_to_reach(c, target))]
    longest = max((c[-1][0] for c in delayed if c), default=math.nan)
    return SeedTarget(
        seed=seed,
        target=target,
        tokens_sync=t_sync,
        tokens_delayed=min(reached, default=math.nan),
        bound=longest / t_sync,
        in_warmup=t_sync <= warmup_tokens,
    )


@dataclass(frozen=True)
class TargetOverhead:
    """One target over seeds."""

    name: str
    seeds: tuple[SeedTarget, ...]

    @property
    def in_warmup(self) -> bool:
        return any(s.in_warmup for s in self.seeds)

    @property
    def missed(self) -> int:
        return sum(not math.isfinite(s.tokens_delayed) for s in self.seeds)

    def interval(self) -> tuple[float, float, float]:
        """(geometric mean, low, high) of the multipliers; nan unless every seed reached it."""
        if not self.seeds or self.missed or self.in_warmup:
            return math.nan, math.nan, math.nan
        return log_t_interval([s.multiplier for s in self.seeds])

    @property
    def bound(self) -> float:
        """The smallest multiple of sync's tokens a short seed was still short at (nan when
        every seed got there): a lower bound for that seed's multiplier."""
        short = [s.bound for s in self.seeds if not math.isfinite(s.tokens_delayed)]
        return min(short, default=math.nan)

    def describe(self) -> str:
        """'1.18x [1.12, 1.25]', '> 2.00x (5/5 seeds short)', '> 2.00x (1/5 seeds short;
        1.05x where reached)', 'in warmup', or '-'."""
        if not self.seeds:
            return "-"
        if self.in_warmup:
            return "in warmup"
        if self.missed:
            reached = [s.multiplier for s in self.seeds if math.isfinite(s.tokens_delayed)]
            where = f"; {log_t_interval(reached)[0]:.2f}x where reached" if reached else ""
            return f"> {self.bound:.2f}x ({self.missed}/{len(self.seeds)} seeds short{where})"
        est, low, high = self.interval()
        ci = f" [{low:.2f}, {high:.2f}]" if math.isfinite(low) else ""
        return f"{est:.2f}x{ci}"


def target_overheads(
    sync: Mapping[int, Curve], delayed: Mapping[int, Sequence[Curve]], warmup_tokens: float
) -> dict[str, TargetOverhead]:
    """Every target of `TARGET_NAMES` for a delayed arm against its sync arm, paired by seed
    (seeds on one side only are left out). `delayed` maps a seed to its runs at every planned
    length; `warmup_tokens` is sync's warmup in tokens."""
    seeds = sorted(s for s in sync.keys() & delayed.keys() if delayed[s])
    out = {}
    for name in TARGET_NAMES:
        per_seed = []
        for s in seeds:
            targets = target_losses(sync[s])
            if name in targets:
                per_seed.append(seed_target(s, sync[s], delayed[s], targets[name], warmup_tokens))
        out[name] = TargetOverhead(name, tuple(per_seed))
    return out
