"""Interval honesty (issue 52, item 4): one label per time-to-target interval, the printed
interval the one the verdict was called on, the stacked corners named a bound, the token
overhead's transfer to the target size a term of it (a stated default, or the overhead
ladder's prediction interval), and Ethernet presets at Ethernet's link efficiency."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from stalepipe.lab.sim.cluster import CLUSTERS, link_efficiency_range
from stalepipe.lab.verdict.rule import (
    BOUND,
    CI,
    TRANSFER_SLOPE,
    Ratio,
    Transfer,
    Verdict,
    at_size,
    default_transfer,
    widen,
)

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "docs" / "results" / "lengths-regime"


def test_the_default_transfer_is_the_stated_slope_over_the_e_folds():
    t = default_transfer(406_368, 314_635_200, "0.41M", "315M")
    e = TRANSFER_SLOPE * math.log(314_635_200 / 406_368)
    assert (t.low, t.high) == pytest.approx((math.exp(-e), math.exp(e)))
    assert t.low == pytest.approx(0.717, abs=1e-3) and t.high == pytest.approx(1.394, abs=1e-3)
    assert "0.41M -> 315M: x0.72-1.39 (default" in t.text()
    assert default_transfer(1e6, 1e6, "", "").none and default_transfer(1e6, 0, "", "").none


def _verdict(value: float, edge: float, transfer: Transfer, factors=(1.0, 1.0)) -> Verdict:
    best = SimpleNamespace(name="zb-v", tokens_per_s=1.0)
    v = Verdict("arm", "sync", "2bw", None, 0.0, edge, best)  # type: ignore[arg-type]
    v.ratios["zb-v"] = Ratio(value, value * 0.97, value * 1.03)
    v.edge_factors, v.transfer = factors, transfer
    return v


def test_the_label_says_what_entered_the_interval():
    assert _verdict(1.1, 1.0, Transfer()).interval_kind == CI
    assert _verdict(1.1, 1.0, Transfer(), (0.95, 1.05)).interval_kind == BOUND
    assert _verdict(1.1, 1.0, Transfer(0.9, 1.1)).interval_kind == BOUND
    v = _verdict(1.3, 1.0, Transfer(0.9, 1.2), (0.95, 1.05))
    r = v.ratio_all  # every term at the corner that moves the ratio most
    assert (r.low, r.high) == pytest.approx((1.3 * 0.97 * 0.9 / 1.05, 1.3 * 1.03 * 1.2 / 0.95))
    assert widen(v.ratio, *v.edge_factors, v.transfer) == r


def test_the_transfer_never_takes_the_overhead_below_one():
    """An overhead is at least 1 (a delayed run already at sync's loss reads 1.0), so the
    transfer's low end stops there: at an edge below 1, sync is sooner at every size."""
    v = _verdict(1.1 / 0.937, 0.937, Transfer(0.55, 1.83, "0.41M", "68.5B"), (0.99, 1.004))
    r = v.ratio_all
    assert r.low == pytest.approx(1 / 0.937 / 1.004)  # an overhead of 1 at the highest edge
    assert r.high == pytest.approx(1.1 / 0.937 * 1.03 * 1.83 / 0.99)
    assert r.low > 1  # what the call reads: sync sooner, not "inconclusive at the target size"
    holds = "too close to call (interval holds 1)"
    assert at_size(_verdict(1.05, 0.99, Transfer(0.5, 2.0, "a", "b")), holds) == holds


def test_a_transfer_that_alone_spans_the_flip_point_leaves_it_open_at_the_target_size():
    holds = "too close to call (interval holds 1)"
    v = _verdict(0.95, 1.159, Transfer(0.72, 1.39, "0.41M", "315M"), (0.92, 1.06))
    call = at_size(v, holds)
    assert call.startswith("inconclusive at the target size")
    assert "at 315M is below 1.066x, sync sooner above 1.229x" in call
    # the transfer alone does not span it (0.95 x [0.99, 1.02] < 1): a near tie, as before
    assert at_size(_verdict(0.95, 1.1, Transfer(0.99, 1.02, "a", "b")), holds) == holds
    assert at_size(v, "sync sooner") == "sync sooner"  # a call made is left as it is


def test_ethernet_presets_use_roce_s_efficiency_and_its_range():
    assert CLUSTERS["h100-ib"].link_efficiency == 0.92
    assert link_efficiency_range(CLUSTERS["h100-ib"]) == pytest.approx((0.75, 0.96))
    for name in ("h100-eth100", "h100-eth25", "h100-pcie"):
        c = CLUSTERS[name]
        assert c.link_efficiency == 0.75  # NVIDIA/nccl issue 495: ~600 of 800 Gb/s on RoCE
        lo, hi = link_efficiency_range(c)
        assert lo < 0.75 < hi < 0.8


def _decision_rows(preset: str) -> dict[str, tuple[str, str]]:
    text = (SWEEP / f"verdict-{preset}" / "verdict.md").read_text().split("```")[1]
    rows = re.findall(r"^(\S+) +(.+?) +(\d\.\d\dx \[\S+ \S+\]) +\d+  ", text, re.M)
    return {arm: (call, ratio) for arm, call, ratio in rows}


@pytest.mark.parametrize("preset", ["h100-ib", "h100-pcie"])
def test_the_committed_tables_print_the_interval_the_verdict_used(preset):
    """The quoted inconsistency: verdict-h100-pcie printed '95% CI 1.10x [1.05, 1.15]' beside
    'too close to call (interval holds 1)'. Now the decision block, the summary table and the CSV
    give one interval per configuration, labelled, and it is the one the call reads."""
    block = _decision_rows(preset)
    assert (
        block
        and "time to target (bound)" in (SWEEP / f"verdict-{preset}" / "verdict.md").read_text()
    )
    with open(SWEEP / f"verdict-{preset}" / "verdict.csv") as f:
        best = [r for r in csv.DictReader(f) if r["best_sync"] == "True"]
    for arm, (_, ratio) in block.items():
        row = next(r for r in best if r["configuration"] == arm)
        assert row["time_to_target_interval"] == BOUND
        lo, hi = float(row["time_to_target_low"]), float(row["time_to_target_high"])
        assert ratio.endswith(f"[{lo:.2f}, {hi:.2f}]"), (arm, ratio, lo, hi)
        if "interval holds 1" in row["verdict"] or "target size" in row["verdict"]:
            assert lo <= 1 <= hi
        elif row["verdict"] == "sync sooner":
            assert lo > 1
        summary = (SWEEP / f"verdict-{preset}" / "verdict.md").read_text().split("```")[3]
        line = next(x for x in summary.splitlines() if x.startswith(arm + " "))
        assert ratio in line and f"  {BOUND}  " in line
        # the arm's per-schedule table prints the same interval on its best-sync row
        text = (SWEEP / f"verdict-{preset}" / "verdict.md").read_text()
        table = text.split(f"\n{arm} (vs ")[1].split("\n\n")[0]
        best_row = next(x for x in table.splitlines() if "(best sync)" in x)
        assert best_row.rstrip().endswith(ratio.split(" ", 1)[1]), (arm, best_row, ratio)


def test_the_throughput_model_error_widens_the_interval():
    """The cluster verdict's edge factors are the assumptions' corners widened by the throughput
    model's held-out error (sim.efficiency.MODEL_ERROR), the interval with them, and the
    decision block names the term."""
    from stalepipe.lab.sim.efficiency import MODEL_ERROR
    from stalepipe.lab.verdict import cluster as cv
    from stalepipe.lab.verdict.decision import _covers

    s = cv.setting("smollm-360m", "h100-ib", 8, None)
    tp, options = cv.throughputs(s)
    low, high = cv.edge_range(s.workload(), s.cluster, options)
    assert MODEL_ERROR > 0 and tp.model_error == MODEL_ERROR
    assert tp.edge_factors == pytest.approx((low * (1 - MODEL_ERROR), high * (1 + MODEL_ERROR)))
    v = _verdict(1.3, 1.0, Transfer(), (low, high))
    before = v.ratio_all
    v.edge_factors, v.model_error = tp.edge_factors, tp.model_error
    after = v.ratio_all
    assert after.low == pytest.approx(before.low / (1 + MODEL_ERROR))
    assert after.high == pytest.approx(before.high / (1 - MODEL_ERROR))
    assert f"model error +-{MODEL_ERROR:.0%}" in "\n".join(_covers(v))
    assert f"model error +-{MODEL_ERROR:.1%}" in "\n".join(tp.lines)
