"""One training worker on a `launch.pool.WorkerPool` (tests and benchmarks reuse processes)."""

from __future__ import annotations

from stalepipe.config import ExperimentConfig
from stalepipe.training.rundir.startup import StartUp
from stalepipe.training.train.pipelined import run_worker


def worker_entry(cfg: ExperimentConfig, resume: bool = False, overwrite: bool = False) -> dict:
    """Run this process's stage of `cfg` quietly; its `WorkerResult` as a dict."""
    return run_worker(cfg, StartUp(resume, overwrite), verbose=False).as_dict()
