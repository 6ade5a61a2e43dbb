"""The overhead ladder's registered analysis (analysis/overhead_ladder.py, docs/RESULTS.md
'Overhead ladder') on synthetic ladders whose truth is known: a delayed run at length f ends
where sync would end at f / o, so the overhead read from complete runs is o."""

from __future__ import annotations

import math
import random

import pytest

from stalepipe.lab.analysis import overhead_ladder as ol
from stalepipe.lab.analysis.scaling import LadderRun

WIDTHS = {48: 101_808, 64: 197_184, 96: 406_368, 136: 849_864}
BASE = 1_400 * 2_048
SLOPE = 0.05  # sync's -dL/d ln D


def _runs(overhead, seeds=3, noise=0.0, skip=()) -> list[LadderRun]:
    """Sync at 1x and 1.2x and both arms at the registered lengths, every width and seed;
    `overhead(n, arm)` the truth, `noise` the sd of ln o between seeds."""
    rng = random.Random(0)
    out = []
    for width, n in WIDTHS.items():
        for seed in range(seeds):
            l0 = 2.0 - 0.1 * math.log(n / 1e5)
            for f in ol.LENGTHS:
                if f in (1.0, ol.SYNC_SLOPE_LENGTH):
                    out.append(_run("sync", width, n, seed, f, l0 - SLOPE * math.log(f)))
            for arm in ol.ARMS:
                o = overhead(n, arm) * math.exp(rng.gauss(0, noise))
                for f in ol.LENGTHS:
                    if (width, seed, arm, f) not in skip:
                        out.append(_run(arm, width, n, seed, f, l0 - SLOPE * math.log(f / o)))
    return out


def _run(arm, width, n, seed, f, loss) -> LadderRun:
    return LadderRun("muon", arm, width, n, 0.01, seed, round(BASE * f), loss)


def test_the_overhead_is_read_where_the_final_losses_cross_and_bounds_are_named():
    runs = _runs(lambda n, arm: {"2bw": 1.25, "2bw+ef": 0.9}[arm] if n < 800_000 else 1.7)
    got = {(p.n, p.seed, "2bw"): p for p in ol.seed_overheads(runs, "2bw")}
    assert got[101_808, 0, "2bw"].overhead == pytest.approx(1.25, rel=1e-9)
    assert got[101_808, 0, "2bw"].bound == ""
    ef = {(p.n, p.seed): p for p in ol.seed_overheads(runs, "2bw+ef")}
    assert ef[101_808, 1].overhead == 1.0 and ef[101_808, 1].bound == "<="  # already there
    assert ef[849_864, 2].overhead == 1.5 and ef[849_864, 2].bound == ">="  # not by 1.5x
    fit = ol.fit_overheads(ol.seed_overheads(runs, "2bw+ef"))
    assert fit.censored == 12 and ol.label(fit, 0.5).startswith("inconclusive (censored")


def test_an_incomplete_seed_gives_no_point():
    runs = _runs(lambda n, arm: 1.1, skip={(96, 1, "2bw", 1.5)})
    points = {(p.n, p.seed) for p in ol.seed_overheads(runs, "2bw")}
    assert (406_368, 1) not in points and len(points) == 11


@pytest.mark.parametrize(
    ("beta", "noise", "want"),
    [
        (0.0, 0.01, "flat within +-0.05"),
        (-0.1, 0.01, "the overhead shrinks with size"),
        (0.1, 0.01, "grows with size"),
        (0.0, 0.1, "inconclusive"),
    ],
)
def test_the_fit_recovers_the_slope_and_labels_it_as_registered(beta, noise, want):
    runs = _runs(lambda n, arm: 1.2 * (n / 406_368) ** beta, noise=noise)
    fits = {arm: ol.fit_overheads(ol.seed_overheads(runs, arm)) for arm in ol.ARMS}
    assert fits["2bw"].n_points == 12 and fits["2bw"].df == 10
    if noise < 0.05:
        assert fits["2bw"].beta == pytest.approx(beta, abs=0.02)
    assert all(words == want for _, words in ol.labels(fits).values()), ol.labels(fits)


