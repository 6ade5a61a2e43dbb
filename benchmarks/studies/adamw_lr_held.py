"""AdamW's size ladder with its LR held apart (issue 51, item 6, second part): the analysis
docs/RESULTS.md registered before the runs of study `ladder-adamw-lr2`, from the run records.

    python benchmarks/studies/adamw_lr_held.py                     # the committed records
    python benchmarks/studies/adamw_lr_held.py --second runs/ladder-adamw-lr2   # in progress
    python benchmarks/studies/adamw_lr_held.py --require-complete  # exit 1 until all 30 gaps

Every number is a run's final loss on the whole validation split (`val_loss_full`) at its
width's 1x tokens. The paired gap (2bw minus sync, same seed and LR) of AdamW at both LRs of
each width: the best (`LADDER_LRS`, phase 2's runs, `--best`) and the second-best
(`LADDER_ADAMW_SECOND_LRS`, the study's runs, `--second`; seed 0's sync there is phase 1's own
run, read from either directory, and a run read twice must agree). A run's N must be its
rung's registered count.

While any of the 30 (width, LR, seed) gaps is missing: "incomplete: K of 30 ..." and the table,
no fit and no label. Once all 30 exist, as registered: OLS over the 10 (width, LR) means,
`ln g = a - c ln N + k ln LR` (7 residual df), c's 95 % t-interval and its label ("shrinks
with size at a held LR" above 0, "grows" below, "inconclusive" otherwise; a mean gap <= 0
leaves its point out, said); k beside the 0.43M slope 0.564 [0.40, 0.72] ("consistent" where
the intervals overlap); the same fit on the per-seed gaps > 0 as a check, not labelled; the
width 96 -> 136 ratio of the gaps at the second-best LRs beside the ratio k predicts from the
LR change alone; the registered caveat.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stalepipe.errors import UserError
from stalepipe.lab.analysis import scaling, stats
from stalepipe.lab.studies.ladder import LADDER, LADDER_LRS
from stalepipe.lab.studies.ladder_adamw_lr2 import LADDER_ADAMW_SECOND_LRS

BEST_ROOT = "docs/results/ladder-regime"  # phase 1 and phase 2 of the size ladder
SECOND_ROOT = "docs/results/ladder-adamw-lr2"
WIDTHS = {w: n for w, _, n in LADDER}  # width -> non-embedding parameters N
SEEDS = (0, 1, 2)
ARMS = ("sync", "2bw")
# (width, LR, which): the 10 (width, LR) points of the registered fit
CELLS = [(w, float(LADDER_LRS["adamw", w]), "best") for w in WIDTHS] + [
    (w, float(LADDER_ADAMW_SECOND_LRS[w]), "second") for w in WIDTHS
]
REGISTERED_GAPS = len(CELLS) * len(SEEDS)  # 30
K_43M = (0.564, 0.40, 0.72)  # the 0.43M LR slope and its 95 % interval, as registered
RATIO_WIDTHS = (96, 136)
LABEL_SHRINKS, LABEL_GROWS, LABEL_NONE = "shrinks with size at a held LR", "grows", "inconclusive"
CAVEAT = (
    "caveat (registered): the LR is still chosen per width; the design separates size from LR "
    "only through each width's two LRs, and assumes one k across widths"
)

Point = tuple[int, float, float]  # (N, LR, gap)


# ---- the fit and its labels (pure) ----------------------------------------------------------


def ols(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Least squares of y on the columns of x by the normal equations: (coefficients, their
    covariance s^2 (X'X)^-1, residual degrees of freedom)."""
    xtx = x.T @ x
    beta = np.linalg.solve(xtx, x.T @ y)
    df = len(y) - x.shape[1]
    resid = y - x @ beta
    s2 = float(resid @ resid) / df if df > 0 else math.nan
    return beta, s2 * np.linalg.inv(xtx), df


@dataclass(frozen=True)
class Fit:
    """`ln g = a - c ln N + k ln LR` by least squares, with the 95 % t-intervals of c and k;
    `left_out` the points whose gap is <= 0 (no log), not in the fit."""

    a: float
    c: float
    k: float
    se_c: float
    se_k: float
    df: int
    n: int  # points fitted
    left_out: tuple[Point, ...]

    def _ci(self, value: float, se: float) -> tuple[float, float]:
        if self.df < 1 or not math.isfinite(se):
            return math.nan, math.nan
        half = stats.t_quantile(0.975, self.df) * se
        return value - half, value + half

    @property
    def c_ci(self) -> tuple[float, float]:
        return self._ci(self.c, self.se_c)

    @property
    def k_ci(self) -> tuple[float, float]:
        return self._ci(self.k, self.se_k)


