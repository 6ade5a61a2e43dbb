"""Sweeps: a grid of runs (`experiments.grid`: `RunSpec`s), each one run directory, executed
by parallel worker processes.

Running it (`run_sweep`) is restartable: a finished run (its final val_loss is in metrics.jsonl,
or its final checkpoint exists) is skipped, also when its directory came from another machine
without checkpoints (`record_files`); an interrupted one resumes from its last checkpoint; a
failed one (an `error.json` in its directory) is reported and rerun only with
`retry_failed=True`; one that stopped before its first checkpoint starts over. The sweep
directory and its run directories are marked as stalepipe's (`fileio.MARKER`): deleting one
(a failed run retried, `overwrite=True`) follows `fileio.remove_owned_dir`'s rule. Each run executes in its own spawned process with one torch thread, so a
crash (even a segfault or an out-of-memory kill) loses that run only.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from stalepipe.config import ExperimentConfig, upgrade_record
from stalepipe.errors import EXIT_LEASED, EXIT_PREEMPTED, Preempted
from stalepipe.fileio import (
    MARKER,
    check_removable,
    flatten_dict,
    make_owned_dir,
    read_json_record,
    remove_owned_dir,
    write_json_atomic,
)
from stalepipe.lab.analysis.results import config_key
from stalepipe.lab.sweeps.executors import run_array
from stalepipe.lab.sweeps.grid import RunSpec
from stalepipe.lab.sweeps.workers import gpu_slots, run_spawned
from stalepipe.training.rundir.lease import live_owner
from stalepipe.training.rundir.metrics import read_metrics
from stalepipe.training.rundir.status import ERROR_FILE, SPEC_FILE, run_status, write_error

SWEEP_KIND = "sweep"  # the kind in a sweep directory's marker
SWEEP_FIX = "choose another --out"
# `stalepipe report`'s default output inside a sweep (RUNS/report) and what it writes there.
REPORT_DIR, REPORT_ENTRIES = "report", ("*.md", "*.html", "*.csv", "*.png")

# What a finished run needs to be read back and skipped by a later sweep (no checkpoints).
RECORD_FILES = (MARKER, "config.json", "meta.json", "metrics.jsonl", SPEC_FILE)


class Trainer(Protocol):
    """What trains one run of a sweep. The lab never imports the training loop: whoever starts
    a sweep hands one in, and `stalepipe sweep` hands the training wing's task module
    (`training/launch/task.py`), whose module-level functions a spawned worker can be sent."""

    def run_one(self, cfg_dict: dict[str, Any], threads: int) -> None:
        """Lease, train or resume the run; a failure goes to its error.json and SystemExit."""

    def run_task(self, cfg_dict: dict[str, Any], threads: int) -> int:
        """The same as one submitit array task (requeued under SLURM): its exit code."""


def record_files(out: str | Path) -> list[Path]:
    """The files to commit (or copy) so that a sweep on another machine sees every finished
    run of the sweep directory `out` as finished and reports it: each finished run's
    `RECORD_FILES` and the sweep's marker; unfinished, failed and checkpoint files are left
    out (a rerun runs those runs)."""
    out = Path(out)
    files = [out / MARKER] if (out / MARKER).exists() else []
    for run_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        if run_status(run_dir) == "finished":
            files += [run_dir / f for f in RECORD_FILES if (run_dir / f).exists()]
    return files


def run_identity(flat: dict[str, Any]) -> tuple:
    """What makes two runs one run: the configuration as the report groups it
    (`results.config_key`: names, logging knobs and settings at their defaults left out) and
    the seeds. A flattened config as train() records it (optimizer defaults resolved)."""
    return config_key(flat), json.dumps(flat.get("train.seed")), json.dumps(flat.get("data.seed"))


def _recorded(cfg: ExperimentConfig) -> dict[str, Any]:
    """`cfg` flattened as train() writes it to config.json (optimizer defaults resolved)."""
    # here, not at the top (torch, the rundir readers below too): the sweep's planning and
    # `--dry-run` import this module torch-free; what resumes or runs a run loads them
    from stalepipe.training.optim import resolve_config

    return flatten_dict(dataclasses.replace(cfg, optim=resolve_config(cfg.optim)).to_dict())


def _saved(run_dir: Path) -> dict[str, Any] | None:
    """The run's config.json, upgraded and flattened; None when absent or unreadable."""
    try:  # no link out of the run (LinkError)
        return flatten_dict(upgrade_record(read_json_record(run_dir, run_dir / "config.json")))
    except (OSError, ValueError):
        return None


