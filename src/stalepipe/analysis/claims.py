"""The paper's qualitative claims, one function each, checked on a report's rows.

A claim function takes the rows of `results.build_rows` and returns its verdicts as
`(claim, verdict, evidence)` triples: none when the configurations it needs are absent, several
when it checks one series each (momentum per optimizer, depth per optimizer). The study that
tests a claim names its function (`experiments.studies.Study.claims`); `report.claims` runs
every one in `CLAIMS` on whatever rows exist.

This module is imported by `studies`, which `stalepipe --help` imports: `plots` (which imports
torch through `stalepipe.delay`) is imported inside the functions that need it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stalepipe.analysis import stats

if TYPE_CHECKING:
    from stalepipe.analysis.results import Row

Claim = tuple[str, str, str]  # (claim, verdict, evidence)
ClaimCheck = Callable[[list["Row"]], list[Claim]]


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


# ------------------------------------------------------------------------------------------
# AdamW's gap is much larger than Muon's
# ------------------------------------------------------------------------------------------


def _defaults(optimizer: str) -> Any:
    """The optimizer's resolved default OptimConfig."""
    from stalepipe.config import OptimConfig
    from stalepipe.optim import resolve_config

    return resolve_config(OptimConfig(name=optimizer))


def _main_row(rows: list[Row], optimizer: str) -> Row | None:
    """The optimizer's unmitigated 2bw row at its defaults (P = 1, the study's main training
    length and batch size, the most common ones) and at the LR most of its runs use; ties (an
    even LR grid) go to the LR with the best synchronous loss."""

    def most_common(key: str) -> Any:
        top = Counter(r.config.get(key) for r in rows).most_common(1)
        return top[0][0] if top else None

    d = _defaults(optimizer)
    eq = {"pipeline.num_stages": 1, "train.num_steps": most_common("train.num_steps"),
          "train.batch_size": most_common("train.batch_size"), "optim.beta1": d.beta1,
          "optim.beta2": d.beta2, "optim.weight_decay": d.weight_decay}  # fmt: skip
    lrs = Counter(r.config.get("optim.lr") for r in rows if r.config.get("optim.name") == optimizer)
    top = [lr for lr, n in lrs.items() if n == max(lrs.values())]

    def sync_loss(lr: object) -> float:
        c = {**eq, "optim.name": optimizer, "optim.lr": lr}
        return min(
            (r.mean for r in rows if r.is_sync and r.values
             and all(r.config.get(k) == v for k, v in c.items())),
            default=math.inf,
        )  # fmt: skip

    lr = min(top, key=lambda v: (sync_loss(v), str(v))) if top else None
    want = {**eq, "optim.lr": lr}
    for r in rows:
        if r.is_sync or r.mitigations or not math.isfinite(r.gap):
            continue
        c = r.config
        if (
            c.get("optim.name") == optimizer
            and r.policy == "2bw"
            and all(c.get(k) == v for k, v in want.items())
        ):
            return r
    return None


def claim_adamw_gap_exceeds_muon(rows: list[Row]) -> list[Claim]:
    """AdamW's 2bw gap at least twice Muon's; 'partly' when AdamW's gap is not significant."""
    adam, muon = _main_row(rows, "adamw"), _main_row(rows, "muon")
    if not (adam and muon):
        return []
    ratio = adam.gap / muon.gap if muon.gap > 0 else math.inf
    larger = adam.gap > 0 and ratio >= 2
    significant = adam.gap_p < 0.05  # NaN (one seed) is not significant
    return [(
        "AdamW's gap (2bw) is much larger than Muon's",
        ("reproduced" if significant else "partly") if larger else "not reproduced",
        f"AdamW {fmt(adam.gap)} (p {fmt_p(adam.gap_p)}), Muon {fmt(muon.gap)} "
        f"(p {fmt_p(muon.gap_p)}); ratio {ratio:.1f}x",
    )]  # fmt: skip


# ------------------------------------------------------------------------------------------
# Error feedback recovers most of each gap
# ------------------------------------------------------------------------------------------


def claim_ef_recovers_gap(rows: list[Row]) -> list[Claim]:
    """Every EF-only row recovers more than half of its unmitigated gap."""
    ef = [r for r in rows if r.mitigations.keys() == {"delay.ef"} and math.isfinite(r.recovered)]
    if not ef:
        return []
    most = [r.recovered > 0.5 for r in ef]
    verdict = "reproduced" if all(most) else ("partly" if any(most) else "not reproduced")
    return [(
        "Error feedback recovers most of each gap",
        verdict,
        "; ".join(f"{r.label}: {fmt_share(r.recovered)} of {fmt(r.unmitigated.gap)}"
                  for r in ef),
    )]  # fmt: skip


# ------------------------------------------------------------------------------------------
# Higher momentum shrinks the gap
# ------------------------------------------------------------------------------------------


