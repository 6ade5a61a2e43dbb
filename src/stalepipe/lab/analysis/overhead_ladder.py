"""The overhead ladder's analysis, exactly as docs/RESULTS.md ("Overhead ladder") registered it
before its runs existed: does the token overhead of a one-step delay change with model size
when the training length is held fixed?

Input: the finished runs of the `overhead-ladder` sweep (`scaling.ladder_runs`). Then:

- per width, seed and delayed arm, the token overhead `o` at sync's 1x final loss from the
  arm's complete runs at 1-1.5x (`seed_overheads`, through `targets.final_crossing`, as the
  verdict reads it); a seed already there at 1x reads 1.0 (an upper bound), one not there by
  its longest run reads that length (a lower bound); a seed enters only once its sync run and
  every registered length of the arm have finished;
- the fit `ln o = a + beta ln N` on the per-seed points (`fit_overheads`), the slope's 95 %
  t-interval (direction, Holm over the two arms) and its 90 % interval (equivalence within
  +-`DELTA`); `label` words the result, "inconclusive (censored)" past `MAX_CENSORED` bounds;
- the 95 % prediction interval for one run at SmolLM-360M (`predict`), held to the overheads
  the paper's 360M gaps imply through `gap = s ln o` for a sync slope `s` in `SLOPE_RANGE`
  (`against_paper`);
- the relation `gap = s ln o` on the ladder's own runs (`slope_relation`): sync's final slope
  from its 1x and 1.2x runs, the overhead it implies beside the measured one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stalepipe.errors import UserError
from stalepipe.lab.analysis.scaling import SMOLLM_360M, LadderRun, ladder_runs
from stalepipe.lab.analysis.stats import holm, t_quantile, t_sf_two_sided
from stalepipe.lab.analysis.targets import (
    Relation,
    final_crossing,
    implied_overhead,
    relate,
    sync_slope,
)

LENGTHS = (1.0, 1.1, 1.2, 1.35, 1.5)  # the delayed arms' registered lengths (scales.py)
SYNC_SLOPE_LENGTH = 1.2  # sync's second length: its final slope
DELTA = 0.05  # the equivalence margin on beta (d ln o / d ln N)
MAX_CENSORED = 3  # of an arm's 12 points; more: inconclusive (censored)
TOO_WIDE = 0.20  # a 360M prediction interval of ln o wider than this cannot tell 1.0x from 1.2x
PAPER_GAPS = {"2bw": 0.012, "2bw+ef": 0.005}  # Muon at 360M, the paper's table
SLOPE_RANGE = (0.127, 0.200)  # -dL/d ln D of Chinchilla's data term at 20-100 tokens/param, 360M
ARMS = ("2bw", "2bw+ef")


@dataclass(frozen=True)
class SeedOverhead:
    """One width, seed and arm: the overhead and whether it is a bound ("<=", ">=" or "")."""

    n: int
    seed: int
    overhead: float
    bound: str


def _by_width(runs: Sequence[LadderRun]) -> dict[int, list[LadderRun]]:
    out: dict[int, list[LadderRun]] = {}
    for r in runs:
        out.setdefault(r.params, []).append(r)
    return out


def _base(group: Sequence[LadderRun]) -> int:
    return min(r.tokens for r in group)


def _factor(r: LadderRun, base: int) -> float:
    return round(r.tokens / base, 2)


def seed_overheads(runs: Sequence[LadderRun], arm: str) -> list[SeedOverhead]:
    """The per-seed overheads of `arm` over every width whose seed is complete (module doc)."""
    out = []
    for n, group in sorted(_by_width(runs).items()):
        base = _base(group)
        for seed in sorted({r.seed for r in group}):
            mine = [r for r in group if r.seed == seed]
            sync = [r for r in mine if r.arm == "sync" and r.tokens == base]
            delayed = [r for r in mine if r.arm == arm]
            if not sync or {_factor(r, base) for r in delayed} != set(LENGTHS):
                continue  # not complete yet: no point, never a partial one
            crossing = final_crossing([[(r.tokens, r.loss)] for r in delayed], sync[0].loss)
            if math.isnan(crossing):
                out.append(SeedOverhead(n, seed, max(LENGTHS), ">="))
            else:
                o = crossing / base
                out.append(SeedOverhead(n, seed, o, "<=" if o <= min(LENGTHS) else ""))
    return out


@dataclass(frozen=True)
class OverheadFit:
    """`ln o = a + beta ln N` by least squares on the per-seed points."""

    a: float
    beta: float
    se: float  # of beta
    df: int
    resid_var: float
    x_mean: float
    sxx: float
    n_points: int
    censored: int

    def interval(self, confidence: float) -> tuple[float, float]:
        half = t_quantile(0.5 + confidence / 2, self.df) * self.se
        return self.beta - half, self.beta + half

    @property
    def p(self) -> float:
        """Two-sided p that beta = 0."""
        return t_sf_two_sided(self.beta / self.se, self.df) if self.se > 0 else 0.0


def fit_overheads(points: Sequence[SeedOverhead]) -> OverheadFit | None:
    """The registered fit; None with fewer than 3 points or fewer than 2 widths."""
    if len(points) < 3 or len({p.n for p in points}) < 2:
        return None
    x = np.log(np.array([p.n for p in points], dtype=float))
    y = np.log(np.array([p.overhead for p in points], dtype=float))
    beta, a = np.polyfit(x, y, 1)
    resid = y - (a + beta * x)
    df = len(points) - 2
    sxx = float(((x - x.mean()) ** 2).sum())
    var = float(resid @ resid) / df
    return OverheadFit(
        a=float(a),
        beta=float(beta),
        se=math.sqrt(var / sxx),
        df=df,
        resid_var=var,
        x_mean=float(x.mean()),
        sxx=sxx,
        n_points=len(points),
        censored=sum(bool(p.bound) for p in points),
    )


def label(fit: OverheadFit, holm_p: float) -> str:
    """The registered words for one arm: direction (Holm), equivalence (90 % interval in
    +-DELTA), both, or inconclusive; censored past MAX_CENSORED bounds."""
    if fit.censored > MAX_CENSORED:
        return f"inconclusive (censored: {fit.censored} of {fit.n_points} points are bounds)"
    lo90, hi90 = fit.interval(0.90)
    flat = lo90 > -DELTA and hi90 < DELTA
    direction = ""
    if holm_p < 0.05:
        direction = "the overhead shrinks with size" if fit.beta < 0 else "grows with size"
    if direction and flat:
        return f"{direction}, within +-{DELTA:g}"
    if direction:
        return direction
    if flat:
        return f"flat within +-{DELTA:g}"
    return "inconclusive"


def labels(fits: dict[str, OverheadFit]) -> dict[str, tuple[float, str]]:
    """Holm over the arms' direction tests, then each arm's label: {arm: (Holm p, label)}."""
    arms = sorted(fits)
    adjusted = holm([fits[a].p for a in arms])
    return {a: (p, label(fits[a], p)) for a, p in zip(arms, adjusted, strict=True)}


def predict(fit: OverheadFit, n: int = SMOLLM_360M) -> tuple[float, float, float]:
    """(o, 2.5 %, 97.5 %): the 95 % prediction interval for one run's overhead at `n`."""
    x = math.log(n)
    centre = fit.a + fit.beta * x
    leverage = 1 + 1 / fit.n_points + (x - fit.x_mean) ** 2 / fit.sxx
    half = t_quantile(0.975, fit.df) * math.sqrt(fit.resid_var * leverage)
    return math.exp(centre), math.exp(centre - half), math.exp(centre + half)


