"""Checkpoints of a run: where they are, the last K kept, reading them.

A checkpoint is a directory `ckpt_<step>/` of DCP shards in safetensors, one per process
(format 3, `rundir.sharded`; written by `train.emulated` and `train.pipelined`). Parameter
names are the model's global names, so a checkpoint does not depend on the pipeline split that
wrote it. A checkpoint appears under its final name only complete (a renamed directory), so a
crash never leaves a half-written checkpoint there. Older versions' checkpoints (format 2's
pickled DCP metadata, format 1's `ckpt_<step>.pt`) are listed, so a resume finds them, and
refused in one line naming `stalepipe checkpoint convert` (`rundir.convert`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from stalepipe.config import ExperimentConfig
from stalepipe.errors import CheckpointError
from stalepipe.training.delay import tied
from stalepipe.training.models import Transformer
from stalepipe.training.rundir import sharded, verified
from stalepipe.training.rundir.checkpoint_parts import FlatState

_NAME = re.compile(r"^ckpt_(\d{8})(\.pt)?$")


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints in `run_dir`, oldest first (staging directories and temporary
    files are ignored; a directory counts once its manifest is in)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [
        verified.inside(run_dir, p.name)  # a checkpoint linked in from elsewhere is refused
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


def _refuse_file(path: Path) -> CheckpointError:
    if not Path(path).exists():
        return CheckpointError(f"checkpoint {path} does not exist")
    if checkpoint_step(path) is None:
        return CheckpointError(
            f"{path} is not a stalepipe checkpoint (a directory ckpt_<step>/ in a run); give the "
            f"run directory or one of its checkpoints"
        )
    if not _looks_like_torch_save(Path(path)):  # not format 1 either: converting cannot help
        return sharded.corrupt(Path(path), "neither a checkpoint directory nor a torch.save file")
    return sharded.refuse_old(path, "an older version's single file (format 1)")


def _looks_like_torch_save(path: Path) -> bool:
    """Whether a file starts as torch.save writes one (a zip archive, or a bare pickle from
    `_use_new_zipfile_serialization=False`): the only files the converter can read."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


def open_checkpoint(path: Path) -> FlatState:
    """A checkpoint as the keys of `rundir.checkpoint_parts`, read lazily (a process reads
    only the keys it asks for)."""
    if not Path(path).is_dir():
        raise _refuse_file(path)
    return sharded.ShardedCheckpoint(path)


def check_complete(path: Path) -> None:
    """Cheap check that a checkpoint is whole, before anything is written (a missing or short
    file, a damaged header); CheckpointError naming it and the fix otherwise."""
    open_checkpoint(path).check_files()  # type: ignore[attr-defined]


def checkpoint_config(path: Path) -> dict[str, Any] | None:
    """The config a checkpoint directory was saved with (its checkpoint.json, JSON only), or
    None (an older version's file, or a manifest that cannot be read)."""
    try:  # inside the checkpoint and bounded, as every read of it (`sharded.read_manifest`)
        config = json.loads(sharded.read_manifest(Path(path))).get("config")
    except (CheckpointError, ValueError, AttributeError):
        return None
    return config if isinstance(config, dict) else None


def _tied(config: dict[str, Any] | None) -> bool:
    return bool((config or {}).get("model", {}).get("tie_embeddings", False))


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint's model whole, safely (`rundir.verified`: headers bounded by their
    files, every tensor checked against its digest), once the model its config describes is
    known to have the stored shapes (so no config can make a caller build a model larger than
    the checkpoint holds): {"format", "step", "config", "model": the whole model's
    state_dict, "rng"}. A corrupt, foreign or older one raises CheckpointError naming it and
    the fix."""
    path = Path(path)
    if not path.is_dir():
        raise _refuse_file(path)
    ckpt = sharded.ShardedCheckpoint(path)
    config = ckpt.manifest.get("config")
    check_model_shapes(path, config, ckpt.shapes())
    got = ckpt.read(k for k in ckpt.stored_keys() if k.startswith("model/") or k == "rng")
    model = {k.removeprefix("model/"): t for k, t in got.items() if k != "rng"}
    for key, source in tied.aliases(_tied(config)).items():
        model[key] = model[source]
    return {
        "format": sharded.FORMAT,
        "step": ckpt.step,
        "config": config,
        "model": model,
        "rng": got.get("rng"),
    }


def check_model_shapes(path: Path, config: Any, stored: dict[str, tuple[int, ...]]) -> None:
    """The model `config` describes, built on the meta device (nothing allocated), has exactly
    the parameters and shapes the checkpoint stores; CheckpointError otherwise."""
    try:
        cfg = ExperimentConfig.from_dict(config, strict=False).model
        with torch.device("meta"):
            model = Transformer(cfg)
    except Exception as e:  # a config that is not one: many types
        raise verified.damaged(path, sharded.MANIFEST, f"holds no usable config ({e})") from None
    aliases = tied.aliases(cfg.tie_embeddings)
    want = {k: tuple(t.shape) for k, t in model.state_dict().items() if k not in aliases}
    have = {k.removeprefix("model/"): v for k, v in stored.items() if k.startswith("model/")}
    if want != have:
        diff = sorted(set(want) ^ set(have)) or [k for k in want if want[k] != have[k]]
        k = diff[0]
        raise verified.damaged(
            path,
            sharded.MANIFEST,
            f"describes a model its tensors do not hold ({k[:60]}: config "
            f"{want.get(k, 'none')}, stored {have.get(k, 'none')})",
        )


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
