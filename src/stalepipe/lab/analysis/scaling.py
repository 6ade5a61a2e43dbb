"""Does the delay's cost shrink with model size? The size ladder's fit, test and prediction,
exactly as docs/RESULTS.md ("Size ladder") wrote them down before the ladder's runs existed.

Input: per optimizer and delayed arm, `{N: {seed: gap}}`, N the non-embedding parameters of a
width, a gap the delayed run's final loss minus sync's at the same seed (paired). Then:

- the fit `gap(N) = b (N / N0)^(-c)`, least squares on the logs of the width means (`fit_power`);
  where a width's mean gap is <= 0 the line `gap = a + s log10(N)` on the per-seed gaps instead
  (`fit_line`), named as such;
- the interval of the shrink rate (`trend`): the regression's t-interval (the five width means'
  residual scatter, 3 degrees of freedom), its two-sided p; amended before any gap existed
  from a seed bootstrap, which undercovered (82-85 % in simulated 3-seed ladders, this 96 %);
- the test (`direction`): reproduced where the interval of c is above 0, not reproduced below,
  inconclusive where it holds 0; Holm over the table's fits (`analysis.stats.holm`);
- the prediction for one new run at a target N (`predict`): the regression's interval for the
  log mean there, widened by one run's relative seed spread; held against a published figure
  by `against_paper`;
- EF's recovered share per width (`ef_share`): a ratio of means, its registered interval a
  paired seed bootstrap, which with 3 seeds is about the per-seed range (~72 % coverage, found
  after the data); `fieller_share` gives the ratio's exact 95 % interval beside it;
- the token overhead at a width (`ladder_overheads`): per seed, where the delayed arm's final
  loss over its complete runs at several lengths crosses sync's 1x final loss
  (`targets.final_crossing`), minus one, fitted like a gap; `overhead_at` predicts it at a
  target size, the interval the verdict takes (`stalepipe verdict --overhead-fit`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stalepipe.config import ModelConfig
from stalepipe.config.shapes import count_params
from stalepipe.errors import UserError
from stalepipe.fileio import inside, read_json_record, read_record
from stalepipe.lab.analysis.stats import t_quantile, t_sf_two_sided
from stalepipe.lab.analysis.targets import final_crossing
from stalepipe.training.delay.policies import never_delays

N0 = 406_368  # width 96's non-embedding parameters: the fit's reference size
SMOLLM_135M, SMOLLM_360M = 106_203_456, 314_635_200  # non-embedding, counted from the presets
Points = Mapping[int, Mapping[int, float]]  # N -> seed -> paired gap


@dataclass(frozen=True)
class Fit:
    """A fitted curve: kind "power" (b, c) or "line" (a, s over log10 N)."""

    kind: str
    p1: float  # b (power) or a (line)
    p2: float  # c (power) or s (line)

    def at(self, n: float) -> float:
        if self.kind == "power":
            return self.p1 * (n / N0) ** (-self.p2)
        return self.p1 + self.p2 * math.log10(n)

    @property
    def shrink(self) -> float:
        """How fast the gap shrinks with size: c (power), -s (line); > 0 means it shrinks."""
        return self.p2 if self.kind == "power" else -self.p2


def fit_power(means: Mapping[int, float]) -> Fit:
    """b, c of `gap = b (N/N0)^-c` by least squares on log gap against log(N/N0)."""
    x = np.log(np.array(sorted(means), dtype=float) / N0)
    y = np.log(np.array([means[n] for n in sorted(means)], dtype=float))
    slope, intercept = np.polyfit(x, y, 1)
    return Fit("power", float(math.exp(intercept)), float(-slope))


def fit_line(points: Points) -> Fit:
    """a, s of `gap = a + s log10 N` by least squares on every seed's gap."""
    x = np.array([math.log10(n) for n in points for _ in points[n]], dtype=float)
    y = np.array([g for n in points for g in points[n].values()], dtype=float)
    s, a = np.polyfit(x, y, 1)
    return Fit("line", float(a), float(s))


def width_means(points: Points) -> dict[int, float]:
    return {n: float(np.mean(list(seeds.values()))) for n, seeds in points.items()}


