"""Study 2 (`momentum`): AdamW's and Muon's beta1 under sync and 2bw, and the claim it owns:
higher momentum shrinks the gap (paper-mini tests it too)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from stalepipe.lab.analysis import stats
from stalepipe.lab.analysis.claims import Finding, regime_failure, scale_of, seed_gaps
from stalepipe.lab.analysis.stats import fmt, fmt_ci
from stalepipe.lab.studies.scales import SYNC, TWO_BW, lr_axis, optimizer_axis
from stalepipe.lab.studies.study import Study
from stalepipe.lab.sweeps.grid import Bundle, axis

if TYPE_CHECKING:
    from stalepipe.lab.analysis.results import Row

MOMENTA = ("0.8", "0.9", "0.95", "0.98")


def study_momentum(scale: str) -> list[list[list[Bundle]]]:
    if scale == "cpu":  # the LR held at each optimizer's (docs/RESULTS.md, Claim 3)
        opt2 = optimizer_axis(scale, ("adamw", "muon"))
        return [[opt2, axis("optim.beta1", MOMENTA), [SYNC, TWO_BW]]]
    # each momentum at three LRs, so the gap is read at each momentum's own best LR
    return [
        [
            optimizer_axis(scale, (name,)),
            axis("optim.beta1", MOMENTA),
            lr_axis(scale, name),
            [SYNC, TWO_BW],
        ]
        for name in ("adamw", "muon")
    ]


def claim_momentum_shrinks_gap(rows: list[Row]) -> list[Finding]:
    """Per beta1 series of at least 3 points: the gap falls with beta1 (Spearman <= -0.8); the
    test: the gap at the highest beta1 against the lowest, per seed. Where the LR was swept
    too, each beta1 is read at its best LR on sync."""
    # here, not at the top: plots reads runs (analysis.results), and `sweep --help` imports
    # every study
    from stalepipe.lab.analysis import plots

    out = []
    for name, pts in plots.gap_series(rows, "momentum").items():
        if len(pts) < 3:
            continue
        gaps = [r.gap_diff for _, r in pts]
        lrs = {r.config.get("optim.lr") for _, r in pts}  # retuned per beta1 (plots._TUNED_KEYS)
        at = {b: f" (lr {r.config.get('optim.lr'):g})" if len(lrs) > 1 else "" for b, r in pts}
        rho = stats.spearman([b for b, _ in pts], gaps)
        first, last = seed_gaps(pts[0][1]), seed_gaps(pts[-1][1])
        test = stats.seed_difference(last, first)
        # a baseline that moves more than the gap changes it without the delay: a confound;
        # so is an LR retuned per beta1 (the gap moves with the LR)
        syncs = [r.baseline.mean for _, r in pts if r.baseline is not None]
        drift = max(syncs) - min(syncs) if syncs else math.inf
        named = {
            "sync moves more than the gap": drift >= abs(gaps[0] - gaps[-1]),
            "the LR moves with beta1": len(lrs) > 1,
        }
        confound = "; ".join(why for why, on in named.items() if on)
        out.append(
            Finding(
                f"Higher momentum shrinks the gap ({name})",
                rho <= -0.8,
                test.p,
                ", ".join(f"beta1 {b:g}{at[b]}: {fmt(r.gap_diff)}" for b, r in pts)
                + f"; Spearman rho {rho:+.2f}; last - first {fmt(test.diff)} {fmt_ci(test)}"
                f"; sync {fmt(min(syncs, default=math.nan))}-{fmt(max(syncs, default=math.nan))}",
                min(len(first), len(last)),
                partly=regime_failure(*(r for _, r in pts)),
                confound=confound,
                scale=scale_of(pts[0][1]),
            )
        )
    return out


STUDY = Study(
    name="momentum",
    grids=study_momentum,
    about="AdamW & Muon beta1 in 0.8-0.98 under sync and 2bw (x 3 LRs beyond cpu)",
    order=20,
    claims=(claim_momentum_shrinks_gap,),
)
