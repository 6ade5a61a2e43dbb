"""Statistics over seeds: mean, sample std, Welch's t-test, gap to sync, share of a gap recovered.

Pure functions on lists of floats, no scipy: Student's t distribution function comes from the
regularised incomplete beta function (continued fraction, modified Lentz), accurate to ~1e-12,
which tests/experiments/test_stats.py checks against closed forms (df = 1, 2) and tables.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass


def mean(xs: Sequence[float]) -> float:
    """Arithmetic mean; nan for an empty list."""
    return sum(xs) / len(xs) if xs else math.nan


def std(xs: Sequence[float]) -> float:
    """Sample standard deviation (ddof = 1); nan for fewer than 2 values."""
    if len(xs) < 2:
        return math.nan
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny = 1e-300
    c = 1.0
    d = 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        # even step: d_{2m} = m (b - m) x / ((a + 2m - 1)(a + 2m))
        aa = m * (b - m) * x / ((a + m2 - 1.0) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        # odd step: d_{2m+1} = -(a + m)(a + b + m) x / ((a + 2m)(a + 2m + 1))
        aa = -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1.0))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    assert a > 0 and b > 0 and 0.0 <= x <= 1.0, (a, b, x)
    if x in (0.0, 1.0):
        return x
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    # The continued fraction converges fast for x < (a + 1) / (a + b + 2); use symmetry otherwise.
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_sf_two_sided(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with `df` (real, > 0) degrees of freedom."""
    if math.isnan(t) or math.isnan(df):
        return math.nan
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


@dataclass(frozen=True)
class TTest:
    """Welch's unequal-variance t-test of mean(a) - mean(b)."""

    t: float
    df: float
    p: float  # two-sided


def welch_t_test(a: Sequence[float], b: Sequence[float]) -> TTest:
    """Welch's t-test (two-sided). nan when either side has fewer than 2 values; with zero
    variance on both sides, p = 1 for equal means and 0 otherwise."""
    na, nb = len(a), len(b)
    if na < 2 or nb < 2:
        return TTest(math.nan, math.nan, math.nan)
    va, vb = std(a) ** 2 / na, std(b) ** 2 / nb
    diff = mean(a) - mean(b)
    se2 = va + vb
    if se2 == 0.0:
        return TTest(
            0.0 if diff == 0 else math.copysign(math.inf, diff), math.nan, 1.0 if diff == 0 else 0.0
        )
    t = diff / math.sqrt(se2)
    # Welch-Satterthwaite degrees of freedom
    df = se2**2 / (va**2 / (na - 1) + vb**2 / (nb - 1))
    return TTest(t, df, t_sf_two_sided(t, df))


def gap(delayed: Sequence[float], sync: Sequence[float]) -> float:
    """The delay penalty: mean final val loss of the delayed runs minus that of sync."""
    return mean(delayed) - mean(sync)


def recovered_share(mitigated_gap: float, unmitigated_gap: float) -> float:
    """Share of the unmitigated gap a mitigation removes: 1 = all of it, 0 = none, < 0 = worse.
    nan when the unmitigated gap is not positive (nothing to recover)."""
    if not unmitigated_gap > 0:
        return math.nan
    return (unmitigated_gap - mitigated_gap) / unmitigated_gap


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties); nan for fewer than 2 points."""
    if len(xs) < 2:
        return math.nan

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = mean(rx), mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else math.nan


@functools.lru_cache(maxsize=4096)
def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (0 < p < 1), by bisection on
    `t_sf_two_sided` (to ~1e-12 relative): t_quantile(0.975, 2) = 4.3027. Cached: a verdict
    asks for the same few (p, df) thousands of times (each seed count's 95 % interval)."""
    assert 0.0 < p < 1.0 and df > 0, (p, df)
    if p == 0.5:
        return 0.0
    tail = 2.0 * min(p, 1.0 - p)  # two-sided tail mass beyond |t|
    lo, hi = 0.0, 1.0
    while t_sf_two_sided(hi, df) > tail:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_sf_two_sided(mid, df) > tail:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    t = 0.5 * (lo + hi)
    return t if p > 0.5 else -t


