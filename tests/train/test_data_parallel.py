"""Data-parallel emulator on 2 gloo ranks (torchrun, and the test pool started as torchrun starts
its workers) == one process with the same global batch."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from stalepipe.training.rundir.checkpoint import latest_checkpoint, load_checkpoint
from stalepipe.training.train.loop import train


def _torchrun(cfg, tmp_path, *extra: str, nproc: int = 2) -> None:
    path = tmp_path / f"{cfg.name}.json"
    path.write_text(cfg.to_json())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "stalepipe",
        "train",
        "--config",
        str(path),
        *extra,
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]


def _weights(run_dir):
    return load_checkpoint(latest_checkpoint(run_dir))["model"]


def _assert_close(a, b):
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


def _cfg(tiny_config, name, policy, ef):
    return dataclasses.replace(
        tiny_config,
        name=name,
        delay=dataclasses.replace(tiny_config.delay, policy=policy, ef=ef),
        pipeline=dataclasses.replace(tiny_config.pipeline, num_stages=2),
        train=dataclasses.replace(tiny_config.train, num_steps=6, ckpt_every=3, keep_last=3),
    )


def test_two_ranks_equal_one_process(tiny_config, pool):
    """sync, 2 ranks on env:// as torchrun starts them, on the test pool (the next test runs
    torchrun itself, twice: a whole torchrun here would pay three more interpreters); 2bw with
    EF is the next test's uninterrupted 2-rank run."""
    single = train(_cfg(tiny_config, "single-sync", "sync", False), verbose=False)
    dp = _cfg(tiny_config, "dp-sync", "sync", False)
    pool.run(train, (dp,), 2, timeout_s=240)
    run_dir = f"{dp.out_dir}/{dp.name}"
    meta = json.loads(Path(run_dir, "meta.json").read_text())
    assert meta["data_parallel_ranks"] == 2
    _assert_close(_weights(single.run_dir), _weights(run_dir))


def test_sigterm_to_torchrun_checkpoints_every_rank_alike_then_resumes(tiny_config, tmp_path, pool):
    """torchrun forwards SIGTERM to its workers: they agree on a step (one all-reduce of the
    request bits), rank 0 writes the checkpoint, and a resumed run ends where one process
    ends (up to data-parallel rounding). 2bw with EF: the uninterrupted 2-rank run (on the
    test pool, as the previous test's) equals one process, and the 2-rank checkpoint resumes
    on 1 rank too."""
    import signal
    import time

    cfg = _cfg(tiny_config, "dp-stop", "2bw", True)
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(
            cfg.train, num_steps=2000, ckpt_every=0, eval_every=0, lr_schedule="constant"
        ),
    )
    path = tmp_path / "stop.json"
    path.write_text(cfg.to_json())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "stalepipe", "train", "--config", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    metrics = Path(cfg.out_dir, cfg.name, "metrics.jsonl")
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert "stalepipe: stopped by SIGTERM after " in err, err[-3000:]
    run_dir = Path(cfg.out_dir, cfg.name)
    stopped = load_checkpoint(latest_checkpoint(run_dir))["step"]
    assert 3 <= stopped < 2000

    short = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_steps=stopped + 4))
    one_rank = dataclasses.replace(short, out_dir=str(tmp_path / "one-rank"))
    shutil.copytree(run_dir, Path(one_rank.out_dir, cfg.name))  # for the resume on 1 rank
    path.write_text(short.to_json())  # resume under torchrun with 4 more steps to go
    _torchrun(short, tmp_path, "--resume")
    # bit for bit the uninterrupted 2-rank run of that length, and close to one process
    whole = dataclasses.replace(short, name="dp-whole")
    pool.run(train, (whole,), 2, timeout_s=240)  # 2 ranks on env://, as torchrun starts them
    meta = json.loads(Path(whole.out_dir, whole.name, "meta.json").read_text())
    assert meta["data_parallel_ranks"] == 2
    a, b = _weights(f"{whole.out_dir}/{whole.name}"), _weights(run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    single = train(dataclasses.replace(short, name="single-stop"), verbose=False)
    _assert_close(_weights(single.run_dir), b)
    # the 2-rank run's checkpoint resumed on 1 rank ends where one process ends, too
    resumed = train(one_rank, resume=True, verbose=False)
    assert len(resumed.train_losses) == 4  # from the stopped step
    _assert_close(_weights(single.run_dir), _weights(resumed.run_dir))
