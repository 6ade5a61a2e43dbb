"""The report's figures show every configuration of a sweep (issue 34): no panel limit."""

from stalepipe.analysis.results import build_rows, load_runs

from .test_report import BW, SYNC, make_run


def test_figures_show_every_configuration(tmp_path):
    """Every sync baseline gets a loss-curve panel holding each configuration compared with it,
    and every delayed configuration with a token overhead gets an overhead panel: nothing is
    cut at a panel limit (24 baselines here, more than the old limit of 18)."""
    from stalepipe.analysis import plots

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
