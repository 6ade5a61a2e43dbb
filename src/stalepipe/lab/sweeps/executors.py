"""Where a sweep's runs execute: this machine's process pool, or submitit (SLURM job arrays, and
its local and debug executors for checking the same path without a cluster).

- `local` (the default): `experiments.workers.run_spawned`, one spawned process per run,
  `--workers` at a time. Measured against submitit's LocalExecutor on short runs
  (benchmarks/speed/sweep_executors.py, docs/benchmarks.md): the pool is faster, it starts each run
  without writing pickles and log files or polling them, so it stays the local executor.
- `slurm`: one job array through submitit, one array task per run, at most
  `array_parallelism` at once. `stalepipe sweep` submits and returns (the runs outlive it);
  running it again shows what finished, skips what runs (leased: `rundir.lease`) and submits
  only the rest.
- `submitit-local` / `submitit-debug`: submitit's local and in-process executors, which run
  the very task a SLURM array task runs; used by the tests and for debugging a job locally.

A task that SLURM preempts gets SIGTERM, and SIGUSR1 90 s before its time limit (the array's
`--signal`): the run checkpoints and exits 75 (docs/failures.md), and the task requeues itself
(`scontrol requeue`); the requeued task finds its own claim (same job id), takes it over and
resumes from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalepipe.errors import UserError
from stalepipe.fileio import inside
from stalepipe.lazy import require

EXECUTORS = ("local", "slurm", "submitit-local", "submitit-debug")
# Per run, where --slurm-* does not say (`SlurmOptions.for_runs`): a GPU run's data loading,
# compile workers and host copies of its state; a CPU run its torch threads.
CUDA_CPUS, CUDA_MEM, CPU_MEM = 8, "64G", "8G"
SUBMITIT_DIR = ".submitit"  # inside the sweep directory: job scripts, pickles and logs


@dataclass(frozen=True, kw_only=True)
class SlurmOptions:
    """What a team sets for a SLURM job array (`stalepipe sweep --slurm-*`)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = 240
    gpus_per_run: int | None = None  # None: what the runs' device needs (`for_runs`)
    cpus_per_run: int | None = None
    mem: str | None = None  # e.g. "32G"
    array_parallelism: int = 64
    sbatch: tuple[str, ...] = field(default_factory=tuple)  # extra lines: "constraint=h100"
    setup: tuple[str, ...] = field(default_factory=tuple)  # shell lines before the task

    def __post_init__(self) -> None:
        flags = {
            "time_min": "time",
            "cpus_per_run": "cpus-per-run",
            "array_parallelism": "array-parallelism",
        }  # the CLI's names
        for name, flag in flags.items():
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"--slurm-{flag} must be >= 1, got {getattr(self, name)}")
        if self.gpus_per_run is not None and self.gpus_per_run < 0:
            raise UserError("--slurm-gpus-per-run must be >= 0")
        for line in self.sbatch:
            if "=" not in line and not line.lstrip("-").isidentifier():
                raise UserError(f"--slurm-sbatch {line!r}: give KEY=VALUE (e.g. constraint=h100)")

    def for_runs(self, cuda: bool, threads: int) -> SlurmOptions:
        """These options with what the runs need filled in where not given: runs on CUDA get
        one GPU, `CUDA_CPUS` CPUs and `CUDA_MEM` each; runs on the CPU no GPU, `threads` CPUs
        (train.threads, at least 1) and `CPU_MEM`. A GPU count of 0 for CUDA runs is refused:
        every task would fail on the cluster."""
        if cuda and self.gpus_per_run == 0:
            raise UserError(
                "--slurm-gpus-per-run 0, but the runs train on CUDA (train.device): every task "
                "would fail without a GPU; drop the flag (one GPU per run) or train on the CPU "
                "(--set train.device=cpu)"
            )
        return dataclasses.replace(
            self,
            gpus_per_run=self.gpus_per_run if self.gpus_per_run is not None else int(cuda),
            cpus_per_run=self.cpus_per_run or (CUDA_CPUS if cuda else max(threads, 1)),
            mem=self.mem or (CUDA_MEM if cuda else CPU_MEM),
        )

    def parameters(self) -> dict[str, Any]:
        """submitit's SLURM parameters for one run per array task (after `for_runs`)."""
        # SIGUSR1 90 s before the time limit: the run's own handler checkpoints and exits 75,
        # and the task requeues itself (submitit's USR2 handler would exit mid-step instead);
        # --requeue lets it where the cluster's default does not
        extra: dict[str, Any] = {"signal": "USR1@90", "requeue": True}
        for line in self.sbatch:
            key, _, value = line.lstrip("-").partition("=")
            extra[key.replace("-", "_")] = value or True
        params: dict[str, Any] = {
            "time": self.time_min,
            "nodes": 1,
            "ntasks_per_node": 1,
            "cpus_per_task": self.cpus_per_run or 1,
            "array_parallelism": self.array_parallelism,
            "job_name": "stalepipe-sweep",
            "setup": list(self.setup),
            "additional_parameters": extra,
        }
        if self.gpus_per_run:
            params["gpus_per_node"] = self.gpus_per_run
        for key in ("partition", "account", "qos", "mem"):
            if getattr(self, key) is not None:
                params[key] = getattr(self, key)
        return params


