"""Token overhead at a target loss: how many more tokens a delayed run needs to reach the losses
its synchronous reference reaches (docs/design.md, 'What we report'). Pure functions, no I/O.

Definitions (docs/verdict.md has the why):

- A *curve* is a run's validation loss against training tokens: the eval points of
  metrics.jsonl, tokens = (step + 1) x train.batch_size x data.seq_len. **No smoothing** by
  default (the val loss is measured on the same held-out batches at every eval, so its only
  noise is the trajectory's); `ema_halflife` > 0 applies an exponential moving average with
  that half-life in eval points before anything else, for noisy curves.
- `T(L)`, the tokens to reach target L: the first eval point whose loss is <= L, linearly
  interpolated (in tokens) with the point before it; nan when the curve never gets there.
- The *band* of targets of a (sync, delayed) pair, with `drop` = S_first - S_final (how far
  the sync curve falls from its first eval to its final eval):
  top = min(S_first, D_first) - plateau_frac x drop (both runs have left their initial
  plateau: each is at least plateau_frac of sync's drop below its first eval, so neither T is
  cut off at the first eval), bottom = S_final + margin_frac x drop (the sync final loss plus
  a margin). `num_targets` levels, evenly spaced in loss from top to bottom inclusive; no band
  when top <= bottom (sync barely learns, or the delayed run starts below the bottom).
- Per target, the multiplier T_delayed(L) / T_sync(L); a pair's overhead is the median over
  the band. A **quality floor**: the delayed run never reaches the band's bottom (sync's final
  loss plus the margin); the pair then reports its floor gap (D_final - S_final), not a
  multiplier. At equal token budgets a floor also covers a tax too large for the budget: the
  median over the targets it did reach (`reached_median`) tells the two apart, and a longer
  delayed run settles it.
- Over seeds (runs paired by seed): the estimate is the geometric mean of the per-seed
  medians, with a Student-t interval on their logarithms (multipliers are ratios; the interval
  stays positive). With a floor in some but not all seeds the status is "mixed": no estimate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stalepipe.lab.analysis import stats

Curve = list[tuple[float, float]]  # (tokens, loss), tokens increasing


@dataclass(frozen=True, kw_only=True)
class BandRule:
    """How the band of target losses is cut (module docstring); the defaults are the reports'."""

    plateau_frac: float = 0.1
    margin_frac: float = 0.05
    num_targets: int = 16
    ema_halflife: float = 0.0  # in eval points; 0 = no smoothing

    def __post_init__(self) -> None:
        assert 0 <= self.plateau_frac < 1 and 0 <= self.margin_frac < 1, self
        assert self.num_targets >= 2 and self.ema_halflife >= 0, self

    def describe(self) -> str:
        """One sentence for reports: the smoothing and the band."""
        smooth = (
            f"EMA with a half-life of {self.ema_halflife:g} eval points"
            if self.ema_halflife
            else "none"
        )
        return (
            f"val loss against tokens, smoothing: {smooth}; T(L) = first eval at or below L, "
            f"linearly interpolated; band: {self.num_targets} targets from "
            f"min(first evals) - {self.plateau_frac:g} x drop down to sync final + "
            f"{self.margin_frac:g} x drop (drop = sync's first minus final eval loss); "
            "floor: the delayed run never reaches the band's bottom"
        )


DEFAULT_RULE = BandRule()


def tokens_per_step(config: Mapping[str, Any]) -> int:
    """Tokens in one optimizer step of a run, from its flattened config."""
    return int(config["train.batch_size"]) * int(config["data.seq_len"])


def token_curve(val_curve: Sequence[tuple[int, float]], step_tokens: int) -> Curve:
    """(step, val loss) eval points -> (tokens seen after that step, val loss)."""
    return [((step + 1) * float(step_tokens), float(loss)) for step, loss in val_curve]


