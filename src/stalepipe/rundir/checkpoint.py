"""Checkpoints: atomic writes, the last K kept, strict loading with `weights_only=True`.

A checkpoint is one file `ckpt_<step>.pt` holding plain containers of tensors and numbers:
    {"format": 1, "step": next step to run, "config": {...}, "model": state_dict,
     "trainer": {...engine / optimizer state...}, "rng": {...}}
Parameter names are the model's global names, so a checkpoint does not depend on the pipeline
split that wrote it. Writes go to a temporary file that is renamed into place, so a crash never
leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from stalepipe.errors import CheckpointError
from stalepipe.fileio import torch_save_atomic

FORMAT = 1
_NAME = re.compile(r"^ckpt_(\d{8})\.pt$")


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"ckpt_{step:08d}.pt"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints in `run_dir`, oldest first (temporary files are ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if _NAME.match(p.name)]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: str | Path) -> int | None:
    """The step of a checkpoint from its name (`ckpt_<step>.pt`); None for another name."""
    match = _NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write `state` atomically as the checkpoint of `step`, then delete all but the newest
    `keep_last` checkpoints."""
    path = checkpoint_path(run_dir, step)
    torch_save_atomic(path, {"format": FORMAT, "step": step, **state})
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint safely (`weights_only=True`); a corrupt or foreign file raises
    CheckpointError naming the file and the fix."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for truncated / foreign files
        reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise CheckpointError(
            f"checkpoint {path} is corrupt or unreadable ({reason}); delete it to resume from the "
            f"previous checkpoint, or start over with --overwrite"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or "model" not in state:
        raise CheckpointError(
            f"{path} is not a stalepipe checkpoint (format {FORMAT}); delete it or start over "
            f"with --overwrite"
        )
    return state


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint in `run_dir`, or None."""
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def load_model_state(
    model: torch.nn.Module, state_dict: dict[str, torch.Tensor], path: Path
) -> None:
    """Load weights strictly; a shape or name mismatch raises CheckpointError with the fix."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    wrong = [k for k in own if k in state_dict and own[k].shape != state_dict[k].shape]
    if missing or unexpected or wrong:
        detail = (
            f"missing {missing[:3]}"
            if missing
            else f"unexpected {unexpected[:3]}"
            if unexpected
            else f"shape of {wrong[0]}: checkpoint {tuple(state_dict[wrong[0]].shape)} vs model "
            f"{tuple(own[wrong[0]].shape)}"
        )
        raise CheckpointError(
            f"checkpoint {path} does not match the model config ({detail}); use the run's own "
            f"config.json or start over with --overwrite"
        )
    model.load_state_dict(state_dict)