def fit(points: Points) -> Fit:
    """The registered fit: the power law on the width means, or the line where a mean <= 0."""
    means = width_means(points)
    return fit_power(means) if all(m > 0 for m in means.values()) else fit_line(points)


def _ols(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float, float]:
    """(slope, intercept, residual variance, Sxx) of y on x by least squares."""
    slope, intercept = np.polyfit(x, y, 1)
    r = y - (slope * x + intercept)
    sxx = float(((x - x.mean()) ** 2).sum())
    return float(slope), float(intercept), float(r @ r) / (len(x) - 2), sxx


def _xy(points: Points, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The regression's data: log(N/N0) and the log width means (power), or log10 N and every
    seed's gap (line)."""
    if kind == "power":
        means = width_means(points)
        x = np.log(np.array(sorted(means), dtype=float) / N0)
        return x, np.log(np.array([means[n] for n in sorted(means)], dtype=float))
    x = np.array([math.log10(n) for n in points for _ in points[n]], dtype=float)
    return x, np.array([g for n in points for g in points[n].values()], dtype=float)


@dataclass(frozen=True)
class Trend:
    """The fit of one optimizer and arm, the 95 % t-interval of its shrink rate and its p."""

    fit: Fit
    shrink_lo: float
    shrink_hi: float
    p: float  # two-sided, that the shrink rate is 0


def trend(points: Points) -> Trend:
    """The registered fit and the t-interval of its slope (residual degrees of freedom: the
    widths less 2 for the power law, the runs less 2 for the line). Amended before any gap
    existed: a seed bootstrap covered c in 82-85 % of simulated 3-seed ladders, this in 96 %."""
    f = fit(points)
    x, y = _xy(points, f.kind)
    slope, _, s2, sxx = _ols(x, y)
    df = len(x) - 2
    se = math.sqrt(s2 / sxx) if sxx > 0 else math.inf
    half = t_quantile(0.975, df) * se
    rate = f.shrink
    p = t_sf_two_sided(rate / se, df) if se > 0 else 0.0
    return Trend(f, rate - half, rate + half, p)


def direction(t: Trend, p_holm: float, alpha: float = 0.05, name: str = "Holm p") -> str:
    """The test's label: the interval of the shrink rate against 0, after Holm (`name` says
    which p it is: "p" for a fit tested alone, as the token overhead's)."""
    if not p_holm < alpha:
        return f"inconclusive ({name} {p_holm:.3g})"
    if t.shrink_lo > 0:
        return "reproduced (shrinks)"
    if t.shrink_hi < 0:
        return "not reproduced (grows)"
    return "inconclusive (interval holds 0)"


def predict(points: Points, t: Trend, target: float) -> tuple[float, float, float]:
    """(point, 2.5 %, 97.5 %) for one new run at `target` non-embedding parameters. Power law:
    the regression's interval for the log mean at the target, widened by one run's seed noise
    as a share of the gap (the pooled relative seed spread of the ladder's widths, assumed to
    hold at the target), both at the t quantile. Line: the regression's prediction interval."""
    x, y = _xy(points, t.fit.kind)
    slope, intercept, s2, sxx = _ols(x, y)
    q = t_quantile(0.975, len(x) - 2)
    if t.fit.kind == "line":
        xt = math.log10(target)
        half = q * math.sqrt(s2 * (1 + 1 / len(x) + (xt - x.mean()) ** 2 / sxx))
        point = intercept + slope * xt
        return point, point - half, point + half
    xt = math.log(target / N0)
    se_mean = math.sqrt(s2 * (1 / len(x) + (xt - x.mean()) ** 2 / sxx))
    spreads = [
        np.std(list(s.values()), ddof=1) / np.mean(list(s.values())) for s in points.values()
    ]
    seed_share = math.sqrt(float(np.mean(np.square(spreads))))
    half = math.sqrt((q * se_mean) ** 2 + (q * seed_share) ** 2)
    point = math.exp(intercept + slope * xt)
    return point, point * math.exp(-half), point * math.exp(half)


def against_paper(figure: float, lo: float, hi: float) -> str:
    """A published figure against our 95 % prediction interval (docs/RESULTS.md's rule)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive (no interval)"
    if lo < figure / 10 or hi > figure * 10:
        return "inconclusive (too wide)"
    return "agrees" if lo <= figure <= hi else "disagrees"


def ef_share(gap_2bw: Points, gap_ef: Points, resamples: int = 2000, seed: int = 0):
    """Per width: EF's recovered share `1 - mean g_ef / mean g_2bw` (a ratio of means) with
    its bootstrap interval (seeds resampled paired across the two arms): {N: (share, lo, hi)}."""
    rng = np.random.default_rng(seed)
    out = {}
    for n in sorted(set(gap_2bw) & set(gap_ef)):
        seeds = sorted(set(gap_2bw[n]) & set(gap_ef[n]))
        if not seeds:
            continue
        a = np.array([gap_2bw[n][s] for s in seeds])
        e = np.array([gap_ef[n][s] for s in seeds])
        share = 1 - e.mean() / a.mean() if a.mean() != 0 else math.nan
        boots = []
        for _ in range(resamples):
            i = rng.choice(len(seeds), size=len(seeds), replace=True)
            if a[i].mean() != 0:
                boots.append(1 - e[i].mean() / a[i].mean())
        lo, hi = np.percentile(boots, [2.5, 97.5]) if boots else (math.nan, math.nan)
        out[n] = (float(share), float(lo), float(hi))
    return out


def fieller_share(gap_2bw: Mapping[int, float], gap_ef: Mapping[int, float]):
    """EF's share `1 - mean e / mean a` over paired seeds with Fieller's 95 % interval: the
    ratios r = mean e / mean a for which the paired differences `e - r a` have a t-interval
    holding 0 (n - 1 degrees of freedom). (share, lo, hi); lo = -inf, hi = inf where 2bw's mean
    gap is not itself clear of 0 at 95 % (the ratio is then unbounded)."""
    seeds = sorted(set(gap_2bw) & set(gap_ef))
    a = np.array([gap_2bw[s] for s in seeds], dtype=float)
    e = np.array([gap_ef[s] for s in seeds], dtype=float)
    if len(seeds) < 2 or a.mean() == 0:
        return math.nan, math.nan, math.nan
    n, q2 = len(seeds), t_quantile(0.975, len(seeds) - 1) ** 2
    cov = np.cov(np.vstack([a, e]), ddof=1) / n  # of the two means
    qa = a.mean() ** 2 - q2 * cov[0, 0]  # r^2 qa - 2 r qb + qc <= 0
    qb = a.mean() * e.mean() - q2 * cov[0, 1]
    qc = e.mean() ** 2 - q2 * cov[1, 1]
    share = 1 - e.mean() / a.mean()
    disc = qb * qb - qa * qc
    if qa <= 0 or disc < 0:
        return float(share), -math.inf, math.inf
    r_lo, r_hi = (qb - math.sqrt(disc)) / qa, (qb + math.sqrt(disc)) / qa
    return float(share), 1 - r_hi, 1 - r_lo


# ---- the token overhead over the ladder (`stalepipe verdict --overhead-fit`) --------------------

SIZES = {
    "135m": SMOLLM_135M,
    "360m": SMOLLM_360M,
    "smollm-135m": SMOLLM_135M,
    "smollm-360m": SMOLLM_360M,
}
MIN_WIDTHS = 3  # the registered fit of the overhead: its three widths


@dataclass(frozen=True)
class LadderRun:
    """One finished ladder run: its arm, width, LR, seed, planned tokens and final loss on the
    whole validation split (`val_loss_full`)."""

    optimizer: str
    arm: str  # "sync", "2bw", "2bw+ef"
    width: int
    params: int  # non-embedding parameters
    lr: float
    seed: int
    tokens: int
    loss: float


def ladder_runs(root: Path) -> list[LadderRun]:
    """The finished runs under `root` (config.json and the last metrics row; nothing else read,
    nothing unpickled) that scored the whole validation split."""
    out = []
    for cfg_path in sorted(Path(root).glob("*/config.json")):
        metrics = inside(root, cfg_path.with_name("metrics.jsonl"))  # no link out of `root`
        if not metrics.exists():
            continue
        lines = read_record(root, metrics).splitlines()
        last = json.loads(lines[-1]) if lines else {}
        if not isinstance(last, dict) or "val_loss_full" not in last:
            continue
        c = read_json_record(root, cfg_path)
        d, t = c["delay"], c["train"]
        policy = d["policy"]
        arm = "sync" if never_delays(policy) else policy + ("+ef" if d["ef"] else "")
        out.append(
            LadderRun(
                optimizer=c["optim"]["name"],
                arm=arm,
                width=c["model"]["dim"],
                params=count_params(ModelConfig(**c["model"]))["non_embedding"],
                lr=float(c["optim"]["lr"]),
                seed=int(t["seed"]),
                tokens=int(t["num_steps"]) * int(t["batch_size"]) * int(c["data"]["seq_len"]),
                loss=float(last["val_loss_full"]),
            )
        )
    return out


def ladder_overheads(runs: list[LadderRun], optimizer: str, arm: str) -> tuple[Points, list[str]]:
    """N -> seed -> token overhead minus one of `optimizer`'s `arm`, at every width whose arm
    has complete runs at two lengths or more: where its final loss over those runs crosses sync's
    1x final loss of the same seed (and LR). A seed that never gets there within its longest run
    leaves its width out, said in the notes (a bound is not a point)."""
    points: dict[int, dict[int, float]] = {}
    notes = []
    groups: dict[tuple[int, float], list[LadderRun]] = {}
    for r in runs:
        if r.optimizer == optimizer:
            groups.setdefault((r.params, r.lr), []).append(r)
    for (n, _lr), group in sorted(groups.items()):
        delayed = [r for r in group if r.arm == arm]
        if len({r.tokens for r in delayed}) < 2:
            continue
        base = min(r.tokens for r in group)
        sync = {r.seed: r for r in group if r.arm == "sync" and r.tokens == base}
        by_seed: dict[int, float] = {}
        for seed, s in sorted(sync.items()):
            mine = [[(r.tokens, r.loss)] for r in delayed if r.seed == seed]
            if len(mine) < 2:
                continue
            crossing = final_crossing(mine, s.loss)
            if math.isnan(crossing):
                longest = max(c[0][0] for c in mine) / s.tokens
                notes.append(f"N={n:,} seed {seed}: never reaches sync's loss by {longest:.2f}x")
                by_seed = {}
                break
            by_seed[seed] = crossing / s.tokens - 1
        if len(by_seed) >= 2:
            points[n] = by_seed
    return points, notes


def target_size(text: str) -> int:
    """`135M`, `360M`, `smollm-360m` or a count of non-embedding parameters (`1.2e8`)."""
    key = text.strip().lower()
    if key in SIZES:
        return SIZES[key]
    try:
        n = float(key)
    except ValueError:
        n = math.nan
    if not (n >= 1e4):  # below the ladder's smallest rung: a unit left out (360 for 360M)
        raise UserError(
            f"--overhead-fit: size {text!r}: give 135M, 360M or a number of non-embedding "
            "parameters of at least 10,000 (e.g. 1.2e8)"
        )
    return int(n)


def overhead_at(
    root: Path, target: int, optimizer: str = "muon", arm: str = "2bw+ef"
) -> tuple[float, float, float, str]:
    """The registered fit of the token overhead over the ladder under `root`, predicted for one
    run at `target` non-embedding parameters: (overhead, 2.5 %, 97.5 %, what it is), the
    overhead 1 + the prediction of its excess. UserError, naming the sweep that fills it, when
    fewer than MIN_WIDTHS widths have it."""
    points, notes = ladder_overheads(ladder_runs(root), optimizer, arm)
    if len(points) < MIN_WIDTHS:
        have = ", ".join(f"N = {n:,}" for n in sorted(points)) or "no lengths runs"
        why = "; ".join([have, *notes])
        raise UserError(
            f"--overhead-fit: {root} has the token overhead of {optimizer} {arm} at "
            f"{len(points)} width(s) ({why}); the fit needs {MIN_WIDTHS}: run `stalepipe sweep "
            f"ladder --scale cpu-regime --seeds 3 --only optim.name={optimizer} --lengths "
            "1.1,1.2,1.35,1.5`"
        )
    t = trend(points)
    point, lo, hi = predict(points, t, target)
    widths = ", ".join(f"{n:,}" for n in sorted(points))
    what = (
        f"{optimizer} {arm} fitted over N = {widths} ({t.fit.kind} law), predicted at "
        f"N = {target:,}"
    )
    return 1 + point, 1 + lo, 1 + hi, what
