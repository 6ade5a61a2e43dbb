"""Experiment trackers beside metrics.jsonl: TensorBoard, Weights & Biases, trackio, MLflow.

`--log.tracker tensorboard,wandb,trackio,mlflow` (any subset; each an optional extra:
`pip install 'stalepipe[trackers]'`). metrics.jsonl stays the record every report reads; a tracker
is a view of it. Each gets the run's config once, at the start, and every logged line under
hierarchical names (`tracker_name`): train/loss, train/grad_norm, val/loss, optim/lr,
delay/tau/stage0, perf/tokens_per_s, ... Only the main process logs.

Offline by default, so a run never waits on a network: W&B in offline mode unless `WANDB_MODE`
says otherwise (`wandb sync <run>/wandb/offline-run-*` uploads later), MLflow into a file
store in the run directory (`<run>/mlruns`; `mlflow ui --backend-store-uri <run>/mlruns`)
unless `MLFLOW_TRACKING_URI` is set, trackio into its local database
(`TRACKIO_DIR`, default the user's cache). A resumed run continues the same W&B / MLflow run.
"""

from __future__ import annotations

import importlib
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from stalepipe.errors import UserError
from stalepipe.fileio import inside, read_record, write_text_atomic

_GROUPS = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "val_loss": "val/loss",
    "lr": "optim/lr",
    "lr_mult": "optim/lr_mult",
    "tau": "delay/tau",
    "tokens": "perf/tokens",
    "tokens_per_s": "perf/tokens_per_s",
    "model_flops_per_s": "perf/model_flops_per_s",
}


def tracker_name(key: str) -> str:
    """The hierarchical name of a metrics.jsonl key: its group, or train/<key>."""
    if key in _GROUPS:
        return _GROUPS[key]
    for prefix, group in (("val_", "val/"), ("router_", "moe/"), ("delay_", "delay/")):
        if key.startswith(prefix):
            return group + key[len(prefix) :]
    return f"train/{key}"


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric values of one metrics line under their tracker names (a list, such as tau
    per stage, becomes one scalar per entry)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("step", "timed_from_step"):
            continue
        name = tracker_name(key)
        if isinstance(value, list):
            for i, v in enumerate(value):
                if isinstance(v, int | float) and not isinstance(v, bool):
                    out[f"{name}/stage{i}"] = float(v)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


class Tracker(Protocol):
    def log(self, values: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


def open_trackers(
    names: tuple[str, ...], run_dir: Path, *, project: str, config: dict[str, Any], start_step: int
) -> list[Tracker]:
    """The trackers `names`, each started for this run (its config logged once)."""
    run_dir = Path(run_dir)
    openers = {"tensorboard": _tensorboard, "wandb": _wandb, "trackio": _trackio, "mlflow": _mlflow}
    out = []
    for n in names:
        try:
            out.append(openers[n](run_dir, project, config, start_step))
        except UserError:
            raise
        except Exception as e:  # the tracker's own failure: one line, the run not started
            for t in out:
                t.close()
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise UserError(
                f"log.tracker {n} could not start ({why}); fix its setup or drop it"
            ) from None
    return out


def _need(module: str, tracker: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"log.tracker {tracker} needs the {package} package: pip install {package} "
            "(or pip install 'stalepipe[trackers]')"
        ) from None


ID_FILE = ".tracker_id"


def _run_id(run_dir: Path) -> str:
    """The run's tracker id: made at a fresh start and kept in the run directory, so a resume
    continues the same tracker run and a run started over (`--overwrite`, a failed sweep run
    retried: a new directory) starts a new one."""
    path = inside(run_dir, run_dir / ID_FILE)  # no link out of the run
    if path.is_file():
        return read_record(run_dir, path).strip()
    run_id = uuid.uuid4().hex[:16]
    write_text_atomic(path, run_id + "\n", within=run_dir)
    return run_id


@dataclass(frozen=True)
class _Sink:
    """One started tracker: where a line's values go, and how it ends."""

    log: Callable[[dict[str, float], int], None]
    close: Callable[[], None]


def _tensorboard(run_dir: Path, project: str, config: dict[str, Any], start: int) -> _Sink:
    tb = _need("torch.utils.tensorboard", "tensorboard", "tensorboard")
    w = tb.SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start or None)

    def log(values: dict[str, float], step: int) -> None:
        for name, v in values.items():
            w.add_scalar(name, v, step)

    return _Sink(log, w.close)


def _wandb(run_dir: Path, project: str, config: dict[str, Any], start: int) -> _Sink:
    wandb = _need("wandb", "wandb", "wandb")
    mode = os.environ.get("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")  # no banner between the progress lines
    where = {"name": run_dir.name, "id": _run_id(run_dir), "dir": str(run_dir)}
    run = wandb.init(project=project, config=config, mode=mode, resume="allow", **where)
    return _Sink(lambda values, step: run.log(values, step=step), run.finish)


def _trackio(run_dir: Path, project: str, config: dict[str, Any], start: int) -> _Sink:
    trackio = _need("trackio", "trackio", "trackio")
    # the id in the name: run names repeat across sweep directories of one project
    name = f"{run_dir.name}-{_run_id(run_dir)[:8]}"
    trackio.init(project=project, name=name, config=config, resume="allow")
    return _Sink(lambda values, step: trackio.log(values, step=step), trackio.finish)


def _mlflow(run_dir: Path, project: str, config: dict[str, Any], start: int) -> _Sink:
    mlflow = _need("mlflow", "mlflow", "mlflow-skinny")
    if not os.environ.get("MLFLOW_TRACKING_URI"):  # a file store in the run directory
        # (mlflow-skinny has no SQL backend; MLflow 3 keeps the file store, deprecated)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
    mlflow.set_experiment(project)
    tag = f"tags.stalepipe_run = '{_run_id(run_dir)}'"
    found = mlflow.search_runs(filter_string=tag, output_format="list")
    if found:  # a resume: the same MLflow run
        mlflow.start_run(run_id=found[0].info.run_id)
    else:
        mlflow.start_run(run_name=run_dir.name, tags={"stalepipe_run": _run_id(run_dir)})
        mlflow.log_params({k: str(v)[:500] for k, v in config.items()})
    return _Sink(lambda values, step: mlflow.log_metrics(values, step=step), mlflow.end_run)
