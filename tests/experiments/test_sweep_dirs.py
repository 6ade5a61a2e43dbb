"""Sweep directories are stalepipe's own: marked when made, and deleted (a failed run retried,
a run that stopped before its first checkpoint, `overwrite=True`) only when every part is."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from stalepipe.fileio import MARKER, NotOwnedError, make_owned_dir
from stalepipe.lab.analysis.results import load_runs
from stalepipe.lab.sweeps.grid import axis, expand
from stalepipe.lab.sweeps.sweep import (
    ERROR_FILE,
    RECORD_FILES,
    record_files,
    remove_sweep_dir,
    run_status,
    run_sweep,
    write_error,
)
from stalepipe.training.launch import task as trainer
from stalepipe.training.rundir.checkpoint import list_checkpoints, remove_checkpoint


def _short(tiny_config, steps=3):
    train = dataclasses.replace(tiny_config.train, num_steps=steps, eval_every=0, log_every=1)
    return dataclasses.replace(tiny_config, train=train)


def _copy(files, src, dst):
    """Copy `files` (paths under `src`) to the same places under `dst`: a git clone elsewhere."""
    for f in files:
        (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst / f.relative_to(src))


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
    res = run_sweep(trainer, specs, base, out, log=lambda m: None)
    assert res.ran == ["sync_s0"]
    assert _kind(out) == "sweep" and _kind(out / "sync_s0") == "run"
    write_error(out / "sync_s0", "RuntimeError: simulated crash")
    (out / "sync_s0" / "notes.txt").write_text("mine")
    with pytest.raises(NotOwnedError, match="holds 'notes.txt'"):
        run_sweep(trainer, specs, base, out, retry_failed=True, log=lambda m: None)
    assert (out / "sync_s0" / "notes.txt").exists() and (out / "sync_s0" / ERROR_FILE).exists()
    (out / "sync_s0" / "notes.txt").unlink()
    res = run_sweep(trainer, specs, base, out, retry_failed=True, log=lambda m: None)
    assert res.ran == ["sync_s0"] and run_status(out / "sync_s0") == "finished"
    # overwrite: the whole sweep, being all ours, is deleted and run again
    res = run_sweep(trainer, specs, base, out, overwrite=True, log=lambda m: None)
    assert res.ran == ["sync_s0"]


def test_a_run_that_stopped_before_its_first_checkpoint_starts_over(tiny_config, tmp_path):
    base = dataclasses.replace(
        tiny_config, train=dataclasses.replace(tiny_config.train, num_steps=2, eval_every=0)
    )
    specs = expand([axis("delay.policy", ["sync"])])
    out = tmp_path / "sweep"
    run_sweep(trainer, specs, base, out, log=lambda m: None)
    run_dir = out / "sync_s0"
    for ckpt in list_checkpoints(run_dir):
        remove_checkpoint(ckpt)
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n')  # killed at step 1
    res = run_sweep(trainer, specs, base, out, log=lambda m: None)
    assert res.ran == ["sync_s0"] and not res.failed


def test_a_sweep_committed_without_checkpoints_runs_only_what_is_missing(tiny_config, tmp_path):
    base = _short(tiny_config)
    specs = expand([axis("delay.policy", ["sync", "2bw", "fixed:2"])])
    out = tmp_path / "here" / "sweep"
    run_sweep(trainer, specs[:2], base, out, log=lambda m: None)
    # 2bw_s0 was stopped by a signal after step 1 (its checkpoint is not committed)
    stopped = out / "2bw_s0" / "metrics.jsonl"
    uninterrupted = read_vals(out / "2bw_s0")
    for ckpt in list_checkpoints(out / "2bw_s0"):
        remove_checkpoint(ckpt)
    stopped.write_text("".join(stopped.read_text().splitlines(keepends=True)[:2]))
    files = record_files(out)
    assert not any(f.name.startswith("ckpt_") for f in files)
    assert {f.parent.name for f in files if f.parent != out} == {"sync_s0"}
    assert out / MARKER in files and {f.name for f in files if f.parent != out} == set(RECORD_FILES)
    there = tmp_path / "there" / "sweep"  # another machine's clone: no checkpoints
    _copy(files, out, there)
    _copy([p for p in (out / "2bw_s0").iterdir() if not p.name.startswith("ckpt_")], out, there)
    assert run_status(there / "sync_s0") == "finished" and run_status(there / "2bw_s0") == "partial"
    assert {r.name: r.status for r in load_runs(there)} == {
        "2bw_s0": "partial",
        "sync_s0": "finished",
    }
    before = (there / "sync_s0" / "metrics.jsonl").read_bytes()
    res = run_sweep(trainer, specs, base, there, log=lambda m: None)
    assert sorted(res.ran) == ["2bw_s0", "fixed-2_s0"] and not res.failed
    assert (there / "sync_s0" / "metrics.jsonl").read_bytes() == before
    assert not list_checkpoints(there / "sync_s0")
    # the rerun 2bw_s0 equals the uninterrupted one (same data, same seed)
    assert read_vals(there / "2bw_s0") == uninterrupted


def read_vals(run_dir):
    """The val losses in a run's metrics.jsonl, in order."""
    return [
        json.loads(line)["val_loss"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if "val_loss" in line
    ]


def test_a_record_copied_without_markers_still_reads_as_finished(tiny_config, tmp_path):
    base = _short(tiny_config)
    specs = expand([axis("delay.policy", ["sync"])])
    out = tmp_path / "sweep"
    run_sweep(trainer, specs, base, out, log=lambda m: None)
    there = tmp_path / "copy"
    _copy([f for f in record_files(out) if f.name != MARKER], out, there)
    assert run_status(there / "sync_s0") == "finished"
    res = run_sweep(trainer, specs, base, there, log=lambda m: None)
    assert res.ran == [] and res.finished == ["sync_s0"]


@pytest.mark.parametrize(
    "last",
    [
        '{"step": 2, "loss": 5.0}\n',  # stopped after the last update, before its evaluation
        '{"step": 1, "loss": 5.0, "val_loss": 5.1}\n',  # an eval, but not the last step's
        '{"step": 2, "loss": 5.0, "val_lo',  # torn by a crash while writing the final line
    ],
)
def test_only_the_final_steps_evaluation_marks_a_record_finished(tmp_path, last):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"train": {"num_steps": 3}}))
    (run / "metrics.jsonl").write_text('{"step": 0, "loss": 5.2}\n' + last)
    assert run_status(run) == "partial"
    (run / "metrics.jsonl").write_text('{"step": 2, "loss": 5.0, "val_loss": 5.1}\n')
    assert run_status(run) == "finished"
