"""Checkpoints of the runtime (resume bitwise; across engines and splits: test_resume_engines),
data parallel x pipeline parallel, and failures (a killed worker stops every rank within the
timeout)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from stalepipe.config import ConfigError
from stalepipe.errors import EXIT_FAILED, EXIT_PEER, TrainingError
from stalepipe.training.launch.train import launch_train
from stalepipe.training.rundir.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    remove_checkpoint,
)
from stalepipe.training.rundir.startup import StartUp
from stalepipe.training.train.pipelined import check_config


def _ckpts(cfg) -> list[Path]:
    return list_checkpoints(Path(cfg.out_dir) / cfg.name)


def test_resume_equals_uninterrupted(make_cfg, run_dist, dist_utils):
    cfg = make_cfg("2bw", 2, 2, steps=6, ckpt_every=3)
    run_dist(cfg)
    full = dist_utils["final_model"](cfg)
    assert [p.name for p in _ckpts(cfg)] == ["ckpt_00000003", "ckpt_00000006"]
    remove_checkpoint(_ckpts(cfg)[-1])  # "crash" after step 3
    run_dist(cfg, resume=True)
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), full)


def test_data_parallel_x_pipeline_matches_single_process(make_cfg, run_dist, dist_utils):
    # 3 validation batches: replica 0 evaluates two, replica 1 one.
    cfg = make_cfg("1f1b", 2, 2, dp=2, tied=False, eval_every=2, num_eval_batches=3)
    run_dist(cfg)
    ref = dist_utils["reference"](cfg, mode="fast")
    got = dist_utils["final_model"](cfg)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5)
    got_val, want_val = dist_utils["val_losses"](cfg), dist_utils["val_losses"](cfg, "ref")
    assert sorted(got_val) == sorted(want_val) == [1, 3]
    for k in got_val:
        assert got_val[k] == pytest.approx(want_val[k], rel=1e-5), k


def test_bad_configs_are_refused(make_cfg):
    with pytest.raises(ConfigError, match="delay.policy 2bw"):
        check_config(dataclasses.replace(make_cfg("2bw"), delay=make_cfg("1f1b").delay))
    with pytest.raises(ConfigError, match="num_microbatches to 1"):
        check_config(make_cfg("pipedream", 2, 2))
    # Refused by the config itself (the runtime's schedules) or by check_config.
    with pytest.raises(ConfigError, match="set pipeline.num_chunks to 2 or more"):
        cfg = make_cfg("1f1b")
        check_config(
            dataclasses.replace(
                cfg, pipeline=dataclasses.replace(cfg.pipeline, schedule="interleaved-1f1b")
            )
        )


def test_killed_worker_stops_every_rank(make_cfg):
    cfg = make_cfg("1f1b", 3, 2, steps=2000, ckpt_every=5, name="faulty")
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, timeout_s=10))
    box: dict = {}

    def target() -> None:
        try:
            box["rc"] = launch_train(cfg, StartUp(overwrite=True), verbose=False)
        except Exception as e:  # noqa: BLE001
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not _ckpts(cfg):
        assert time.monotonic() < deadline, "no checkpoint within 120 s"
        time.sleep(0.2)
    victim = next(p for p in mp.active_children() if p.name == "stalepipe-rank1")
    others = [p for p in mp.active_children() if re.match(r"stalepipe-rank[02]$", p.name)]
    t0 = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(cfg.pipeline.timeout_s + 30)
    elapsed = time.monotonic() - t0
    assert not thread.is_alive(), "launcher still waiting"
    assert elapsed < 10, elapsed  # the survivors see the closed connections, not a timeout
    err = box.get("error")
    assert isinstance(err, TrainingError), box
    assert err.exit_code == EXIT_FAILED  # what `stalepipe train` exits with; 2 is bad input
    assert str(err).startswith("rank 1 (stage 1) was killed (SIGKILL); all ranks stopped"), err
    assert "stays loadable (--resume)" in str(err)
    assert all(p.exitcode == EXIT_PEER for p in others)  # they failed because of it, not hung
    logs = Path(cfg.out_dir) / cfg.name / "logs"
    assert (logs / "rank1.log").read_text().startswith("== stalepipe rank 1: pid ")
    for r in (0, 2):
        # Each survivor's one line names the dead rank (a collective learns it from the
        # launcher's record); no traceback.
        log = (logs / f"rank{r}.log").read_text()
        assert f"stalepipe: error: rank {r} (stage {r}): rank 1 (stage 1) failed" in log, log
        assert "Traceback" not in log, log
    load_checkpoint(_ckpts(cfg)[-1])  # the last complete checkpoint stays loadable


def test_divergence_stops_every_rank_and_keeps_the_last_good_checkpoint(make_cfg):
    """A learning rate that blows the weights up: the run stops with a one-line error naming
    the step and the last good checkpoint, and no checkpoint with non-finite weights exists."""
    cfg = make_cfg("2bw", 2, 2, steps=40, ckpt_every=1, keep_last=3, grad_clip=0.0, name="blowup")
    cfg = dataclasses.replace(
        cfg,
        optim=dataclasses.replace(cfg.optim, lr=1e12),
        pipeline=dataclasses.replace(cfg.pipeline, timeout_s=10),
    )
    t0 = time.monotonic()
    with pytest.raises(TrainingError, match="rank") as err:
        launch_train(cfg, StartUp(overwrite=True), verbose=False)
    assert time.monotonic() - t0 < 90
    logs = "".join(p.read_text() for p in (Path(cfg.out_dir) / cfg.name / "logs").glob("rank*.log"))
    assert re.search(
        r"non-finite (loss|weights).* at step \d+; (last good checkpoint|no chec)", logs
    )
    assert "--resume --optim.lr" in logs, err.value  # the divergence message's command
    # The rank that diverged first (its record), named with its own line.
    assert re.match(
        r"rank \d \(stage \d\) failed \(exit status 4\): rank \d: TrainingError", str(err.value)
    )
    for path in _ckpts(cfg):
        state = load_checkpoint(path)
        assert all(torch.isfinite(t).all() for t in state["model"].values()), path