def claim_momentum_shrinks_gap(rows: list[Row]) -> list[Claim]:
    """Per beta1 series of at least 3 points: the gap falls with beta1 (Spearman <= -0.8).
    Where the LR was swept too, each beta1 is read at its best LR on sync."""
    from stalepipe.analysis import plots

    out = []
    for name, pts in plots.gap_series(rows, "momentum").items():
        if len(pts) < 3:
            continue
        gaps = [r.gap for _, r in pts]
        lrs = {r.config.get("optim.lr") for _, r in pts}  # retuned per beta1 (plots._TUNED_KEYS)
        at = {b: f" (lr {r.config.get('optim.lr'):g})" if len(lrs) > 1 else "" for b, r in pts}
        rho = stats.spearman([b for b, _ in pts], gaps)
        # Shrinking counts only if every gap is real and the synchronous baseline moves less
        # than the gap does (a baseline that gets worse shrinks the gap without helping).
        significant = all(r.gap_p < 0.05 for _, r in pts)
        syncs = [r.baseline.mean for _, r in pts if r.baseline is not None]
        drift = max(syncs) - min(syncs) if syncs else math.inf
        clean = significant and drift < gaps[0] - gaps[-1]
        verdict = ("reproduced" if clean else "partly") if rho <= -0.8 else "not reproduced"
        out.append((
            f"Higher momentum shrinks the gap ({name})",
            verdict,
            ", ".join(f"beta1 {b:g}{at[b]}: {fmt(r.gap)} (p {fmt_p(r.gap_p)})" for b, r in pts)
            + f"; Spearman rho {rho:+.2f}; sync {fmt(min(syncs, default=math.nan))}"
            f"-{fmt(max(syncs, default=math.nan))}",
        ))  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------
# PipeDream's gap grows with depth, 2bw's stays flat
# ------------------------------------------------------------------------------------------


def claim_pipedream_gap_grows_with_depth(rows: list[Row]) -> list[Claim]:
    """Per optimizer: pipedream's gap rises with P (Spearman >= 0.8) while 2bw's (when there
    is a 2bw depth series) varies by less than a third of that rise. Inconclusive with fewer
    than three depths (P = 1 counts: sync by definition), fewer than 3 seeds at the deepest
    P, or a deepest gap with p >= 0.05: two points make any rank correlation +-1."""
    from stalepipe.analysis import plots

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
        why = _trend_inconclusive(pts, "depths", f"P={depth}")
        out.append((
            f"PipeDream's gap grows with depth, 2bw's stays flat ({opt})",
            ("reproduced" if ok else "not reproduced") if not why else f"inconclusive ({why})",
            "pipedream: " + ", ".join(f"P={int(x)}: {fmt(_gap(r))}" for x, r in pts)
            + f" (p {fmt_p(deepest.gap_p)} at P={depth})"
            + ("; 2bw: " + ", ".join(f"P={int(x)}: {fmt(_gap(r))}" for x, r in bw) if bw else "")
            + f"; Spearman rho {rho:+.2f}",
        ))  # fmt: skip
    return out


def _gap(row: Row | None) -> float:
    """A depth series' gap: P = 1 of pipedream is sync by definition (no row, gap 0)."""
    return 0.0 if row is None else row.gap


def _trend_inconclusive(pts: list[tuple[float, Row | None]], points: str, at: str) -> str:
    """Why a rising-gap trend cannot be read ("" when it can): fewer than three points (two
    rank +-1 whatever they are), fewer than 3 seeds at the last point, or a last gap with
    p >= 0.05."""
    last = pts[-1][1]
    if len(pts) < 3:
        return f"{len(pts)} {points}"
    if len(last.values) < 3:
        return f"{len(last.values)} seeds at {at}"
    return f"p {fmt_p(last.gap_p)} at {at}" if not last.gap_p < 0.05 else ""


# ------------------------------------------------------------------------------------------
# A longer delay costs more (fixed:N; 2bw is N = 1)
# ------------------------------------------------------------------------------------------


def claim_gap_grows_with_delay(rows: list[Row]) -> list[Claim]:
    """Per optimizer: the gap of a uniform delay of N steps (fixed:N, 2bw as N = 1) rises with
    N (Spearman >= 0.8 and the longest delay's gap above the shortest's). Inconclusive with
    fewer than three delays, fewer than 3 seeds at the longest or its gap with p >= 0.05."""
    from stalepipe.analysis import plots

    out = []
    for name, pts in plots.gap_series(rows, "delay").items():
        rho = stats.spearman([x for x, _ in pts], [r.gap for _, r in pts])
        longest = int(pts[-1][0])
        why = _trend_inconclusive(pts, "delays", f"N={longest}")
        ok = rho >= 0.8 and pts[-1][1].gap > pts[0][1].gap
        out.append((
            f"A longer delay costs more ({name})",
            ("reproduced" if ok else "not reproduced") if not why else f"inconclusive ({why})",
            ", ".join(f"N={int(x)}: {fmt(r.gap)} (p {fmt_p(r.gap_p)})" for x, r in pts)
            + f"; Spearman rho {rho:+.2f}",
        ))  # fmt: skip
    return out


# Every claim, in the order the report's claims table lists them; each study names the ones its
# runs test (`experiments.studies.Study.claims`).
CLAIMS: tuple[ClaimCheck, ...] = (
    claim_adamw_gap_exceeds_muon,
    claim_ef_recovers_gap,
    claim_momentum_shrinks_gap,
    claim_pipedream_gap_grows_with_depth,
    claim_gap_grows_with_delay,
)