def fit_held_lr(points: Sequence[Point]) -> Fit | None:
    """The registered fit over `points` (N, LR, gap): the gaps <= 0 left out (kept in
    `Fit.left_out`), the rest fitted; None where fewer than 3 remain or ln N and ln LR do not
    tell the three coefficients apart."""
    kept = [p for p in points if p[2] > 0]
    left_out = tuple(p for p in points if not p[2] > 0)
    if len(kept) < 3:
        return None
    x = np.array([[1.0, math.log(n), math.log(lr)] for n, lr, _ in kept])
    if np.linalg.matrix_rank(x) < 3:
        return None
    y = np.log(np.array([g for _, _, g in kept]))
    beta, cov, df = ols(x, y)
    se = np.sqrt(np.diag(cov)) if df > 0 else np.full(3, math.nan)
    return Fit(
        a=float(beta[0]),
        c=float(-beta[1]),
        k=float(beta[2]),
        se_c=float(se[1]),
        se_k=float(se[2]),
        df=df,
        n=len(kept),
        left_out=left_out,
    )


def label_c(ci: tuple[float, float]) -> str:
    """The registered label of c's 95 % interval; an interval that cannot be read is
    inconclusive."""
    lo, hi = ci
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return LABEL_NONE
    if lo > 0:
        return LABEL_SHRINKS
    if hi < 0:
        return LABEL_GROWS
    return LABEL_NONE


def k_consistent(ci: tuple[float, float], ref: tuple[float, float] = K_43M[1:]) -> str:
    """k's 95 % interval against the 0.43M slope's: "consistent" where they overlap (the
    registered rule), "not consistent" where they do not; "unread" without an interval."""
    lo, hi = ci
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "unread (no interval)"
    return "consistent" if lo <= ref[1] and ref[0] <= hi else "not consistent"


# ---- the report (pure: gaps in, lines out) --------------------------------------------------

Cells = dict[tuple[int, float], dict[int, float]]  # (width, LR) -> seed -> paired gap


def missing_gaps(cells: Cells) -> list[str]:
    """The registered (width, LR, seed) gaps not in `cells`."""
    return [
        f"width {w} LR {lr:g} seed {s}"
        for w, lr, _ in CELLS
        for s in SEEDS
        if s not in cells.get((w, lr), {})
    ]


def table_lines(cells: Cells) -> list[str]:
    out = [
        f"{'width':>5} {'LR':>8} {'which':>6} {'N':>8} "
        + " ".join(f"{'gap s' + str(s):>8}" for s in SEEDS)
        + "  mean [95% CI]"
    ]
    for w, lr, which in CELLS:
        got = cells.get((w, lr), {})
        seeds = " ".join(f"{got[s]:+8.4f}" if s in got else f"{'-':>8}" for s in SEEDS)
        m, lo, hi = stats.t_interval(list(got.values())) if got else (math.nan,) * 3
        ci = f"[{lo:+.4f}, {hi:+.4f}]" if math.isfinite(lo) else "[no interval]"
        mean = f"{m:+.4f} {ci}" if got else "-"
        out.append(f"{w:>5} {lr:>8g} {which:>6} {WIDTHS[w]:>8,} {seeds}  {mean}")
    return out


def _said(left_out: tuple[Point, ...], what: str) -> str:
    if not left_out:
        return f"no {what} <= 0 left out"
    return f"left out ({what} <= 0): " + "; ".join(
        f"N {n:,} LR {lr:g} gap {g:+.4f}" for n, lr, g in left_out
    )


def _fit_text(f: Fit) -> str:
    (c_lo, c_hi), (k_lo, k_hi) = f.c_ci, f.k_ci
    return (
        f"a = {f.a:.3f}, c = {f.c:.3f} [{c_lo:.3f}, {c_hi:.3f}], k = {f.k:.3f} "
        f"[{k_lo:.3f}, {k_hi:.3f}] ({f.n} points, {f.df} residual df)"
    )


def analysis_lines(cells: Cells) -> list[str]:
    """The registered fit, its label, k's line, the per-seed check and the 96 -> 136 ratio,
    for a complete set of gaps."""
    assert not missing_gaps(cells), missing_gaps(cells)
    means = [
        (WIDTHS[w], lr, float(np.mean([cells[w, lr][s] for s in SEEDS]))) for w, lr, _ in CELLS
    ]
    primary = fit_held_lr(means)
    out = ["primary: ln g = a - c ln N + k ln LR, OLS over the 10 (width, LR) means of 3 seeds"]
    out.append("  " + _said(primary.left_out if primary else (), "mean gap"))
    if primary is None:
        out.append(f"  no fit: too few points with a mean gap > 0; label: {LABEL_NONE}")
        k_ci: tuple[float, float] = (math.nan, math.nan)
    else:
        out.append("  " + _fit_text(primary))
        c_lo, c_hi = primary.c_ci
        out.append(f"  c 95 % [{c_lo:.3f}, {c_hi:.3f}]: {label_c(primary.c_ci)}")
        k_ci = primary.k_ci
        k0, r_lo, r_hi = K_43M
        out.append(
            f"  k {primary.k:.3f} [{k_ci[0]:.3f}, {k_ci[1]:.3f}] beside the 0.43M slope {k0} "
            f"[{r_lo:.2f}, {r_hi:.2f}]: {k_consistent(k_ci)}"
        )
    per_seed = [(WIDTHS[w], lr, cells[w, lr][s]) for w, lr, _ in CELLS for s in SEEDS]
    check = fit_held_lr(per_seed)
    out.append("check (not labelled): the same fit on the 30 per-seed gaps > 0")
    out.append("  " + _said(check.left_out if check else (), "per-seed gap"))
    out.append("  " + (_fit_text(check) if check else "no fit: too few gaps > 0"))
    out.append(ratio_line(cells, primary))
    out.append(CAVEAT)
    return out