def _finished_runs(out: Path) -> dict[tuple, str]:
    """`run_identity` -> name of each finished run directory under `out` (one without a
    readable config.json is matched by its name only)."""
    index: dict[tuple, str] = {}
    for d in sorted(p for p in out.iterdir() if p.is_dir()) if out.is_dir() else []:
        saved = _saved(d) if run_status(d) == "finished" else None
        if saved is not None:
            index.setdefault(run_identity(saved), d.name)
    return index


@dataclass(frozen=True)
class Planned:
    """A run of a sweep as the sweep finds it: its config, status and, when the same run
    (`run_identity`) is finished under another name in the sweep directory or comes earlier
    in the sweep, that run's name (`same`): the sweep does not repeat it."""

    spec: RunSpec
    config: ExperimentConfig
    status: str  # run_status
    same: str = ""


def plan_status(specs: Sequence[RunSpec], base: ExperimentConfig, out: Path) -> list[Planned]:
    """Every spec's `Planned` entry, in order (reads the sweep directory, changes nothing).
    Studies list one configuration under several names (each hparams grid repeats the
    baseline) and share arms with other studies swept into one directory (study 1's sync
    runs in the momentum grid): each such run is trained once."""
    finished, planned = _finished_runs(out), {}
    result = []
    for spec in specs:
        cfg = spec.config(base, out)
        status = run_status(out / spec.name, cfg.train.num_steps)
        same = ""
        if status != "finished":
            ident = run_identity(_recorded(cfg))
            same = finished.get(ident) or planned.get(ident, "")
            planned.setdefault(ident, spec.name)
        result.append(Planned(spec, cfg, status, same))
    return result


@dataclass
class SweepResult:
    """Counts and names of a sweep's runs after `run_sweep`."""

    finished: list[str] = field(default_factory=list)  # finished before or during this call
    ran: list[str] = field(default_factory=list)  # trained (to the end) by this call
    failed: dict[str, str] = field(default_factory=dict)  # name -> error message
    skipped_failed: list[str] = field(default_factory=list)  # failed earlier, not retried
    same: dict[str, str] = field(default_factory=dict)  # name -> the run it repeats (not run)
    elsewhere: list[str] = field(default_factory=list)  # leased by a live owner: not ours
    changed: dict[str, list[str]] = field(default_factory=dict)  # finished with another config
    wall_s: float = 0.0


def _changed_keys(run_dir: Path, cfg: ExperimentConfig) -> list[str]:
    """Config keys whose saved value (config.json) differs from `cfg` (optimizer defaults
    resolved as train() records them; keys the saved file lacks, e.g. added later, and fields
    that do not change the trajectory are ignored)."""
    from stalepipe.training.rundir.resume import RESUMABLE_CHANGES  # here: torch (see _recorded)

    saved = _saved(run_dir)
    if saved is None:
        return []
    now = _recorded(cfg)
    skip = RESUMABLE_CHANGES | {"name", "out_dir", "data.data_dir"}
    return sorted(k for k in saved if k in now and k not in skip and saved[k] != now[k])


def _read_error(run_dir: Path) -> str:
    try:
        return str(read_json_record(run_dir, run_dir / ERROR_FILE).get("error", "unknown error"))
    except (OSError, ValueError):
        return "unknown error"


def _prepare_data(cfgs: list[ExperimentConfig]) -> None:
    """Prepare each distinct corpus once, before the workers start (they would all wait)."""
    from stalepipe.training.data import ensure_prepared  # here: torch (see _recorded)

    seen = set()
    for cfg in cfgs:
        key = (cfg.data.corpus, cfg.data.tokenizer, cfg.data.resolved_dir())
        if key not in seen:
            seen.add(key)
            ensure_prepared(cfg.data)


