"""The overhead ladder's table, fit, tests and 360M prediction (issue 51; the analysis
docs/RESULTS.md registered before the runs, `stalepipe.lab.analysis.overhead_ladder`), from the
sweep's run records.

    python benchmarks/studies/overhead_ladder_fit.py                         # docs/results/overhead-ladder
    python benchmarks/studies/overhead_ladder_fit.py runs/overhead-ladder    # a sweep in progress

Every number is a run's final loss on the whole validation split (`val_loss_full`). Per width
and seed whose runs are complete: Muon 2bw's and 2bw+EF's token overhead at sync's 1x final
loss ("<=" an upper bound: already there at 1x; ">=" a lower bound: not there by 1.5x). Then,
per arm, the slope of ln(overhead) on ln(N), its tests and the prediction for one 360M run
held to the overheads the paper's gaps imply; and the relation gap = sync slope x ln(overhead)
at each width. Before every width has its 3 seeds the reading is printed as interim.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stalepipe.lab.analysis import overhead_ladder as ol
from stalepipe.lab.analysis import scaling

REGISTERED_POINTS = 12  # 4 widths x 3 seeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default="docs/results/overhead-ladder")
    args = ap.parse_args()
    runs = scaling.ladder_runs(Path(args.root))
    print(f"overhead ladder: {len(runs)} finished runs under {args.root}")
    points = {arm: ol.seed_overheads(runs, arm) for arm in ol.ARMS}
    _table(points)
    fits = {arm: f for arm, p in points.items() if (f := ol.fit_overheads(p)) is not None}
    if not fits:
        print("no fit yet: it needs 3 complete seeds or more, over 2 widths or more")
        return
    for arm, (holm_p, words) in ol.labels(fits).items():
        _fit_lines(arm, fits[arm], holm_p, words, len(points[arm]))
    print("gap = sync slope x ln(overhead), per width (mean of seeds; holds: inside the 95 % "
          "interval of the measured overhead)")  # fmt: skip
    for arm in ol.ARMS:
        for r in ol.slope_relation(runs, arm):
            print(f"  {r.label}: {r.describe()}")


def _table(points: dict[str, list[ol.SeedOverhead]]) -> None:
    rows = sorted({(p.n, p.seed) for ps in points.values() for p in ps})
    print(f"{'N':>9} {'seed':>4} " + " ".join(f"{arm:>10}" for arm in ol.ARMS))
    for n, seed in rows:
        cells = []
        for arm in ol.ARMS:
            got = [p for p in points[arm] if (p.n, p.seed) == (n, seed)]
            cells.append(f"{got[0].bound}{got[0].overhead:.3f}" if got else "-")
        print(f"{n:>9,} {seed:>4} " + " ".join(f"{c:>10}" for c in cells))


def _fit_lines(arm: str, fit: ol.OverheadFit, holm_p: float, words: str, have: int) -> None:
    lo95, hi95 = fit.interval(0.95)
    lo90, hi90 = fit.interval(0.90)
    interim = "" if have >= REGISTERED_POINTS else f" [interim: {have} of 12 points]"
    print(
        f"muon {arm}: beta {fit.beta:+.4f} [{lo95:+.4f}, {hi95:+.4f}] (90 %: [{lo90:+.4f}, "
        f"{hi90:+.4f}]), p {fit.p:.3g}, Holm p {holm_p:.3g}, {fit.censored} of {fit.n_points} "
        f"bounds: {words}{interim}"
    )
    o, lo, hi = ol.predict(fit)
    p_lo, p_hi = ol.paper_overheads(arm)
    print(
        f"  one run at 360M: {o:.3f}x [{lo:.3f}, {hi:.3f}]; the paper's {ol.PAPER_GAPS[arm]} "
        f"implies [{p_lo:.3f}, {p_hi:.3f}]: {ol.against_paper(lo, hi, arm)}"
    )


if __name__ == "__main__":
    main()
