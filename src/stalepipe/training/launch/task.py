"""One run of a sweep as its worker executes it, wherever that is (a pool process, a submitit
array task, this process): claim the run, train or resume it, record a crash.

The lab's sweep never imports the training loop: whoever starts a sweep hands it this module
(`lab.sweeps.sweep.Trainer`: `run_one`, `run_task`), as `stalepipe sweep` does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

from stalepipe.config import ExperimentConfig
from stalepipe.errors import EXIT_PREEMPTED, EXIT_REQUEUE_FAILED, Preempted
from stalepipe.fileio import make_owned_dir
from stalepipe.training.rundir.lease import RunLeased, lease_run
from stalepipe.training.rundir.status import RUN_KIND, run_status, write_error


def run_one(cfg_dict: dict[str, Any], threads: int) -> None:
    """Worker body: lease the run (`rundir.lease`: exit EXIT_LEASED, touching nothing, when a
    live owner elsewhere trains it), then train it, resuming from its last checkpoint if it has
    one (a run directory holding only sweep.json starts fresh); an exception goes to
    error.json."""
    # here, not at the top (torch, the loop): the sweep's parent process (planning, counting,
    # --dry-run) imports this module torch-free; each run's own process loads them
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    cfg = ExperimentConfig.from_dict(cfg_dict)
    run_dir = Path(cfg.out_dir) / cfg.name
    try:
        from stalepipe.training.train.loop import train  # here: torch (see above)

        make_owned_dir(run_dir, RUN_KIND, within=cfg.out_dir)  # a sweep's: no link out of it
        with lease_run(run_dir) as me:
            if run_status(run_dir, cfg.train.num_steps) == "finished":  # another owner's, since
                raise RunLeased(run_dir, me)  # this sweep planned: not trained here
            train(cfg, resume=True, verbose=False, leased=True)  # held: not taken twice
    except RunLeased as e:  # another sweep or job trains it: not ours, nothing touched
        raise SystemExit(e.exit_code) from None
    except KeyboardInterrupt:
        raise
    except Preempted as e:  # a signal: the run checkpointed; a rerun of the sweep resumes it
        raise SystemExit(e.exit_code) from None
    except BaseException as e:  # noqa: BLE001 - recorded, then the process exits non-zero
        write_error(run_dir, f"{type(e).__name__}: {e}", traceback.format_exc())
        raise SystemExit(1) from None


def run_task(cfg_dict: dict[str, Any], threads: int) -> int:
    """One submitit array task (`experiments.executors`): the worker body; a run stopped by a
    signal after its checkpoint (exit 75) requeues its task under SLURM. Returns the exit code."""
    try:
        run_one(cfg_dict, threads)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if code == EXIT_PREEMPTED and (why := requeue()) is not None:
            # a cluster that refuses requeues leaves the task interrupted: say so where the
            # task's log and sacct show it (its own exit status), with the way on
            print(
                f"stalepipe: error: {why}; the run is checkpointed but will not restart by "
                f"itself: rerun the sweep to resume it",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_REQUEUE_FAILED
        return code
    return 0


def requeue() -> str | None:
    """Ask SLURM to requeue this array task: None when it did (or outside SLURM, where there
    is nothing to requeue), else why not, in one line (the task's log carries it)."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID")
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{job}_{task}" if job and task else os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    except OSError as e:
        return f"scontrol requeue {job_id} could not run ({e.strerror or e})"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        return (
            f"scontrol requeue {job_id} failed (exit {done.returncode}: {said[-1] if said else ''})"
        )
    return None
