"""The demo's table arithmetic, and (slow) a miniature end-to-end demo."""

from __future__ import annotations

import math

import pytest

from stalepipe.cli.demo import (
    VERDICT,
    DemoRun,
    demo_configs,
    format_table,
    run_demo,
    summarize,
)


def fake(opt, variant, val):
    return DemoRun(opt, variant, f"runs/{opt}-{variant}", val, [3.0, 2.0], 1.0)


def test_summary_gap_and_share_recovered():
    runs = [
        fake("adamw", "sync", 2.0),
        fake("adamw", "2bw", 2.2),
        fake("adamw", "2bw+ef", 2.05),
        fake("muon", "sync", 1.9),
        fake("muon", "2bw", 1.9),
        fake("muon", "2bw+ef", 1.95),
    ]
    rows = summarize(runs)["rows"]
    assert rows["adamw"]["gap_2bw"] == pytest.approx(0.2)
    assert rows["adamw"]["ef_recovers"] == pytest.approx(0.75)
    assert math.isnan(rows["muon"]["ef_recovers"])  # no gap: nothing to recover
    table = format_table({"rows": rows})
    assert "75%" in table and "n/a" in table


def test_demo_configs_are_six_ordinary_runs(tmp_path):
    cfgs = demo_configs(tmp_path, steps=10)
    assert len({c.name for c in cfgs}) == 6
    assert {c.delay.policy for c in cfgs} == {"sync", "2bw"}
    assert all(c.train.num_steps == 10 and c.out_dir == str(tmp_path) for c in cfgs)


def test_demo_verdict_is_for_a_named_gpu_cluster():
    from stalepipe.hardware import get_device
    from stalepipe.presets import PRESETS

    assert get_device(VERDICT["device"]).name == "NVIDIA H100 SXM"
    assert VERDICT["model"] in PRESETS and VERDICT["stages"] >= 2


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, capsys):
    summary = run_demo(tmp_path, steps=4, workers=1, verbose=True)
    assert set(summary["rows"]) == {"adamw", "muon"}
    assert (tmp_path / "loss_curves.png").is_file()
    assert (tmp_path / "adamw-2bw-ef" / "config.json").is_file()
    # it ends with the verdict on its four delayed runs, saying what is measured and simulated
    assert [v["configuration"] for v in summary["verdict"]] == [
        "adamw 2bw", "adamw 2bw +ef", "muon 2bw", "muon 2bw +ef"
    ]  # fmt: skip
    out = capsys.readouterr().out
    assert "token overhead: measured" in out and "throughput and memory: simulated" in out
    assert out.rstrip().splitlines()[-1].endswith("verdict.md, verdict.png")
    assert (tmp_path / "verdict" / "verdict.md").is_file()