def t_interval(xs: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): Student's t confidence interval for the mean of `xs` (ddof 1);
    low = high = nan for fewer than 2 values."""
    m = mean(xs)
    if len(xs) < 2:
        return m, math.nan, math.nan
    half = t_quantile(0.5 + confidence / 2.0, len(xs) - 1) * std(xs) / math.sqrt(len(xs))
    return m, m - half, m + half


@dataclass(frozen=True)
class Difference:
    """A mean difference with its test and 95 % interval: `paired` says whether the values
    were paired (by seed: same data order and initialisation) or compared as two samples."""

    diff: float
    low: float
    high: float
    p: float  # two-sided
    n: int  # pairs (paired) or the smaller sample (Welch)
    paired: bool


def paired_difference(a: dict[int, float], b: dict[int, float]) -> Difference:
    """mean(a[s] - b[s]) over the keys both have (seeds), Student's paired t-test and its
    95 % interval; nan test and interval with fewer than 2 pairs. With zero spread, p = 1
    for a zero difference and 0 otherwise (as `welch_t_test`)."""
    d = [a[s] - b[s] for s in sorted(a.keys() & b.keys())]
    m, low, high = t_interval(d)
    if len(d) < 2:
        return Difference(m, low, high, math.nan, len(d), True)
    sd = std(d)
    if sd == 0.0:
        return Difference(m, m, m, 1.0 if m == 0 else 0.0, len(d), True)
    t = m / (sd / math.sqrt(len(d)))
    return Difference(m, low, high, t_sf_two_sided(t, len(d) - 1), len(d), True)


def welch_difference(a: Sequence[float], b: Sequence[float]) -> Difference:
    """mean(a) - mean(b), Welch's t-test and its 95 % interval (Welch-Satterthwaite df)."""
    test = welch_t_test(a, b)
    diff = mean(a) - mean(b) if a and b else math.nan
    if not math.isfinite(test.df):
        return Difference(diff, math.nan, math.nan, test.p, min(len(a), len(b)), False)
    half = t_quantile(0.975, test.df) * math.sqrt(std(a) ** 2 / len(a) + std(b) ** 2 / len(b))
    return Difference(diff, diff - half, diff + half, test.p, min(len(a), len(b)), False)


def seed_difference(
    a: dict[int, float],
    b: dict[int, float],
    unpaired: tuple[Sequence[float], Sequence[float]] | None = None,
) -> Difference:
    """mean(a - b) by seed: paired where at least two seeds are in both (the runs of a seed
    share data order and initialisation, so the paired test is the right one), else Welch's
    on `unpaired` (default: the values of `a` and `b`)."""
    paired = paired_difference(a, b)
    if paired.n >= 2:
        return paired
    xs, ys = unpaired or (list(a.values()), list(b.values()))
    return welch_difference(xs, ys)


def holm(ps: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (step-down, monotone, capped at 1), in the input's
    order; a nan p (a test that could not run) is left nan and not counted."""
    finite = sorted((p, i) for i, p in enumerate(ps) if math.isfinite(p))
    out = [math.nan] * len(ps)
    running = 0.0
    for rank, (p, i) in enumerate(finite):
        running = max(running, min(1.0, (len(finite) - rank) * p))
        out[i] = running
    return out


# ---- how the claims table and the reports print these (moved from `claims`, issue 51) ----


def fmt_ci(d: Difference | None, digits: int = 4) -> str:
    """'[low, high]' of a difference's 95 % interval ('' when it has none)."""
    if d is None or not math.isfinite(d.low):
        return ""
    return f"[{d.low:+.{digits}f}, {d.high:+.{digits}f}]"


def fmt(x: float, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}"


def fmt_p(p: float) -> str:
    if not math.isfinite(p):
        return "-"
    return f"{p:.1e}" if p < 1e-3 else f"{p:.3f}"


def fmt_share(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{100 * x:.0f}%"