def run_sweep(
    trainer: Trainer,
    specs: Sequence[RunSpec],
    base: ExperimentConfig,
    out_dir: str | Path,
    *,
    workers: int = 1,
    threads: int = 1,
    retry_failed: bool = False,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
    executor: str = "local",
    slurm: Any = None,
) -> SweepResult:
    """Run every spec not finished yet under `out_dir`, `workers` at a time, each trained by
    `trainer` (`Trainer`).

    `workers=1` runs in this process (no spawn cost; a hard crash stops the sweep, which a
    rerun resumes); `workers>1` spawns one process per run. Never raises for a failed run:
    failures are recorded in the run's error.json and returned in `SweepResult.failed`.
    `overwrite` first deletes the sweep directory, if `remove_sweep_dir` allows it.
    `executor` other than "local" goes through submitit (`experiments.executors`, with
    `slurm` its SlurmOptions): "slurm" submits a job array and returns without waiting."""
    out = Path(out_dir)
    if overwrite and out.is_dir() and any(out.iterdir()):
        remove_sweep_dir(out)
    make_owned_dir(out, SWEEP_KIND)
    res = SweepResult()
    t0 = time.perf_counter()
    todo = _plan(specs, base, out, retry_failed, res)
    log(
        f"sweep {out}: {len(specs)} runs: {len(res.finished)} finished, "
        + (f"{len(res.same)} the same as another run (not repeated), " if res.same else "")
        + (f"{len(res.elsewhere)} trained by another sweep or job now, " if res.elsewhere else "")
        + f"{len(res.skipped_failed)} failed earlier"
        + (" (rerun with --retry-failed)" if res.skipped_failed else "")
        + f", {len(todo)} to run with {workers} worker(s)"
    )
    if res.changed:
        name, keys = next(iter(res.changed.items()))
        log(
            f"warning: {len(res.changed)} finished run(s) were made with a different config than "
            f"the sweep's now (e.g. {name}: {', '.join(keys[:3])}); they are kept as they are: "
            f"delete their directories to rerun them"
        )
    if todo:
        _prepare_data([c for _, c in todo])
    _write_spec_files(out, specs, [s for s, _ in todo])
    progress = _Progress(out, res, len(todo), workers, log)
    if executor != "local" and todo:
        tasks = [(spec, cfg.to_dict(), threads) for spec, cfg in todo]
        run_array(executor, out, slurm, trainer.run_task, tasks, progress.done, log, workers)
    elif workers <= 1:
        for spec, cfg in todo:
            t = time.perf_counter()
            try:
                trainer.run_one(cfg.to_dict(), threads)
                exitcode = 0
            except SystemExit as e:
                exitcode = e.code if isinstance(e.code, int) else 1
            progress.done(spec, exitcode, time.perf_counter() - t)
            if exitcode == EXIT_PREEMPTED:  # the signal stops the sweep, not only this run
                raise Preempted(f"sweep {out} stopped by a signal; rerun it to resume")
    else:
        jobs = [(spec, (cfg.to_dict(), threads)) for spec, cfg in todo]
        slots = gpu_slots(_gpus_for([cfg for _, cfg in todo]))
        done = lambda f: progress.done(f.key, f.exitcode, f.seconds)  # noqa: E731
        run_spawned(trainer.run_one, jobs, workers, done, slots)
    res.wall_s = time.perf_counter() - t0
    log(
        f"sweep {out}: {len(res.finished)}/{len(specs) - len(res.same)} finished, "
        f"{len(res.failed)} failed ({_fmt_s(res.wall_s)})"
    )
    return res


def _gpus_for(cfgs: list[ExperimentConfig]) -> int:
    """How many GPUs to spread runs over: the visible ones when every run asks for plain
    `cuda` (an explicit `cuda:N` is the user's choice), else 0."""
    if not cfgs or any(c.train.device != "cuda" for c in cfgs):
        return 0
    import torch  # here: torch (see _recorded)

    return torch.cuda.device_count()


def _plan(
    specs: Sequence[RunSpec],
    base: ExperimentConfig,
    out: Path,
    retry_failed: bool,
    res: SweepResult,
) -> list[tuple[RunSpec, ExperimentConfig]]:
    """The runs still to do, with their configs; finished runs (and those made with another
    config), repeats of another run (`plan_status`) and failed ones not retried go into
    `res`. A failed run to retry, and one that stopped before its first checkpoint, is
    deleted (it starts over)."""
    from stalepipe.training.rundir.directory import RUN_ENTRIES, RUN_KIND  # here: torch

    todo = []
    for p in plan_status(specs, base, out):
        spec, cfg, status, run_dir = p.spec, p.config, p.status, out / p.spec.name
        if p.same:
            res.same[spec.name] = p.same
        elif status == "finished":
            res.finished.append(spec.name)
            changed = _changed_keys(run_dir, cfg)
            if changed:
                res.changed[spec.name] = changed
        elif live_owner(run_dir) is not None:  # trained elsewhere now: never delete or rerun it
            res.elsewhere.append(spec.name)
        elif status == "failed" and not retry_failed:
            res.skipped_failed.append(spec.name)
            res.failed[spec.name] = _read_error(run_dir)
        else:
            if status == "failed" or _stopped_before_checkpoint(run_dir):
                remove_owned_dir(run_dir, RUN_KIND, RUN_ENTRIES, within=out, fix=SWEEP_FIX)
            todo.append((spec, cfg))
    return todo


