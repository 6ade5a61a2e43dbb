"""Token overhead at sync's final loss, the target a user means by "matches sync"
(docs/design.md, 'What we report'). Pure functions on curves, no I/O.

Per seed, with S the synchronous run's val curve (tokens, loss) and D_1, D_2, ... the delayed
arm's runs of that seed at each planned length (1x, and longer runs of the same configuration
where a sweep planned them: `stalepipe sweep length`, or any run equal but for its number of
steps):

- **targets**: `final` = S's final val loss; `99%` / `95%` / `90%` = S's first eval loss minus
  that share of S's drop from its first to its final eval. A target S reaches inside warmup is
  not used (every arm's multiplier is about 1 there): it reads "in warmup".
- **At sync's final loss** (the verdict's target; issue 40) only complete runs are read: T_S
  is S's planned tokens, and T_D the tokens at which the delayed arm's *final* loss, as a
  function of its planned length, crosses L: the runs of the seed sorted by length (each with
  its own complete schedule: `stalepipe sweep --lengths` / `--extend`), the first whose final
  loss is at or below L, interpolated linearly in loss against log tokens from the run before
  it (`final_crossing`). The shortest run already at or below L gives its own length (an upper
  bound: no shorter run says how much sooner). No curve is read mid-schedule, where a longer
  run's LR has not decayed yet, and no run is picked as the best of several.
- **At the shares of the drop**: `T_S(L)`, the tokens at which S first reaches L
  (`overhead.tokens_to_reach`, interpolated between evals; S reaches those mid-run by
  definition), and T_D(L) the fewest tokens at which any delayed run of that seed first
  reaches L, never extrapolated.
- **multiplier** = T_D(L) / T_S(L); a seed whose delayed runs never reach L is "> x", with x
  the longest run's tokens over T_S(L): a lower bound, not a number.
- Over seeds (paired): the geometric mean and a Student-t interval on the logarithms when every
  seed reached the target; otherwise the status names how many did not and the bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stalepipe.lab.analysis.overhead import Curve, log_t_interval, tokens_to_reach
from stalepipe.lab.analysis.stats import t_interval

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


def final_crossing(runs: Sequence[Curve], target: float) -> float:
    """The tokens at which the delayed arm's final loss crosses `target`, from its complete
    runs (each curve's last point: its planned tokens and final loss), sorted by length: the
    first at or below the target, interpolated in log tokens from the one before; nan when
    none gets there (module docstring)."""
    ends = sorted((c[-1][0], c[-1][1]) for c in runs if c)
    for i, (tokens, loss) in enumerate(ends):
        if loss <= target:
            if i == 0:
                return tokens
            t0, l0 = ends[i - 1]
            frac = (l0 - target) / (l0 - loss)
            return math.exp(math.log(t0) + frac * (math.log(tokens) - math.log(t0)))
    return math.nan


def final_target(seed: int, sync: Curve, delayed: Sequence[Curve], warmup_tokens: float):
    """Sync's final loss for one seed, from complete runs only (`final_crossing`)."""
    t_sync, target = sync[-1][0], sync[-1][1]
    longest = max((c[-1][0] for c in delayed if c), default=math.nan)
    return SeedTarget(
        seed=seed,
        target=target,
        tokens_sync=t_sync,
        tokens_delayed=final_crossing(delayed, target),
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
            if name == "final" and name in targets:
                per_seed.append(final_target(s, sync[s], delayed[s], warmup_tokens))
            elif name in targets:
                per_seed.append(seed_target(s, sync[s], delayed[s], targets[name], warmup_tokens))
        out[name] = TargetOverhead(name, tuple(per_seed))
    return out


def sync_slope(finals: Mapping[float, float]) -> float:
    """Sync's final slope `s = -dL / d ln(tokens)` from its complete runs: least squares of the
    final loss on ln(planned length) over the lengths given (x the 1x tokens); with 1x and 1.2x
    alone, `(L_1x - L_1.2x) / ln 1.2`; nan with fewer than two lengths."""
    xs = [math.log(f) for f in sorted(finals)]
    if len(xs) < 2:
        return math.nan
    ys = [finals[f] for f in sorted(finals)]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return -sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def implied_overhead(slope: float, gap: float) -> float:
    """The token overhead the equal-token gap implies if the delayed curve is sync's shifted
    along ln(tokens): `gap = s ln o`, s sync's final slope (`sync_slope`); nan where sync did
    not improve with length."""
    return math.exp(gap / slope) if slope > 0 else math.nan


@dataclass(frozen=True)
class Relation:
    """`gap = s ln o` for one configuration: the overhead implied by the gap and sync's slope
    (the mean over seeds) beside the measured one (mean and 95 % t-interval over the same
    seeds). It holds where the implied overhead lies inside the measured one's interval."""

    label: str
    implied: float
    measured: float
    lo: float
    hi: float
    seeds: int

    @property
    def holds(self) -> bool:
        return self.lo <= self.implied <= self.hi

    def describe(self) -> str:
        verdict = "holds" if self.holds else "fails"
        return (
            f"implied {self.implied:.3f}, measured {self.measured:.3f} [{self.lo:.3f}, "
            f"{self.hi:.3f}] ({self.seeds} seeds): {verdict}"
        )


def relate(label: str, implied: Sequence[float], measured: Sequence[float]) -> Relation | None:
    """The relation over the seeds that have both numbers (None below 2 such seeds)."""
    pairs = [(i, m) for i, m in zip(implied, measured, strict=True) if math.isfinite(i + m)]
    if len(pairs) < 2:
        return None
    mean, lo, hi = t_interval([m for _, m in pairs])
    implied_mean = sum(i for i, _ in pairs) / len(pairs)
    return Relation(label, implied_mean, mean, lo, hi, len(pairs))
