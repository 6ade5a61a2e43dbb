"""Study 6 (`delay`): a uniform delay of N steps (fixed:N; 2bw is N = 1), and the claim it owns:
a longer delay costs more, the premise of 2bw's constant delay of one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stalepipe.lab.analysis import stats
from stalepipe.lab.analysis.claims import Finding, regime_failure, scale_of, seed_gaps
from stalepipe.lab.analysis.stats import fmt, fmt_ci
from stalepipe.lab.studies.scales import SYNC, TWO_BW, optimizer_axis
from stalepipe.lab.studies.study import Study
from stalepipe.lab.sweeps.grid import Bundle

if TYPE_CHECKING:
    from stalepipe.lab.analysis.results import Row


def study_delay(scale: str) -> list[list[list[Bundle]]]:
    # N = 1 is 2bw's run: fixed:1 is the same trajectory bit for bit (tests/delay), so the
    # study shares study 1's 2bw arm instead of training it again under another name
    delays = [(f"fixed{n}", {"delay.policy": f"fixed:{n}"}) for n in (2, 4, 8)]
    return [[optimizer_axis(scale, ("adamw", "muon")), [SYNC, TWO_BW, *delays]]]


def claim_gap_grows_with_delay(rows: list[Row]) -> list[Finding]:
    """Per optimizer: the gap of a uniform delay of N steps (fixed:N, 2bw as N = 1) rises with
    N (Spearman >= 0.8 and the longest delay's gap above the shortest's); the test: the
    longest delay's gap. Unreadable with fewer than three delays."""
    # here, not at the top: plots reads runs (analysis.results), and `sweep --help` imports
    # every study
    from stalepipe.lab.analysis import plots

    out = []
    for name, pts in plots.gap_series(rows, "delay").items():
        rho = stats.spearman([x for x, _ in pts], [r.gap_diff for _, r in pts])
        longest = pts[-1][1]
        out.append(
            Finding(
                f"A longer delay costs more ({name})",
                rho >= 0.8 and longest.gap_diff > pts[0][1].gap_diff,
                longest.gap.p,
                ", ".join(f"N={int(x)}: {fmt(r.gap_diff)}" for x, r in pts)
                + f" ({fmt_ci(longest.gap)} at N={int(pts[-1][0])}); Spearman rho {rho:+.2f}",
                len(seed_gaps(longest)),
                why=f"{len(pts)} delays" if len(pts) < 3 else "",
                partly=regime_failure(*(r for _, r in pts)),
                scale=scale_of(longest),
            )
        )
    return out


STUDY = Study(
    name="delay",
    grids=study_delay,
    about="sync, 2bw (N = 1) and fixed:N for N in 2, 4, 8",
    order=60,
    claims=(claim_gap_grows_with_delay,),
)
