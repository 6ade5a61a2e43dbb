"""Experiment trackers (rundir/trackers.py), offline: hierarchical names, the config logged
once, every metrics line mirrored; W&B, MLflow and trackio on a tiny run, then resumed."""

import dataclasses
import json
import sqlite3

import pytest

from stalepipe.config import ConfigError, LogConfig
from stalepipe.training.optim import resolve_config
from stalepipe.training.rundir.metrics import read_metrics
from stalepipe.training.rundir.trackers import scalars, tracker_name
from stalepipe.training.train.loop import train


def test_hierarchical_names():
    assert [tracker_name(k) for k in ("loss", "val_loss", "lr", "tau", "tokens_per_s")] == [
        "train/loss", "val/loss", "optim/lr", "delay/tau", "perf/tokens_per_s"]  # fmt: skip
    got = scalars({"step": 9, "loss": 2.5, "tau": [1, 0], "timed_from_step": 3, "ok": True})
    assert got == {"train/loss": 2.5, "delay/tau/stage0": 1.0, "delay/tau/stage1": 0.0}


def test_an_unknown_tracker_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown tracker \\['neptune'\\]; choose from"):
        LogConfig(tracker="wandb,neptune")
    assert LogConfig(tracker="wandb, mlflow,wandb").trackers == ("wandb", "mlflow")


def test_wandb_mlflow_and_trackio_offline_mirror_the_metrics(tiny_config, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    trackio = pytest.importorskip("trackio")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    project = f"t-{tmp_path.name}"  # trackio's database is shared by the test session
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = dataclasses.replace(
        tiny_config,
        train=dataclasses.replace(tiny_config.train, num_steps=6, ckpt_every=3, log_every=1),
        log=LogConfig(tracker="wandb,mlflow,trackio", project=project),
    )
    run = train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_steps=3)),
                verbose=False).run_dir  # fmt: skip
    train(cfg, resume=True, verbose=False)  # the same W&B and MLflow run continues
    losses = [r["loss"] for r in read_metrics(run)]
    assert len(losses) == 6
    # W&B: an offline run in the run directory, one id across the resume
    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert offline and len({p.name.rsplit("-", 1)[1] for p in offline}) == 1
    # MLflow: one run in the run directory's file store, the config once, train/loss per step
    mlflow.set_tracking_uri((run / "mlruns").resolve().as_uri())
    (found,) = mlflow.search_runs(experiment_names=[project], output_format="list")
    assert found.data.params["optim.lr"] == str(resolve_config(cfg.optim).lr)  # as recorded
    history = mlflow.MlflowClient().get_metric_history(found.info.run_id, "train/loss")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(losses)
    # trackio: its local database holds every step's line
    db = sqlite3.connect(trackio.utils.TRACKIO_DIR / f"{project}.db")
    rows = [json.loads(m) for (m,) in db.execute("select metrics from metrics order by step")]
    assert [r["train/loss"] for r in rows] == pytest.approx(losses)


def test_a_run_started_over_gets_a_new_tracker_id(tmp_path):
    """The tracker id is made at a fresh start and kept for resumes; a run directory made anew
    (--overwrite, a failed sweep run retried) gets a new one, so no tracker run is reopened."""
    from stalepipe.training.rundir.trackers import ID_FILE, _run_id

    first = _run_id(tmp_path)
    assert _run_id(tmp_path) == first and (tmp_path / ID_FILE).read_text().strip() == first
    (tmp_path / ID_FILE).unlink()  # what deleting the run directory does
    assert _run_id(tmp_path) != first