def sbatch_script(out: Path, opts: SlurmOptions, num_runs: int) -> str:
    """The sbatch array script `--executor slurm` would submit for `num_runs` runs."""
    require("submitit", "--executor slurm")
    from submitit.slurm.slurm import _make_sbatch_string  # optional: required above

    folder = out / SUBMITIT_DIR / "%j"
    python = shlex.quote(sys.executable)
    command = f"{python} -u -m submitit.core._submit {shlex.quote(str(folder))}"
    return _make_sbatch_string(
        command=command, folder=folder, map_count=num_runs, **opts.parameters()
    )


SLURM_COMMANDS = ("sbatch", "srun")  # submitit submits with the one, runs each task with the other


def check_slurm() -> None:
    """UserError, in one line, unless SLURM's commands are on this machine's PATH: called
    before the sweep makes its directory or its runs', so a sweep started off the cluster
    leaves nothing behind (submitit's own refusal comes only after they were made)."""
    missing = [c for c in SLURM_COMMANDS if shutil.which(c) is None]
    if missing:
        raise UserError(
            f"--executor slurm submits a job array with SLURM's {' and '.join(SLURM_COMMANDS)}, "
            f"but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on this "
            f"machine's PATH; start the sweep on the cluster's login node, or pass --executor "
            f"local to run it here (--dry-run prints the array's sbatch script without SLURM)"
        )


def make_executor(kind: str, out: Path, opts: SlurmOptions) -> Any:
    """A submitit executor of `kind` (a name of EXECUTORS other than `local`)."""
    submitit = require("submitit", f"--executor {kind}")
    inside(out, out / SUBMITIT_DIR)  # submitit writes there: not through a link out of the sweep
    folder = out / SUBMITIT_DIR / "%j"
    if kind == "slurm":
        ex = submitit.SlurmExecutor(folder=folder)
        ex.update_parameters(**opts.parameters())
        return ex
    if kind == "submitit-debug":
        return submitit.DebugExecutor(folder=folder)
    ex = submitit.LocalExecutor(folder=folder)
    ex.update_parameters(timeout_min=opts.time_min)
    return ex


def run_array(
    kind: str,
    out: Path,
    opts: SlurmOptions | None,
    task: Callable[[dict[str, Any], int], int],
    tasks: Sequence[tuple[Any, dict[str, Any], int]],
    on_done: Callable[[Any, int, float], None],
    log: Callable[[str], None],
    workers: int = 1,
) -> None:
    """Submit `task` (a module-level function of a config dict and a thread count that
    returns an exit code) once per run, (key, config dict, threads) each, as a job array. SLURM:
    submitted and left running. submitit's local and debug executors: waited for, each
    task's exit code handed to `on_done(key, code, seconds)` as the sweep's pool does, in
    waves of `workers` (submitit's local executor starts every task of an array at once)."""
    ex = make_executor(kind, out, opts or SlurmOptions())
    if kind == "slurm":
        jobs = ex.map_array(task, [t[1] for t in tasks], [t[2] for t in tasks])
        array = str(jobs[0].job_id).split("_")[0]
        where = out / SUBMITIT_DIR
        log(f"submitted job array {array}: {len(jobs)} runs, logs in {where}")
        log("run the same command again to see what finished (runs in flight are skipped)")
        return
    for i in range(0, len(tasks), max(workers, 1)):
        wave = tasks[i : i + max(workers, 1)]
        t = time.perf_counter()
        jobs = ex.map_array(task, [w[1] for w in wave], [w[2] for w in wave])
        for (key, _, _), job in zip(wave, jobs):
            try:
                code = job.result()
            except Exception:  # the task's process died (killed, out of memory): that run only
                code = 1
            on_done(key, code, time.perf_counter() - t)
