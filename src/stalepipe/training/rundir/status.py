"""A run directory's status read from its records alone (finished, failed, partial or missing),
the error record a crashed run leaves, and the path a step's checkpoint has.

Both the sweep (which runs to skip or resume, which crashes to record) and the analysis (which
runs to read) ask it, so it lives below both, torch-free (`rundir.checkpoint`, which loads
checkpoints, is not).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from stalepipe.config import upgrade_record
from stalepipe.fileio import inside, make_owned_dir, read_json_record, write_json_atomic
from stalepipe.training.rundir.metrics import read_metrics

ERROR_FILE = "error.json"  # a crashed run's error, written by the sweep
SPEC_FILE = "sweep.json"  # the sweep's record of a planned run (name, group, overrides)
RUN_KIND = "run"  # the kind in a run directory's marker (fileio.MARKER)


def run_status(
    run_dir: Path, steps: int | None = None, metrics: Callable[[], list[dict]] | None = None
) -> str:
    """'finished', 'failed', 'partial' (started, resumable) or 'missing'.

    Finished is read from the run's records alone, so a run directory committed or copied
    without its checkpoints still counts: the last line of metrics.jsonl is the final step's
    (`steps - 1`) and holds its val_loss. The loop writes that line only after the last update
    and its evaluation, so a run stopped by a signal (it ends at an earlier step), a crash
    before the end, or a torn last line (skipped) never reads as finished; a crash after it
    writes error.json, which wins. The final checkpoint, when present, also counts (it is
    written after that line). `steps` defaults to the run's own config.json; `metrics` reads
    the run's records (default `read_metrics`; a reader that needs them too passes its own
    cached one, so the file is parsed once)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return "missing"
    if inside(run_dir, run_dir / ERROR_FILE).exists():
        return "failed"
    if steps is None:
        try:
            saved = upgrade_record(read_json_record(run_dir, run_dir / "config.json"))
            steps = int(saved["train"]["num_steps"])
        except (OSError, ValueError, KeyError, TypeError):
            return "partial" if any(run_dir.iterdir()) else "missing"
    if checkpoint_path(run_dir, steps).exists():
        return "finished"
    records = metrics() if metrics is not None else read_metrics(run_dir)
    if records and records[-1].get("step") == steps - 1 and "val_loss" in records[-1]:
        return "finished"
    return "partial" if any(run_dir.iterdir()) else "missing"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """The checkpoint of `step` in `run_dir`: the directory (format 2), or an older version's
    file when only that exists."""
    new, old = Path(run_dir) / f"ckpt_{step:08d}", Path(run_dir) / f"ckpt_{step:08d}.pt"
    return old if old.exists() and not new.exists() else new


def write_error(run_dir: Path, message: str, tb: str = "") -> None:
    """Record a failed run: error.json holds the message and traceback."""
    make_owned_dir(run_dir, RUN_KIND, within=run_dir.parent)
    info = {"error": message, "traceback": tb, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json_atomic(run_dir / ERROR_FILE, info, sort_keys=False, within=run_dir)
