"""A run's metrics.jsonl: one JSON object per logged step (and TensorBoard scalars beside).

Reports read these files only; they never retrain.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stalepipe.errors import UserError
from stalepipe.fileio import write_text_atomic


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
