"""`log.staleness` (issue 51, item 4; train/staleness.py): per stage, at every log step, the
relative update size and the cosine of consecutive gradients, with the run's weights unchanged
bit for bit."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from stalepipe.config import apply_overrides
from stalepipe.errors import UserError
from stalepipe.training.rundir.checkpoint import latest_checkpoint, load_checkpoint
from stalepipe.training.rundir.metrics import read_metrics
from stalepipe.training.train.loop import train
from stalepipe.training.train.staleness import StalenessProbe


def _run(cfg, staleness: bool, name: str):
    log = dataclasses.replace(cfg.log, staleness=staleness)
    cfg = dataclasses.replace(cfg, name=name, log=log)
    run = train(cfg, verbose=False).run_dir
    return run, read_metrics(run), load_checkpoint(latest_checkpoint(run))["model"]


def test_the_metrics_are_logged_per_stage_and_the_run_is_unchanged(tiny_config):
    cfg = apply_overrides(
        tiny_config,
        {"delay.policy": "2bw", "pipeline.num_stages": "2", "train.log_every": "3"},
    )
    _, plain_rows, plain = _run(cfg, False, "plain")
    run, rows, probed = _run(cfg, True, "probed")
    assert all(torch.equal(plain[k], probed[k]) for k in plain)  # bit for bit
    logged = [r for r in rows if "update_rel/s0" in r]
    assert [r["step"] for r in logged] == [2, 5, 8, 11]
    for r in logged:
        for s in (0, 1):
            assert 0 < r[f"update_rel/s{s}"] < 1
            assert -1 <= r[f"grad_cos/s{s}"] <= 1
    assert not any("update_rel/s0" in r for r in plain_rows)
    _report_shows_the_medians(run, logged, warmup=cfg.train.warmup_steps)


def _report_shows_the_medians(run, logged, warmup: int) -> None:
    """`stalepipe report` on the run's directory: one staleness line, the medians over the
    window [warmup, 2 x warmup) of every stage; a crafted value is skipped, not trusted."""
    import json
    import statistics

    from stalepipe.lab.analysis.report import build_report

    window = [r for r in logged if warmup <= r["step"] < 2 * warmup] if warmup else logged
    with (run / "metrics.jsonl").open("a") as f:  # a line whose values are not numbers
        f.write(json.dumps({"step": 3, "loss": 1.0, "update_rel/s0": "9e9"}) + "\n")
    blocks, _, _ = build_report(run.parent)
    i = next(i for i, b in enumerate(blocks) if b.text == "Staleness (log.staleness)")
    (row,) = [r for r in blocks[i + 2].rows if r[0] == run.name]
    u = statistics.median(r[f"update_rel/s{s}"] for r in window for s in (0, 1))
    c = statistics.median(r[f"grad_cos/s{s}"] for r in window for s in (0, 1))
    assert row[3:] == [f"{u:.3g}", f"{c:.3f}"]


def test_the_probe_measures_what_it_says():
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    probe = StalenessProbe([[w]])
    w.grad = torch.tensor([1.0, 0.0])
    probe.before_update(0, logs=False, logs_next=True)
    assert probe.after_update(0, logs=False) == {}
    w.grad = torch.tensor([1.0, 1.0])
    probe.before_update(1, logs=True, logs_next=False)
    with torch.no_grad():
        w.copy_(torch.tensor([3.0, 4.0]) * 1.1)  # an update of 10 % of the weights' norm
    got = probe.after_update(1, logs=True)
    assert got["update_rel/s0"] == pytest.approx(0.1 / 1.1)
    assert got["grad_cos/s0"] == pytest.approx(1 / math.sqrt(2))


def test_the_runtime_refuses_it_in_one_line(tiny_config):
    with pytest.raises(UserError, match="log.staleness is measured by the emulator engine"):
        apply_overrides(tiny_config, {"log.staleness": "true", "pipeline.engine": "distributed"})
