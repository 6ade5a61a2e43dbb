"""The pipeline runtime under SIGTERM: every rank checkpoints after the same update (agreed
through `runtime.stage_update`), the run exits 75, and `--resume` ends bit for bit where an
uninterrupted run ends."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalepipe.errors import EXIT_PREEMPTED
from stalepipe.training.rundir.checkpoint import latest_checkpoint, load_checkpoint
from stalepipe.training.runtime.stage_update import lookahead
from stalepipe.training.train.pipelined import runtime_schedule

STEPS = 300


def _rank_pid(run_dir: Path, rank: int) -> int:
    """A rank's pid as its log's first line gives it (`ranklog.log_header`), as a user finds
    it: the ranks are not the launcher's children (they fork from its forkserver)."""
    first = (run_dir / "logs" / f"rank{rank}.log").read_text().splitlines()[0]
    return int(re.search(r"== stalepipe rank \d+: pid (\d+) ", first).group(1))


def _train(cfg, tmp_path, *extra: str) -> subprocess.Popen:
    path = tmp_path / f"{cfg.name}.json"
    path.write_text(cfg.to_json())
    cmd = [sys.executable, "-m", "stalepipe", "train", "--config", str(path), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {n} (exit {proc.poll()})")


def test_lookahead_of_the_schedules(make_cfg):
    # 1F1B flushes (0), 2BW runs one step ahead (1), PipeDream up to P-1 steps
    got = {
        name: max(lookahead(list(a)) for a in runtime_schedule(make_cfg(name, P=3, m=m)).ranks)
        for name, m in (("1f1b", 2), ("2bw", 2), ("pipedream", 1))  # pipedream: m = 1
    }
    assert got == {"1f1b": 0, "2bw": 1, "pipedream": 2}


@pytest.mark.parametrize(
    ("schedule", "P", "m"),
    [
        ("2bw", 2, 2),
        pytest.param("1f1b", 2, 2, marks=pytest.mark.slow),
        pytest.param("pipedream", 3, 1, marks=pytest.mark.slow),
    ],
)
def test_sigterm_to_one_rank_stops_all_at_one_step_and_resume_is_bitwise(
    make_cfg, run_dist, tmp_path, schedule, P, m
):
    """STEPS is the margin the signal lands in; the resume then extends the run to 4 steps
    past the stop (a constant LR extends, tests/train/test_extend.py), and the uninterrupted
    run of that length runs on the test pool."""
    cfg = make_cfg(schedule, P=P, m=m, steps=STEPS, log_every=1, lr_schedule="constant")
    proc = _train(cfg, tmp_path)
    run_dir = Path(cfg.out_dir) / cfg.name
    _wait_for_steps(run_dir, 10, proc, timeout_s=120)
    # one rank only, the last: the vote carries it to the others
    os.kill(_rank_pid(run_dir, cfg.pipeline.num_processes - 1), signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    stopped = load_checkpoint(latest_checkpoint(run_dir))["step"]
    assert 10 <= stopped < STEPS, err
    assert "Traceback" not in err, err
    # rank 0 did not get the signal itself: it names none
    assert f"stopped by a signal to another process after {stopped} of {STEPS} steps" in err, err
    assert proc.returncode == EXIT_PREEMPTED, err

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_steps=stopped + 4))
    resumed = _train(cfg, tmp_path, "--resume")
    _, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    run_dist(dataclasses.replace(cfg, name="full"))
    a = load_checkpoint(latest_checkpoint(Path(cfg.out_dir) / "full"))["model"]
    b = load_checkpoint(latest_checkpoint(run_dir))["model"]
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a), [k for k in a if not a[k].equal(b[k])]