def _stopped_before_checkpoint(run_dir: Path) -> bool:
    """A run that trained some steps but wrote no checkpoint: --resume cannot continue it."""
    # here: torch (see _recorded)
    from stalepipe.training.rundir.checkpoint import latest_checkpoint
    from stalepipe.training.rundir.directory import run_state

    return run_state(run_dir) == "trained" and latest_checkpoint(run_dir) is None


def remove_sweep_dir(out: Path) -> None:
    """Delete the sweep directory `out` (NotOwnedError, nothing deleted, unless every part is
    stalepipe's): marked as a sweep, each subdirectory a run directory `remove_owned_dir`
    may delete or the report, and nothing else at its top."""
    from stalepipe.training.rundir.directory import RUN_ENTRIES, RUN_KIND  # here: torch

    allowed = [".*.deleting-*", ".submitit"]  # an interrupted deletion; submitit's job files
    for child in sorted(out.iterdir()):
        if child.name == REPORT_DIR and child.is_dir() and not child.is_symlink():
            foreign = [p.name for p in child.iterdir() if not _is_report_file(p)]
            if foreign:
                check_removable(child, "report", REPORT_ENTRIES, fix=SWEEP_FIX)  # names it
        elif child.is_dir() and not child.name.startswith("."):
            check_removable(child, RUN_KIND, RUN_ENTRIES, within=out, fix=SWEEP_FIX)
        else:
            continue
        allowed.append(glob.escape(child.name))
    remove_owned_dir(out, SWEEP_KIND, allowed, fix=SWEEP_FIX)


def _is_report_file(path: Path) -> bool:
    return path.is_file() and any(path.match(pat) for pat in REPORT_ENTRIES)


def _write_spec_files(out: Path, specs: Sequence[RunSpec], todo: list[RunSpec]) -> None:
    """sweep.json in every run directory that exists or is about to: it lets the report label
    runs the way the sweep named them, and list planned runs not started yet."""
    from stalepipe.training.rundir.directory import RUN_KIND  # here: torch (see _recorded)

    for spec in specs:
        d = out / spec.name
        if d.is_dir() or any(s is spec for s in todo):
            make_owned_dir(d, RUN_KIND, within=out)
            write_json_atomic(d / SPEC_FILE, dataclasses.asdict(spec), within=out)


@dataclass
class _Progress:
    """Records each run as it ends into the SweepResult and logs one line with an ETA."""

    out: Path
    res: SweepResult
    total: int
    workers: int
    log: Callable[[str], None]
    count: int = 0
    durations: list[float] = field(default_factory=list)

    def done(self, spec: RunSpec, exitcode: int, seconds: float) -> None:
        run_dir, res = self.out / spec.name, self.res
        self.count += 1
        if exitcode == 0 and run_status(run_dir) == "finished":
            res.ran.append(spec.name)
            res.finished.append(spec.name)
            self.durations.append(seconds)
            what = f"val {_final_val(run_dir):.4f}"
        elif exitcode == EXIT_PREEMPTED:  # checkpointed after a signal: a rerun resumes it
            what = "stopped by a signal (checkpointed; rerun the sweep to resume it)"
        elif exitcode == EXIT_LEASED and run_status(run_dir) == "finished":
            res.finished.append(spec.name)  # another sweep or job finished it meanwhile
            what = "finished by another sweep or job"
        elif exitcode == EXIT_LEASED:  # another sweep or job trains it right now
            res.elsewhere.append(spec.name)
            what = "trained by another sweep or job (leased); skipped"
        else:
            if not (run_dir / ERROR_FILE).exists():
                write_error(run_dir, f"worker exited without finishing (exit status {exitcode})")
            res.failed[spec.name] = _read_error(run_dir)
            what = "FAILED: " + res.failed[spec.name]
        left = self.total - self.count
        eta = ""
        if self.durations and left:
            mean = sum(self.durations) / len(self.durations)
            eta = f", ~{_fmt_s(mean * left / self.workers)} left"
        self.log(f"[{self.count}/{self.total}] {spec.name}: {what} ({seconds:.0f}s){eta}")


def _final_val(run_dir: Path) -> float:
    vals = [r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r]
    return vals[-1] if vals else math.nan


def _fmt_s(s: float) -> str:
    if s < 90:
        return f"{s:.0f}s"
    if s < 5400:
        return f"{s / 60:.0f}min"
    return f"{s / 3600:.1f}h"


def main_progress_stream() -> Callable[[str], None]:
    """A logger that prints with a timestamp and flushes (sweeps run for hours under nohup)."""

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True, file=sys.stdout)

    return log
