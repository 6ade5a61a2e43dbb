"""Run directories: `runs/<name>/` with config.json, meta.json, metrics.jsonl and checkpoints.

Reports read only these files. Opening a run directory decides between a fresh start, a resume
and a refusal, so that nothing already saved is ever overwritten by accident.
"""

from __future__ import annotations

import json
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import stalepipe
from stalepipe.config import ExperimentConfig
from stalepipe.errors import UserError
from stalepipe.fileio import flatten_dict, write_json_atomic, write_text_atomic
from stalepipe.train.checkpoint import latest_checkpoint
from stalepipe.train.resume import config_diff


def _git(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            ["git", *args],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(stalepipe.__file__).parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit() -> str | None:
    """The commit of the installed stalepipe's checkout (None outside a git checkout)."""
    out = _git("rev-parse", "HEAD")
    return (out.stdout.strip() or None) if out is not None and out.returncode == 0 else None


def git_dirty() -> bool | None:
    """Whether the checkout has uncommitted changes to tracked files, i.e. whether
    `git_commit` alone does not describe the code that ran (None outside a git checkout)."""
    out = _git("status", "--porcelain", "--untracked-files=no")
    return bool(out.stdout.strip()) if out is not None and out.returncode == 0 else None


def open_run_dir(
    cfg: ExperimentConfig,
    *,
    resume: bool,
    overwrite: bool,
    extra_meta: dict[str, Any] | None = None,
) -> Path:
    """Create or reopen `cfg.out_dir/cfg.name` and write config.json and meta.json.

    - new directory: start fresh;
    - existing run without --resume / --overwrite: refuse (UserError), touching nothing;
    - --resume: the saved config must match `cfg` except for RESUMABLE_CHANGES;
    - --overwrite: delete the old run first.
    """
    if resume and overwrite:
        raise UserError("--resume and --overwrite exclude each other; pick one")
    run_dir = Path(cfg.out_dir) / cfg.name
    saved_cfg = run_dir / "config.json"
    if run_dir.exists() and any(run_dir.iterdir()):
        if overwrite:
            shutil.rmtree(run_dir)
        elif not resume:
            raise UserError(
                f"run directory {run_dir} already exists; pass --resume to continue it, "
                f"--overwrite to replace it, or choose another --name"
            )
        elif saved_cfg.is_file():
            try:
                saved = json.loads(saved_cfg.read_text())
            except json.JSONDecodeError:
                raise UserError(
                    f"{saved_cfg} is corrupt; fix it or start over with --overwrite"
                ) from None
            diff = config_diff(saved, cfg.to_dict())
            if diff:
                shown = ", ".join(
                    f"{k}: {flatten_dict(saved).get(k)!r} -> {flatten_dict(cfg.to_dict()).get(k)!r}"
                    for k in diff[:3]
                )
                raise UserError(
                    f"--resume with a different config ({shown}); resume with the run's own "
                    f"settings (stalepipe train --config {saved_cfg} --resume) or use a new --name"
                )
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(saved_cfg, cfg.to_dict())
    meta = {
        "stalepipe": stalepipe.__version__,
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # resumed from a checkpoint (--resume on a run without one simply starts)
        "resumed": bool(resume) and latest_checkpoint(run_dir) is not None,
        **(extra_meta or {}),
    }
    write_json_atomic(run_dir / "meta.json", meta)
    return run_dir


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl (and, with `tensorboard`, every
    numeric value as a TensorBoard scalar under `<run>/tensorboard`). On resume, lines from
    steps at or after the resume point are dropped first, so the file reads as one
    uninterrupted run."""

    def __init__(self, run_dir: Path, start_step: int, tensorboard: bool = False) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        if self.path.exists():
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if line.strip() and _step_of(line) < start_step
            ]
            write_text_atomic(self.path, "".join(line + "\n" for line in kept))
        self._tb = (
            _tensorboard_writer(Path(run_dir) / "tensorboard", start_step) if tensorboard else None
        )
        self._f = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self._tb is not None:
            step = record["step"]
            for key, value in record.items():
                if isinstance(value, list):  # e.g. tau per stage
                    for i, v in enumerate(value):
                        self._tb.add_scalar(f"{key}/{i}", v, step)
                elif isinstance(value, int | float) and key != "step":
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def _tensorboard_writer(log_dir: Path, start_step: int) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError(
            "train.tensorboard needs the tensorboard package: pip install tensorboard "
            "(or pip install -e '.[tensorboard]')"
        ) from None
    return SummaryWriter(log_dir=str(log_dir), purge_step=start_step or None)


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", -1))
    except (json.JSONDecodeError, TypeError, ValueError):
        return 1 << 62  # a torn last line from a crash: drop it


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """All records of a run's metrics.jsonl (a torn final line is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
