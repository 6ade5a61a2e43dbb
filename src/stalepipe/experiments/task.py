"""One run of a sweep as its worker executes it, wherever that is (a pool process, a submitit
array task, this process): claim the run, train or resume it, record a crash.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from stalepipe.config import ExperimentConfig
from stalepipe.errors import EXIT_PREEMPTED, EXIT_REQUEUE_FAILED, Preempted
from stalepipe.fileio import make_owned_dir, write_json_atomic
from stalepipe.rundir.status import ERROR_FILE, run_status


def write_error(run_dir: Path, message: str, tb: str = "") -> None:
    """Record a failed run: error.json holds the message and traceback."""
    from stalepipe.rundir.directory import RUN_KIND

    make_owned_dir(run_dir, RUN_KIND, within=run_dir.parent)
    info = {"error": message, "traceback": tb, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json_atomic(run_dir / ERROR_FILE, info, sort_keys=False, within=run_dir)


def run_one(cfg_dict: dict[str, Any], threads: int) -> None:
    """Worker body: lease the run (`rundir.lease`: exit EXIT_LEASED, touching nothing, when a
    live owner elsewhere trains it), then train it, resuming from its last checkpoint if it has
    one (a run directory holding only sweep.json starts fresh); an exception goes to
    error.json."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    cfg = ExperimentConfig.from_dict(cfg_dict)
    run_dir = Path(cfg.out_dir) / cfg.name
    try:
        from stalepipe.rundir.directory import RUN_KIND
        from stalepipe.rundir.lease import RunLeased, lease_run
        from stalepipe.train.loop import train

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
    from stalepipe.experiments.executors import requeue

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
