"""A run's metrics.jsonl: one JSON object per logged step (and TensorBoard scalars beside),
and the `Meter` that times the run for it.

Reports read these files only; they never retrain.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalepipe.fileio import check_writable, inside, open_append, read_record, write_text_atomic
from stalepipe.training.rundir.trackers import scalars

if TYPE_CHECKING:
    import torch


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl, and hands each line's numbers to the
    run's trackers (`rundir.trackers`: TensorBoard, W&B, trackio, MLflow). On resume, lines
    from steps at or after the resume point are dropped first, so the file reads as one
    uninterrupted run. A symbolic link at metrics.jsonl (live or dangling) is refused before
    anything is read or written (`fileio.check_writable`): appending through it would grow a
    file outside the run."""

    def __init__(self, run_dir: Path, start_step: int, trackers: list[Any] | None = None) -> None:
        run_dir = Path(run_dir)
        self.path = check_writable(run_dir / "metrics.jsonl", within=run_dir)
        if self.path.exists():
            kept = [
                line
                for line in read_record(run_dir, self.path).splitlines()
                if line.strip() and _step_of(line) < start_step
            ]
            write_text_atomic(self.path, "".join(line + "\n" for line in kept), within=run_dir)
        self._trackers = trackers or []
        self._f = open_append(self.path, within=run_dir)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self._trackers:
            values = scalars(record)
            for t in self._trackers:
                t.log(values, record["step"])

    def close(self) -> None:
        self._f.close()
        for t in self._trackers:
            t.close()


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", -1))
    except (json.JSONDecodeError, TypeError, ValueError):
        return 1 << 62  # a torn last line from a crash: drop it


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """All records of a run's metrics.jsonl: the lines holding a JSON object (a torn final
    line, or any other, is skipped). A link out of the run is refused (`fileio.inside`); the
    values are as written, a reader checks the ones it uses (`analysis.results`)."""
    path = inside(run_dir, Path(run_dir) / "metrics.jsonl")
    out = []
    if path.exists():
        for line in read_record(run_dir, path).splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                out.append(record)
    return out


# Steps after a (re)start that throughput leaves out: torch.compile traces and compiles there,
# the optimizer makes its state, the caching allocator and cuBLAS/cuDNN warm up. Three, because
# a delayed policy's first steps take other paths than the rest (2bw's step 1 still reads W_0;
# EF's first buffer) and a compiled model may recompile for them.
TIMING_WARMUP_STEPS = 3
# The fields of a log line that time the run: they differ between a run and its resumed copy
# (which warms up again), everything else is bitwise the same.
TIMING_FIELDS = ("tokens_per_s", "timed_from_step", "model_flops_per_s", "mfu", "peak_mem_gib")


class Meter:
    """Tokens, throughput, MFU and peak memory of a run since its (re)start (`start`).

    Throughput is steady-state: timed from the end of the first `warmup` steps after the
    (re)start, and without the time spent in evaluations and checkpoints (`paused`). Until the
    warm-up is over (or in a run too short for one) it is the rate since the start, and each
    log line says which it is (`timed_from_step`). `peak_flops`: the dense bf16 peak of all the
    run's devices (0: unknown, no MFU). `device`: CUDA devices also report peak memory."""

    def __init__(
        self,
        *,
        start: int,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops: float = 0.0,
        device: torch.device | None = None,
        warmup: int = TIMING_WARMUP_STEPS,
    ) -> None:
        self.start, self.warmup, self.peak = start, warmup, peak_flops
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.cuda = device if device is not None and device.type == "cuda" else None
        if self.cuda is not None:
            import torch  # here, not at the top: the lab reads metrics.jsonl torch-free

            self._torch_cuda = torch.cuda
        self.t0 = time.perf_counter()
        self._paused_s = 0.0
        self._steady: tuple[int, float] | None = None  # (first timed step, busy clock then)

    def _busy(self, sync: bool = False) -> float:
        """Seconds since the start, less the paused ones. `sync`: let the GPU finish first."""
        if sync and self.cuda is not None:
            self._torch_cuda.synchronize(self.cuda)
        return time.perf_counter() - self.t0 - self._paused_s

    def elapsed(self) -> float:
        """Wall time since the start (evaluations and checkpoints included)."""
        return max(time.perf_counter() - self.t0, 1e-9)

    def step_done(self, step: int) -> None:
        """Call once per step as soon as its result is in: the end of the warm-up starts the
        steady-state clock."""
        if self._steady is None and step == self.start + self.warmup - 1:
            self._steady = (step + 1, self._busy(sync=True))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave what runs inside (an evaluation, a checkpoint) out of the throughput."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - t

    def timed_from(self, step: int) -> int:
        """The first step the throughput at `step` counts."""
        return self._steady[0] if self._steady and step >= self._steady[0] else self.start

    def tokens_per_s(self, step: int, sync: bool = False) -> float:
        """Tokens per second over the steps `timed_from(step)` .. `step`."""
        first = self.timed_from(step)
        t0 = self._steady[1] if self._steady and first == self._steady[0] else 0.0
        seconds = max(self._busy(sync) - t0, 1e-9)
        return (step + 1 - first) * self.tokens_per_step / seconds

    def fields(self, step: int) -> dict[str, Any]:
        """The throughput fields of a log line at `step`."""
        tok_s = self.tokens_per_s(step, sync=True)
        out: dict[str, Any] = {
            "tokens": (step + 1) * self.tokens_per_step,
            "tokens_per_s": tok_s,
            "timed_from_step": self.timed_from(step),
            "model_flops_per_s": tok_s * self.flops_per_token,
        }
        if self.peak:
            out["mfu"] = out["model_flops_per_s"] / self.peak
        if self.cuda is not None:
            out["peak_mem_gib"] = self._torch_cuda.max_memory_allocated(self.cuda) / 2**30
        return out