def ema(curve: Curve, halflife: float) -> Curve:
    """Exponential moving average of the losses, half-life in points; 0 returns the curve."""
    if halflife <= 0 or not curve:
        return list(curve)
    beta = 0.5 ** (1.0 / halflife)
    out, m = [], curve[0][1]
    for i, (t, y) in enumerate(curve):
        m = y if i == 0 else beta * m + (1.0 - beta) * y
        out.append((t, m))
    return out


def tokens_to_reach(curve: Curve, target: float) -> float:
    """T(L): tokens at which `curve` first reaches `target` (loss <= target), interpolated
    linearly from the eval point before; nan if it never does. At the first point it is that
    point's tokens (nothing is known before it; the band keeps targets below it)."""
    for i, (t, y) in enumerate(curve):
        if y <= target:
            if i == 0:
                return t
            t0, y0 = curve[i - 1]  # y0 > target >= y
            return t0 + (y0 - target) / (y0 - y) * (t - t0)
    return math.nan


def target_band(sync: Curve, delayed: Curve, rule: BandRule = DEFAULT_RULE) -> tuple[float, float]:
    """(top, bottom) of the band of targets of a pair; (nan, nan) when there is none."""
    if len(sync) < 2 or not delayed:
        return math.nan, math.nan
    drop = sync[0][1] - sync[-1][1]
    if not drop > 0:
        return math.nan, math.nan
    top = min(sync[0][1], delayed[0][1]) - rule.plateau_frac * drop
    bottom = sync[-1][1] + rule.margin_frac * drop
    return (top, bottom) if top > bottom else (math.nan, math.nan)


def band_targets(top: float, bottom: float, num: int) -> list[float]:
    """`num` losses evenly spaced from `top` down to `bottom`, both included."""
    return [top + (bottom - top) * i / (num - 1) for i in range(num)]


def median(xs: Sequence[float]) -> float:
    """Median of the finite values; nan if there are none."""
    v = sorted(x for x in xs if math.isfinite(x))
    if not v:
        return math.nan
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


@dataclass(frozen=True)
class PairOverhead:
    """One delayed run against its synchronous reference (or one mean curve against another)."""

    seed: int | None
    band: tuple[float, float]  # (top, bottom); nan when there is no band
    targets: tuple[float, ...]
    tokens_sync: tuple[float, ...]  # T_sync(L) per target
    tokens_delayed: tuple[float, ...]  # T_delayed(L) per target; nan = never reached
    multipliers: tuple[float, ...]
    median: float  # over the band; nan for a floor or without a band
    floor: bool
    floor_gap: float  # D_final - S_final
    reached_median: float  # median over the targets the delayed run reached

    @property
    def has_band(self) -> bool:
        return bool(self.targets)


def pair_overhead(
    sync: Curve, delayed: Curve, rule: BandRule = DEFAULT_RULE, seed: int | None = None
) -> PairOverhead:
    """The token overhead of `delayed` over `sync` (module docstring), curves unsmoothed."""
    sync, delayed = ema(sync, rule.ema_halflife), ema(delayed, rule.ema_halflife)
    gap = delayed[-1][1] - sync[-1][1] if sync and delayed else math.nan
    top, bottom = target_band(sync, delayed, rule)
    if math.isnan(top):
        return PairOverhead(seed, (top, bottom), (), (), (), (), math.nan, False, gap, math.nan)
    targets = band_targets(top, bottom, rule.num_targets)
    t_sync = [tokens_to_reach(sync, L) for L in targets]
    t_del = [tokens_to_reach(delayed, L) for L in targets]
    mult = [d / s for d, s in zip(t_del, t_sync)]  # nan where the delayed run never gets there
    floor = math.isnan(t_del[-1])  # the bottom is the lowest target: reached => all reached
    return PairOverhead(
        seed=seed,
        band=(top, bottom),
        targets=tuple(targets),
        tokens_sync=tuple(t_sync),
        tokens_delayed=tuple(t_del),
        multipliers=tuple(mult),
        median=math.nan if floor else median(mult),
        floor=floor,
        floor_gap=gap,
        reached_median=median(mult),
    )


