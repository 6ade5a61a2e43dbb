"""Sweep directories are stalepipe's own: marked when made, and deleted (a failed run retried,
a run that stopped before its first checkpoint, `overwrite=True`) only when every part is."""

from __future__ import annotations

import dataclasses
import json

import pytest

from stalepipe.experiments.grid import axis, expand
from stalepipe.experiments.sweep import (
    ERROR_FILE,
    remove_sweep_dir,
    run_status,
    run_sweep,
    write_error,
)
from stalepipe.fileio import MARKER, NotOwnedError, make_owned_dir


def _kind(path) -> str:
    return json.loads((path / MARKER).read_text())["kind"]


def _fake_sweep(out):
    make_owned_dir(out, "sweep")
    run = make_owned_dir(out / "a_s0", "run")
    (run / "config.json").write_text("{}")
    (out / "report").mkdir()
    (out / "report" / "report.md").write_text("# report")
    return run


def test_remove_sweep_dir_only_when_every_part_is_ours(tmp_path):
    out = tmp_path / "sweep"
    run = _fake_sweep(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(NotOwnedError, match="holds 'notes.txt'"):
        remove_sweep_dir(out)
    (out / "notes.txt").unlink()
    (run / "thesis.tex").write_text("precious")
    with pytest.raises(NotOwnedError, match="a_s0: it holds 'thesis.tex'"):
        remove_sweep_dir(out)
    (run / "thesis.tex").unlink()
    (out / "report" / "data.xlsx").write_text("mine")
    with pytest.raises(NotOwnedError, match="report"):
        remove_sweep_dir(out)
    assert (out / "report" / "report.md").exists() and (run / "config.json").exists()
    (out / "report" / "data.xlsx").unlink()
    remove_sweep_dir(out)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_sweep_marks_its_directories_and_retries_only_its_own(tiny_config, tmp_path):
    base = dataclasses.replace(
        tiny_config, train=dataclasses.replace(tiny_config.train, num_steps=2, eval_every=0)
    )
    specs = expand([axis("delay.policy", ["sync"])])
    out = tmp_path / "sweep"
    res = run_sweep(specs, base, out, log=lambda m: None)
    assert res.ran == ["sync_s0"]
    assert _kind(out) == "sweep" and _kind(out / "sync_s0") == "run"
    write_error(out / "sync_s0", "RuntimeError: simulated crash")
    (out / "sync_s0" / "notes.txt").write_text("mine")
    with pytest.raises(NotOwnedError, match="holds 'notes.txt'"):
        run_sweep(specs, base, out, retry_failed=True, log=lambda m: None)
    assert (out / "sync_s0" / "notes.txt").exists() and (out / "sync_s0" / ERROR_FILE).exists()
    (out / "sync_s0" / "notes.txt").unlink()
    res = run_sweep(specs, base, out, retry_failed=True, log=lambda m: None)
    assert res.ran == ["sync_s0"] and run_status(out / "sync_s0") == "finished"
    # overwrite: the whole sweep, being all ours, is deleted and run again
    res = run_sweep(specs, base, out, overwrite=True, log=lambda m: None)
    assert res.ran == ["sync_s0"]


def test_a_run_that_stopped_before_its_first_checkpoint_starts_over(tiny_config, tmp_path):
    base = dataclasses.replace(
        tiny_config, train=dataclasses.replace(tiny_config.train, num_steps=2, eval_every=0)
    )
    specs = expand([axis("delay.policy", ["sync"])])
    out = tmp_path / "sweep"
    run_sweep(specs, base, out, log=lambda m: None)
    run_dir = out / "sync_s0"
    for ckpt in run_dir.glob("ckpt_*.pt"):
        ckpt.unlink()
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n')  # killed at step 1
    res = run_sweep(specs, base, out, log=lambda m: None)
    assert res.ran == ["sync_s0"] and not res.failed
