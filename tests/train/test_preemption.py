"""Preemption: SIGTERM / SIGUSR1 / SIGINT write a checkpoint at an agreed step and end the run
with exit status 75; `--resume` continues it bit for bit. The checkpoint clock
(train.ckpt_every_s) checkpoints without changing the run."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stalepipe.errors import EXIT_PREEMPTED, Preempted
from stalepipe.training.rundir import metrics as metrics_file
from stalepipe.training.rundir.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
)
from stalepipe.training.train.loop import train


def _cfg(tiny_config, name, **train_kw):
    return dataclasses.replace(
        tiny_config,
        name=name,
        delay=dataclasses.replace(tiny_config.delay, policy="2bw", ef=True),
        pipeline=dataclasses.replace(tiny_config.pipeline, num_stages=2),
        train=dataclasses.replace(tiny_config.train, **train_kw),
    )


def _final(run_dir) -> dict:
    return load_checkpoint(latest_checkpoint(run_dir))["model"]


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def _signal_at(monkeypatch, step: int, sig: int, times: int = 1) -> None:
    """Deliver `sig` to this process when the loop writes step `step`'s metrics."""
    write = metrics_file.MetricsWriter.write

    def write_and_signal(self, record):
        write(self, record)
        if record["step"] == step:
            for _ in range(times):
                os.kill(os.getpid(), sig)

    monkeypatch.setattr(metrics_file.MetricsWriter, "write", write_and_signal)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_signal_checkpoints_then_resume_equals_uninterrupted(tiny_config, monkeypatch, sig):
    full = train(_cfg(tiny_config, "full"), verbose=False)
    cfg = _cfg(tiny_config, "stopped")
    _signal_at(monkeypatch, 4, sig)
    with pytest.raises(Preempted, match=f"stopped by {signal.Signals(sig).name} after 6 of 12"):
        train(cfg, verbose=False)
    assert Preempted.exit_code == EXIT_PREEMPTED == 75
    # the signal came after step 4's update: step 5 is the first every process agrees on
    assert [p.name for p in list_checkpoints(Path(cfg.out_dir) / cfg.name)] == ["ckpt_00000006"]
    monkeypatch.undo()
    resumed = train(cfg, resume=True, verbose=False)
    assert len(resumed.train_losses) == 6
    _assert_bitwise(_final(full.run_dir), _final(resumed.run_dir))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


def test_second_ctrl_c_stops_at_once(tiny_config, monkeypatch):
    cfg = _cfg(tiny_config, "twice")
    _signal_at(monkeypatch, 4, signal.SIGINT, times=2)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, verbose=False)
    assert list_checkpoints(Path(cfg.out_dir) / cfg.name) == []


def test_checkpoint_clock_writes_checkpoints_without_changing_the_run(tiny_config):
    plain = train(_cfg(tiny_config, "plain"), verbose=False)
    # a clock that is always due: every step checkpoints (keep_last of them stay)
    clocked = train(_cfg(tiny_config, "clocked", ckpt_every_s=1e-9, keep_last=3), verbose=False)
    kept = [p.name for p in list_checkpoints(clocked.run_dir)]
    assert kept == ["ckpt_00000010", "ckpt_00000011", "ckpt_00000012"]
    assert [p.name for p in list_checkpoints(plain.run_dir)] == ["ckpt_00000012"]
    _assert_bitwise(_final(plain.run_dir), _final(clocked.run_dir))


def _wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {n}: {proc.poll()=}")


def test_cli_sigterm_exits_75_with_one_line_and_resumes(tiny_config, tmp_path):
    cfg = _cfg(tiny_config, "cli", num_steps=4000, eval_every=0, log_every=1)
    path = tmp_path / "cfg.json"
    path.write_text(cfg.to_json())
    cmd = [sys.executable, "-m", "stalepipe", "train", "--config", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    run_dir = Path(cfg.out_dir) / cfg.name
    _wait_for_steps(run_dir, 5, proc, timeout_s=60)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("stalepipe: stopped by SIGTERM after ") and "--resume" in last, err
    step = load_checkpoint(latest_checkpoint(run_dir))["step"]
    assert 5 <= step < 4000


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_notice_names_the_signal_it_got(sig, capfd):
    from stalepipe.training.peers.interrupts import Interrupts

    with Interrupts(0, verbose=True) as interrupts:
        os.kill(os.getpid(), sig)
    err = capfd.readouterr().err
    name = signal.Signals(sig).name
    assert f"stalepipe: got {name}: writing a checkpoint" in err and interrupts.signal == name
    assert ("Ctrl-C again stops at once" in err) == (sig == signal.SIGINT), err
