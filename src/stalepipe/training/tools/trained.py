"""Load a trained model back from a run directory (or one checkpoint file), for export and eval.

`RUN` on the command line is a run directory (`runs/<name>`), a run name under `runs/`, or a
checkpoint (a `ckpt_XXXXXXXX` directory of DCP shards, or an older version's
`ckpt_XXXXXXXX.pt` file); a run directory means its newest checkpoint.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stalepipe.config import ExperimentConfig
from stalepipe.errors import CheckpointError
from stalepipe.training.models import Transformer, build_model
from stalepipe.training.rundir.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_model_state,
)
from stalepipe.training.rundir.sharded import MANIFEST


@dataclass
class TrainedRun:
    """A checkpoint's config, weights (global names) and where it came from."""

    path: Path
    step: int
    config: ExperimentConfig
    state_dict: dict[str, torch.Tensor]

    def model(self, device: str | torch.device = "cpu") -> Transformer:
        """The model in eval mode with the checkpoint's (float32 master) weights, loaded strictly.
        Runs with train.dtype=bfloat16 computed under bf16 autocast: use `autocast()` too."""
        model = build_model(self.config.model, seed=0, device=device)
        load_model_state(model, self.state_dict, self.path)
        return model.eval()

    def autocast(self, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
        """The autocast context the run computed in (bf16 matmuls, or none)."""
        if self.config.train.dtype == "bfloat16":
            return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def resolve_checkpoint(run: str | Path) -> Path:
    """The checkpoint file `run` names (see the module docstring); CheckpointError otherwise."""
    p = Path(run)
    if not p.exists() and not p.is_absolute() and (Path("runs") / p).exists():
        p = Path("runs") / p
    if p.is_file() or (p / MANIFEST).is_file():
        return p
    if not p.is_dir():
        raise CheckpointError(f"{run} is neither a run directory nor a checkpoint file")
    ckpt = latest_checkpoint(p)
    if ckpt is None:
        raise CheckpointError(
            f"run directory {p} has no checkpoint (ckpt_XXXXXXXX); train it first, e.g. "
            f"`stalepipe train --config {p / 'config.json'}`"
        )
    return ckpt


def load_trained(run: str | Path) -> TrainedRun:
    """Read the checkpoint `run` names (its model's weights only); weights stay on the CPU."""
    path = resolve_checkpoint(run)
    state: dict[str, Any] = load_checkpoint(path)
    if "config" not in state:
        raise CheckpointError(f"{path} has no config; it was not written by `stalepipe train`")
    cfg = ExperimentConfig.from_dict(state["config"], strict=False)
    return TrainedRun(
        path=path, step=int(state.get("step", 0)), config=cfg, state_dict=state["model"]
    )
