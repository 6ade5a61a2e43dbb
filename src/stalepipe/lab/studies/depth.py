"""Study 4 (`depth`): PipeDream against 2bw over the pipeline's depth, and the claim it owns:
PipeDream's gap grows with depth while 2bw's stays flat (paper-mini tests it too)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from stalepipe.lab.analysis import stats
from stalepipe.lab.analysis.claims import Finding, regime_failure, scale_of, seed_gaps
from stalepipe.lab.analysis.stats import fmt, fmt_ci
from stalepipe.lab.studies.scales import SYNC, TWO_BW, base_config, optimizer_axis
from stalepipe.lab.studies.study import Study
from stalepipe.lab.sweeps.grid import Bundle, axis

if TYPE_CHECKING:
    from stalepipe.lab.analysis.results import Row


def _max_depth(scale: str) -> int:
    return base_config(scale).model.num_layers


def _depths(scale: str) -> list[int]:
    return [p for p in (2, 4, 8, 16) if p <= _max_depth(scale)]


def study_depth(scale: str) -> list[list[list[Bundle]]]:
    policies = [("pipedream", {"delay.policy": "pipedream"}), TWO_BW]
    opt = optimizer_axis(scale, ("adamw",) if scale == "cpu" else ("adamw", "muon"))
    return [[opt, [SYNC]], [opt, policies, axis("pipeline.num_stages", _depths(scale))]]


def claim_pipedream_gap_grows_with_depth(rows: list[Row]) -> list[Finding]:
    """Per optimizer: pipedream's gap rises with P (Spearman >= 0.8) while 2bw's (when there
    is a 2bw depth series) varies by less than a third of that rise; the test: the deepest
    gap. Unreadable with fewer than three depths (P = 1 counts: sync by definition): two
    points make any rank correlation +-1."""
    # here, not at the top: plots reads runs (analysis.results), and `sweep --help` imports
    # every study
    from stalepipe.lab.analysis import plots

    series = plots.gap_series(rows, "depth")
    out = []
    for name, pts in series.items():
        if " pipedream" not in name:
            continue
        rho = stats.spearman([x for x, _ in pts], [_gap(r) for _, r in pts])
        growth = _gap(pts[-1][1]) - _gap(pts[0][1])
        opt = name.split()[0]
        bw = next((v for k, v in series.items() if " 2bw" in k and k.split()[0] == opt), None)
        # no 2bw depth series: 2bw's staleness is 1 at every depth (one run shows it)
        bw_gaps = [_gap(r) for _, r in bw or []]
        flat = max(bw_gaps) - min(bw_gaps) if bw_gaps else math.nan
        ok = rho >= 0.8 and growth > 0 and (not math.isfinite(flat) or flat < growth / 3)
        depth, deepest = int(pts[-1][0]), pts[-1][1]
        out.append(
            Finding(
                f"PipeDream's gap grows with depth, 2bw's stays flat ({opt})",
                ok,
                deepest.gap.p,
                "pipedream: "
                + ", ".join(f"P={int(x)}: {fmt(_gap(r))}" for x, r in pts)
                + f" ({fmt_ci(deepest.gap)} at P={depth})"
                + (
                    "; 2bw: " + ", ".join(f"P={int(x)}: {fmt(_gap(r))}" for x, r in bw)
                    if bw
                    else ""
                )
                + f"; Spearman rho {rho:+.2f}",
                len(seed_gaps(deepest)),
                why=f"{len(pts)} depths" if len(pts) < 3 else "",
                partly=regime_failure(*(r for _, r in pts if r is not None)),
                scale=scale_of(deepest),
            )
        )
    return out


def _gap(row: Row | None) -> float:
    """A depth series' gap: P = 1 of pipedream is sync by definition (no row, gap 0)."""
    return 0.0 if row is None else row.gap_diff


STUDY = Study(
    name="depth",
    grids=study_depth,
    about="pipedream vs 2bw for P in 2-16 (AdamW, + Muon beyond cpu)",
    order=40,
    claims=(claim_pipedream_gap_grows_with_depth,),
)