def ratio_line(cells: Cells, primary: Fit | None) -> str:
    """Width 96 -> 136 at the second-best LRs: the ratio of the mean gaps (Fieller's 95 %
    interval, seeds paired by index) beside (LR ratio)^k with k's interval."""
    lo_w, hi_w = RATIO_WIDTHS
    lr_a, lr_b = (float(LADDER_ADAMW_SECOND_LRS[w]) for w in RATIO_WIDTHS)
    best = float(LADDER_LRS["adamw", lo_w]) / float(LADDER_LRS["adamw", hi_w])
    step = lr_a / lr_b
    head = (
        f"width {lo_w} -> {hi_w} at the second-best LRs ({lr_a:g} -> {lr_b:g}, LR ratio "
        f"{step:.2f}x; {best:.2f}x at the best): "
    )
    g_a, g_b = cells[lo_w, lr_a], cells[hi_w, lr_b]
    m_a, m_b = float(np.mean(list(g_a.values()))), float(np.mean(list(g_b.values())))
    if not (m_a > 0 and m_b > 0):
        measured = f"measured ratio not read (mean gaps {m_a:+.4f}, {m_b:+.4f}: one <= 0)"
    else:
        share, s_lo, s_hi = scaling.fieller_share(g_b, g_a)  # 1 - mean g_a / mean g_b
        ci = f"[{1 - s_hi:.2f}, {1 - s_lo:.2f}]" if math.isfinite(s_lo) else "[unbounded]"
        measured = f"measured {m_a:.4f} / {m_b:.4f} = {1 - share:.2f}x {ci} (Fieller, seeds paired by index)"
    if primary is None or not math.isfinite(primary.k_ci[0]):
        return head + measured + "; no k to predict it from"
    k_lo, k_hi = primary.k_ci
    return (
        head + measured + f"; k predicts {step**primary.k:.2f}x [{step**k_lo:.2f}, "
        f"{step**k_hi:.2f}] from the LR change alone"
    )


def report(cells: Cells) -> tuple[list[str], bool]:
    """(the lines to print, whether all 30 gaps exist)."""
    missing = missing_gaps(cells)
    have = REGISTERED_GAPS - len(missing)
    lines = ["AdamW 2bw minus sync, paired by seed and LR, final whole-split loss, 1x tokens"]
    if missing:
        lines.append(
            f"incomplete: {have} of {REGISTERED_GAPS} paired gaps (missing: {', '.join(missing)})"
        )
        return lines + table_lines(cells), False
    return lines + table_lines(cells) + analysis_lines(cells), True


# ---- the records ----------------------------------------------------------------------------


def read_cells(roots: Sequence[Path]) -> Cells:
    """(width, LR) -> seed -> paired gap from the finished runs under `roots`: AdamW sync and
    2bw at the registered (width, LR) points, each width's 1x tokens (its shortest runs). A run
    found under two roots must have the same final loss; a run's N must be its rung's."""
    lrs = {(w, lr) for w, lr, _ in CELLS}
    runs = [
        r
        for root in roots
        for r in scaling.ladder_runs(Path(root))
        if r.optimizer == "adamw" and r.arm in ARMS and (r.width, r.lr) in lrs
    ]
    base: dict[int, int] = {}
    for r in runs:
        base[r.width] = min(base.get(r.width, r.tokens), r.tokens)
    finals: dict[tuple[int, float, str, int], float] = {}
    for r in runs:
        if r.params != WIDTHS[r.width]:
            raise UserError(f"width {r.width} has {r.params:,} parameters, not {WIDTHS[r.width]:,}")
        if r.tokens != base[r.width]:
            continue
        key = (r.width, r.lr, r.arm, r.seed)
        if key in finals and finals[key] != r.loss:
            raise UserError(
                f"two records of width {r.width} LR {r.lr:g} {r.arm} seed {r.seed} disagree: "
                f"{finals[key]} and {r.loss}"
            )
        finals[key] = r.loss
    cells: Cells = {}
    for (w, lr, arm, seed), loss in finals.items():
        if arm == "2bw" and (w, lr, "sync", seed) in finals and seed in SEEDS:
            cells.setdefault((w, lr), {})[seed] = loss - finals[w, lr, "sync", seed]
    return cells


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--best", default=BEST_ROOT, help="the size ladder's records (best LRs)")
    ap.add_argument("--second", default=SECOND_ROOT, help="ladder-adamw-lr2's records")
    ap.add_argument("--require-complete", action="store_true", help="exit 1 while a gap is missing")
    args = ap.parse_args(argv)
    lines, complete = report(read_cells([Path(args.best), Path(args.second)]))
    print("\n".join(lines))
    if args.require_complete and not complete:
        print("--require-complete: the registered 30 gaps are not all there", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
