"""Checkpoints of a run: where they are, the last K kept, reading either format.

A checkpoint is a directory `ckpt_<step>/` of DCP shards, one per process (format 2,
`rundir.sharded`; written by `train.emulated` and `train.pipelined`). Older versions wrote one
file `ckpt_<step>.pt` (format 1) holding plain containers of tensors and numbers:
    {"format": 1, "step": next step to run, "config": {...}, "model": state_dict,
     "engine": {...delay / optimizer state...}, "rng": tensor}
Both resume as they are (`open_checkpoint` gives either as the same keys, so nothing needs
converting), and `stalepipe export` / `eval` read both (`load_checkpoint`). Parameter names are
the model's global names, so a checkpoint does not depend on the pipeline split that wrote it.
Either format appears under its final name only complete (a renamed directory, a renamed
file), so a crash never leaves a half-written checkpoint there.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from stalepipe.delay import tied
from stalepipe.errors import CheckpointError
from stalepipe.fileio import torch_save_atomic
from stalepipe.rundir import sharded
from stalepipe.rundir.checkpoint_parts import FlatState, from_merged

FORMAT = 1  # the single-file format of older versions
_NAME = re.compile(r"^ckpt_(\d{8})(\.pt)?$")


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """The checkpoint of `step` in `run_dir`: the directory (format 2), or an older version's
    file when only that exists."""
    new, old = Path(run_dir) / f"ckpt_{step:08d}", Path(run_dir) / f"ckpt_{step:08d}.pt"
    return old if old.exists() and not new.exists() else new


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints in `run_dir`, oldest first (staging directories and temporary
    files are ignored; a directory counts once its manifest is in)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [
        p
        for p in run_dir.iterdir()
        if _NAME.match(p.name) and (p.suffix == ".pt" or (p / sharded.MANIFEST).is_file())
    ]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: str | Path) -> int | None:
    """The step of a checkpoint from its name (`ckpt_<step>.pt`); None for another name."""
    match = _NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def commit_checkpoint(run_dir: Path, step: int, manifest: dict[str, Any], keep_last: int) -> Path:
    """Move the staged shards of `step` into place as its checkpoint (`sharded.commit`), then
    delete all but the newest `keep_last` checkpoints: the previous one goes only once the new
    one is complete."""
    path = sharded.commit(run_dir, step, Path(run_dir) / f"ckpt_{step:08d}", manifest)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        remove_checkpoint(old)
    return path


def remove_checkpoint(path: Path) -> None:
    """Delete one checkpoint of either format."""
    path = Path(path)
    if path.is_dir():
        sharded.remove_checkpoint_dir(path)
    else:
        path.unlink(missing_ok=True)


def save_legacy_checkpoint(run_dir: Path, step: int, state: dict[str, Any]) -> Path:
    """Write `state` as an older version's single file `ckpt_<step>.pt` (format 1), atomically.
    No engine writes these any more: tests and benchmarks/speed/checkpoint_cost.py use it to make
    what older versions wrote."""
    path = Path(run_dir) / f"ckpt_{step:08d}.pt"
    return torch_save_atomic(path, {"format": FORMAT, "step": step, **state})


def open_checkpoint(path: Path) -> FlatState:
    """A checkpoint of either format as the keys of `rundir.checkpoint_parts`: a directory is
    read lazily (a process reads only the keys it asks for); an old file is loaded whole."""
    path = Path(path)
    if path.is_dir():
        return sharded.ShardedCheckpoint(path)
    state = load_checkpoint(path)
    return from_merged(state, tied.aliases(_tied(state.get("config"))))


def check_complete(path: Path) -> None:
    """Cheap check that a checkpoint is whole, before anything is written (a truncated file,
    a missing or short shard); CheckpointError naming it and the fix otherwise."""
    if Path(path).is_dir():
        ckpt = sharded.ShardedCheckpoint(path)  # its small files: digests, safe unpickling
        ckpt.check_files()
        if not ckpt.verifies:
            sharded.warn_unverified(path, "written before stalepipe recorded digests")
        return
    if not zipfile.is_zipfile(path):  # reads the end of the file: a truncated save
        raise sharded.corrupt(path, "not a complete zip archive")
    sharded.warn_unverified(path, "an older version's single file")


def checkpoint_config(path: Path) -> dict[str, Any] | None:
    """The config a checkpoint directory was saved with (its checkpoint.json, JSON only), or
    None (an older version's file, or a manifest that cannot be read)."""
    try:
        config = json.loads((Path(path) / sharded.MANIFEST).read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        return None
    return config if isinstance(config, dict) else None


def _tied(config: dict[str, Any] | None) -> bool:
    return bool((config or {}).get("model", {}).get("tie_embeddings", False))


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a whole checkpoint of either format, safely (a directory through `rundir.verified`,
    each file checked against its digest; `weights_only=True` for an older version's file):
    {"format", "step", "config", "model": the whole model's state_dict, "rng", and for an old
    file "engine"}. A corrupt or foreign one raises CheckpointError naming it and the fix."""
    path = Path(path)
    if path.is_dir():
        ckpt = sharded.ShardedCheckpoint(path)
        if not ckpt.verifies:
            sharded.warn_unverified(path, "written before stalepipe recorded digests")
        got = ckpt.read(k for k in ckpt.stored_keys() if k.startswith("model/") or k == "rng")
        model = {k.removeprefix("model/"): t for k, t in got.items() if k != "rng"}
        config = ckpt.manifest.get("config")
        for key, source in tied.aliases(_tied(config)).items():
            model[key] = model[source]
        return {
            "format": sharded.FORMAT,
            "step": ckpt.step,
            "config": config,
            "model": model,
            "rng": got.get("rng"),
        }
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    sharded.warn_unverified(path, "an older version's single file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for truncated / foreign files
        reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise sharded.corrupt(path, reason) from None
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
