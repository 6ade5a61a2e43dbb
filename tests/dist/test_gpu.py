"""The NCCL / CUDA path of the runtime (skipped without a GPU): one process per GPU, bf16
autocast, compared with the single-process emulator to bf16 tolerance; a killed rank on NCCL
(2 GPUs). Run them after benchmarks/gpu/gpu_check.sh (docs/benchmarks.md, "GPU check")."""

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

from stalepipe.errors import EXIT_FAILED, EXIT_PEER, TrainingError
from stalepipe.training.launch.train import launch_train
from stalepipe.training.rundir.checkpoint import list_checkpoints
from stalepipe.training.rundir.startup import StartUp

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_bf16_runs_and_matches_emulator(make_cfg, run_dist, dist_utils):
    P = min(2, torch.cuda.device_count())  # NCCL needs one GPU per rank
    cfg = make_cfg("2bw" if P > 1 else "1f1b", P, 2, steps=4)
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, device="cuda", dtype="bfloat16"),
        pipeline=dataclasses.replace(cfg.pipeline, backend="auto"),
    )
    reports = run_dist(cfg)
    assert len(reports) == P
    got = dist_utils["final_model"](cfg)
    ref = dist_utils["reference"](cfg)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k].to(got[k].device), rtol=2e-2, atol=2e-3)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_nccl_killed_worker_is_a_peer_error_within_the_timeout(make_cfg):
    """docs/runtime.md, "Failures on NCCL": the survivors' polled waits name the dead rank
    within pipeline.timeout_s (not NCCL's watchdog aborting them), and the launcher exits 4."""
    cfg = make_cfg("1f1b", 2, 2, steps=5000, ckpt_every=5, name="nccl-faulty")
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, device="cuda", dtype="bfloat16"),
        pipeline=dataclasses.replace(cfg.pipeline, backend="auto", timeout_s=20),
    )
    box: dict = {}

    def target() -> None:
        try:
            box["rc"] = launch_train(cfg, StartUp(overwrite=True), verbose=False)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    run = Path(cfg.out_dir) / cfg.name
    deadline = time.monotonic() + 300
    while not list_checkpoints(run):
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.2)
    victim = next(p for p in mp.active_children() if p.name == "stalepipe-rank1")
    survivor = next(p for p in mp.active_children() if re.match(r"stalepipe-rank0$", p.name))
    t0 = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(cfg.pipeline.timeout_s + 60)
    assert not thread.is_alive(), "launcher still waiting"
    assert time.monotonic() - t0 < cfg.pipeline.timeout_s + 15
    err = box.get("error")
    assert isinstance(err, TrainingError) and err.exit_code == EXIT_FAILED, box
    assert str(err).startswith("rank 1 (stage 1) was killed (SIGKILL); all ranks stopped"), err
    assert survivor.exitcode == EXIT_PEER  # a PeerError, not a watchdog abort (SIGABRT)
    log = (run / "logs" / "rank0.log").read_text()
    assert "stalepipe: error: rank 0 (stage 0): rank 1 (stage 1) failed" in log, log