def test_the_360m_prediction_and_its_reading():
    runs = _runs(lambda n, arm: 1.05, noise=0.001)
    fit = ol.fit_overheads(ol.seed_overheads(runs, "2bw+ef"))
    o, lo, hi = ol.predict(fit)
    assert lo < o < hi and o == pytest.approx(1.05, rel=0.01) and math.log(hi / lo) < 0.2
    assert ol.against_paper(lo, hi, "2bw+ef") == "a miss"  # the paper implies 1.025-1.040
    assert ol.against_paper(1.02, 1.05, "2bw+ef") == "agrees"
    assert ol.against_paper(1.0, 1.3, "2bw") == "inconclusive (too wide)"
    p_lo, p_hi = ol.paper_overheads("2bw")
    assert (round(p_lo, 3), round(p_hi, 3)) == (1.062, 1.099)  # as RESULTS.md registered


def test_gap_equals_slope_times_log_overhead_where_the_curves_are_shifted():
    runs = _runs(lambda n, arm: 1.12, noise=0.02)
    rel = ol.slope_relation(runs, "2bw")
    assert [r.label for r in rel] == [f"N={n:,} 2bw" for n in sorted(WIDTHS.values())]
    for r in rel:
        assert r.holds and r.implied == pytest.approx(r.measured, rel=1e-6), r


def test_the_report_sets_the_implied_overhead_beside_the_measured_one():
    """On the committed lengths study (0.43M, 5 seeds, sync and Muon at 1-1.5x): the report's
    table of gap = sync slope x ln(overhead), as RESULTS.md quotes it."""
    from pathlib import Path

    from stalepipe.lab.analysis import lengths
    from stalepipe.lab.analysis.report import _relation_blocks
    from stalepipe.lab.analysis.results import build_rows, load_runs

    root = Path(__file__).resolve().parents[2] / "docs" / "results" / "lengths-regime"
    rows = build_rows(load_runs(root))
    blocks = _relation_blocks(rows)
    got = {r.label: r.describe() for r in lengths.slope_relations(rows)}
    assert got == {
        "muon_2bw": "implied 1.338, measured 1.275 [1.212, 1.338] (5 seeds): holds",
        "muon_2bw+ef": "implied 1.122, measured 1.104 [1.041, 1.166] (5 seeds): holds",
    }
    assert any(b.text == "Gap = sync slope x ln(token overhead)" for b in blocks)


def test_sync_slope_is_the_two_point_slope_with_two_lengths():
    from stalepipe.lab.analysis.targets import implied_overhead, sync_slope

    s = sync_slope({1.0: 2.0, 1.2: 2.0 - 0.05 * math.log(1.2)})
    assert s == pytest.approx(0.05)
    assert implied_overhead(s, 0.05 * math.log(1.1)) == pytest.approx(1.1)
    assert math.isnan(implied_overhead(-0.01, 0.01))  # sync got worse with length


def test_results_quotes_the_adamw_lr_share_as_the_script_prints_it():
    """docs/RESULTS.md's AdamW-LR block is the script's output on the committed records."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks/studies/adamw_lr_share.py")],
        capture_output=True, text=True, cwd=root, check=True, timeout=300,
    ).stdout  # fmt: skip
    results = (root / "docs" / "RESULTS.md").read_text()
    assert out.strip() and all(line in results for line in out.splitlines()), out
    assert "predicts 87-97 % of it" in out


def test_results_quotes_the_staleness_probes_as_the_script_prints_them():
    """docs/RESULTS.md's staleness block is benchmarks/studies/staleness_probe.py's reading of
    the committed probes and ladder records, line for line (a probe or record added without the
    docs rerun fails), and every committed probe is its run's exact prefix."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks/studies/staleness_probe.py"), "--no-plot"],
        capture_output=True, text=True, cwd=root, check=True, timeout=300,
    ).stdout  # fmt: skip
    results = (root / "docs" / "RESULTS.md").read_text().splitlines()
    missing = [line for line in out.splitlines() if line not in results]
    assert out.strip() and not missing, missing[:3]
    probes = sorted((root / "docs/results/staleness-probe").glob("*/*.json"))
    assert len(probes) >= 26 and all(json.loads(p.read_text())["exact"] for p in probes)