def paper_overheads(arm: str) -> tuple[float, float]:
    """The overheads the paper's 360M gap of `arm` implies for a sync slope in SLOPE_RANGE."""
    gap = PAPER_GAPS[arm]
    return math.exp(gap / SLOPE_RANGE[1]), math.exp(gap / SLOPE_RANGE[0])


def against_paper(lo: float, hi: float, arm: str) -> str:
    """The registered reading of a 360M prediction interval [lo, hi] of the overhead."""
    if math.log(hi) - math.log(lo) > TOO_WIDE:
        return "inconclusive (too wide)"
    p_lo, p_hi = paper_overheads(arm)
    return "a miss" if p_hi < lo or p_lo > hi else "agrees"


def slope_relation(runs: Sequence[LadderRun], arm: str) -> list[Relation]:
    """Per width (labelled by N): the overhead the equal-token gap and sync's final slope
    (its 1x and 1.2x runs) imply, per seed, beside the measured overhead of the same seeds
    (`targets.implied_overhead`, `targets.relate`)."""
    measured = {(p.n, p.seed): p.overhead for p in seed_overheads(runs, arm)}
    out = []
    for n, group in sorted(_by_width(runs).items()):
        base = _base(group)
        implied, got = [], []
        for seed in sorted({r.seed for r in group}):
            at = {(r.arm, _factor(r, base)): r.loss for r in group if r.seed == seed}
            need = [("sync", 1.0), ("sync", SYNC_SLOPE_LENGTH), (arm, 1.0)]
            if (n, seed) in measured and all(k in at for k in need):
                finals = {f: at["sync", f] for f in (1.0, SYNC_SLOPE_LENGTH)}
                gap = at[arm, 1.0] - at["sync", 1.0]
                implied.append(implied_overhead(sync_slope(finals), gap))
                got.append(measured[n, seed])
        if (r := relate(f"N={n:,} {arm}", implied, got)) is not None:
            out.append(r)
    return out


