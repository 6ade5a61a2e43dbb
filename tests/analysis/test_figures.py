"""The report's figures show every configuration of a sweep (issue 34): no panel limit."""

from stalepipe.lab.analysis.results import build_rows, load_runs

from .test_report import BW, SYNC, make_run


def test_figures_show_every_configuration(tmp_path):
    """Every sync baseline gets a loss-curve panel holding each configuration compared with it,
    and every delayed configuration with a token overhead gets an overhead panel: nothing is
    cut at a panel limit (24 baselines here, more than the old limit of 18)."""
    from stalepipe.lab.analysis import plots

    root = tmp_path / "many"
    for lr in range(24):
        o = {"optim.lr": f"{1e-3 * (lr + 1):.4g}"}
        for s in range(2):
            make_run(root, f"lr{lr}_sync_s{s}", {**o, **SYNC}, s, 2.0 + 0.01 * s)
            make_run(root, f"lr{lr}_2bw_s{s}", {**o, **BW}, s, 2.3 + 0.01 * s)
    rows = build_rows(load_runs(root))
    panels = plots.loss_curve_panels(rows)
    baselines = [r for r in rows if r.is_sync]
    assert len(panels) == len(baselines) == 24
    assert sum(len(m) for m in panels.values()) == len(rows)  # each configuration once
    delayed = [r for r in rows if not r.is_sync]
    assert plots.overhead_panels(rows) == [r for r in delayed if r.token_overhead is not None]
    assert plots.loss_curves(rows)[:4] == b"\x89PNG"


def test_final_loss_against_planned_length(curve_sweep, tmp_path):
    """Complete runs at several lengths: per delayed configuration its final losses by seed and
    length (x sync's 1x), beside sync's; drawn, and in the report."""
    from stalepipe.lab.analysis.lengths import length_plot, length_series
    from stalepipe.lab.analysis.report import write_report

    rows = build_rows(load_runs(curve_sweep))
    series = {row.label: (d, s) for row, d, s in length_series(rows)}
    assert set(series) == {"adamw_2bw", "adamw_2bw+ef"}
    delayed, sync = series["adamw_2bw+ef"]
    assert sorted(delayed.points) == [1.0, 1.1, 1.2, 1.35, 1.5]
    assert all(len(by_seed) == 3 for by_seed in delayed.points.values())
    assert list(sync.points) == [1.0] and len(sync.points[1.0]) == 3
    # longer runs end lower; the band holds the mean
    band = delayed.band()
    assert all(b[1] < a[1] for a, b in zip(band, band[1:]))
    assert all(lo <= m <= hi for _, m, lo, hi in band)
    assert (length_plot(rows) or b"")[:4] == b"\x89PNG"
    write_report(curve_sweep, tmp_path / "report")
    assert (tmp_path / "report" / "final_loss_vs_length.png").exists()