@dataclass(frozen=True)
class Overhead:
    """The token overhead of a delayed configuration over seeds."""

    pairs: tuple[PairOverhead, ...]  # one per seed both arms finished, in seed order
    mean_pair: PairOverhead | None  # on the seed-mean curves
    status: str  # "tax" | "floor" | "mixed" | "no band" | "no pairs"
    estimate: float  # geometric mean of the per-seed medians (nan unless status is "tax")
    ci_low: float  # t-interval over seeds on log multipliers (nan with fewer than 2 seeds)
    ci_high: float
    floor_gap: float  # mean over pairs of D_final - S_final
    confidence: float = 0.95

    @property
    def num_seeds(self) -> int:
        return len(self.pairs)

    @property
    def num_floors(self) -> int:
        return sum(p.floor for p in self.pairs)

    def describe(self) -> str:
        """A short cell: '1.31x [1.18, 1.45]', 'floor (gap +0.0520; 1.42x where reached)' (the
        geometric mean over seeds of the median over the targets reached), 'floor in 1/3
        seeds'."""
        if self.status == "tax":
            ci = f" [{self.ci_low:.2f}, {self.ci_high:.2f}]" if math.isfinite(self.ci_low) else ""
            return f"{self.estimate:.2f}x{ci}"
        if self.status == "floor":
            reached = [p.reached_median for p in self.pairs if math.isfinite(p.reached_median)]
            where = f"; {log_t_interval(reached)[0]:.2f}x where reached" if reached else ""
            return f"floor (gap {self.floor_gap:+.4f}{where})"
        if self.status == "mixed":
            return f"floor in {self.num_floors}/{self.num_seeds} seeds"
        return self.status


def log_t_interval(xs: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(geometric mean, low, high) of positive `xs`: a t-interval on log(xs), mapped back."""
    m, lo, hi = stats.t_interval([math.log(x) for x in xs], confidence)
    return math.exp(m), math.exp(lo), math.exp(hi)


def summarize_pairs(
    pairs: Sequence[PairOverhead],
    mean_pair: PairOverhead | None = None,
    confidence: float = 0.95,
) -> Overhead:
    """Per-seed pairs -> the configuration's overhead (status, estimate, interval)."""
    gap = stats.mean([p.floor_gap for p in pairs if math.isfinite(p.floor_gap)])
    nan = math.nan
    if not pairs:
        return Overhead((), mean_pair, "no pairs", nan, nan, nan, gap, confidence)
    if not all(p.has_band for p in pairs):
        return Overhead(tuple(pairs), mean_pair, "no band", nan, nan, nan, gap, confidence)
    floors = sum(p.floor for p in pairs)
    if floors:
        status = "floor" if floors == len(pairs) else "mixed"
        return Overhead(tuple(pairs), mean_pair, status, nan, nan, nan, gap, confidence)
    est, lo, hi = log_t_interval([p.median for p in pairs], confidence)
    return Overhead(tuple(pairs), mean_pair, "tax", est, lo, hi, gap, confidence)


def mean_curve(curves: Sequence[Curve]) -> Curve:
    """Pointwise mean of curves over the token counts all of them have."""
    if not curves:
        return []
    maps = [dict(c) for c in curves]
    common = sorted(set.intersection(*(set(m) for m in maps)))
    return [(t, sum(m[t] for m in maps) / len(maps)) for t in common]


def overhead_over_seeds(
    sync: Mapping[int, Curve],
    delayed: Mapping[int, Curve],
    rule: BandRule = DEFAULT_RULE,
    confidence: float = 0.95,
) -> Overhead:
    """The overhead of the delayed curves over the sync curves, paired by seed (seeds present
    on one side only are left out), plus the pair of seed-mean curves for plots."""
    seeds = sorted(set(sync) & set(delayed))
    pairs = [pair_overhead(sync[s], delayed[s], rule, seed=s) for s in seeds]
    mean_pair = None
    if seeds:
        ms = mean_curve([sync[s] for s in seeds])
        md = mean_curve([delayed[s] for s in seeds])
        if ms and md:
            mean_pair = pair_overhead(ms, md, rule)
    return summarize_pairs(pairs, mean_pair, confidence)