MIN_WIDTHS = 3  # the fit the verdict takes: at least three widths with complete seeds


def overhead_at(root: Path, n: int, arm: str = "2bw+ef") -> tuple[float, float, float, str]:
    """The overhead ladder under `root` fitted as registered and predicted for one run at `n`
    non-embedding parameters: (overhead, 2.5 %, 97.5 %, what it is), for `stalepipe verdict
    --overhead-fit`. UserError in one line when the widths train different token budgets (size
    and length would move together: the size ladder) or fewer than MIN_WIDTHS have a seed."""
    runs = [r for r in ladder_runs(root) if r.optimizer == "muon"]
    budgets = {r.params: _base([x for x in runs if x.params == r.params]) for r in runs}
    if len(set(budgets.values())) > 1:
        raise UserError(
            f"--overhead-fit: the widths under {root} train different token budgets "
            f"({min(budgets.values()):,}-{max(budgets.values()):,} tokens at 1x), so size and "
            "training length move together there; give an overhead ladder at one budget: "
            "`stalepipe sweep overhead-ladder --scale cpu-regime --seeds 3` (docs/results/"
            "overhead-ladder)"
        )
    points = seed_overheads(runs, arm)
    widths = sorted({p.n for p in points})
    if len(widths) < MIN_WIDTHS or (fit := fit_overheads(points)) is None:
        have = ", ".join(f"{w:,}" for w in widths) or "none"
        raise UserError(
            f"--overhead-fit: {root} has complete seeds of muon {arm} at {len(widths)} width(s) "
            f"(N = {have}); the fit needs {MIN_WIDTHS}: run `stalepipe sweep overhead-ladder "
            "--scale cpu-regime --seeds 3` to complete it"
        )
    o, lo, hi = predict(fit, n)
    what = (
        f"muon {arm}, ln o on ln N over {fit.n_points} seeds at N = "
        f"{', '.join(f'{w:,}' for w in widths)} ({fit.censored} bounds), predicted at N = {n:,}"
    )
    return o, lo, hi, what
