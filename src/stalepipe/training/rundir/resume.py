"""What may change when a run resumes: the config fields a checkpoint continues under.

Three kinds of change are allowed on `--resume`; everything else is refused:
- fields that do not touch the trajectory (`RESUMABLE_CHANGES`, and the stage split where
  every stage has the same delay): the resumed run equals the uninterrupted one bit for bit;
- the run's length (`train.num_steps`, longer or shorter), when the steps already trained are
  the same under the new length: the LR multiplier and every stage's delay agree at each of
  them (`same_past`). Then the resumed run equals a run planned at the new length from the
  start. So WSD and a constant LR extend from any checkpoint before the decay / cooldown
  began, and cosine (whose every LR depends on the length) never does: start a new run from
  the checkpoint instead (`stalepipe train --init-from RUN`);
- `CONTINUE_CHANGES`, the fixes for a diverging run (a lower LR, clipping): from the
  checkpoint on the run follows the new values; each invocation is recorded in meta.json.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from stalepipe.config import ConfigError, ExperimentConfig
from stalepipe.config.overrides import default_of
from stalepipe.errors import CheckpointError
from stalepipe.fileio import flatten_dict
from stalepipe.training.delay import DelaySchedule
from stalepipe.training.optim.lr_schedule import lr_multiplier
from stalepipe.training.rundir.checkpoint import checkpoint_step, list_checkpoints
from stalepipe.training.rundir.sharded import MANIFEST
from stalepipe.training.rundir.status import checkpoint_path

# Fields that may differ between a run and its resumption without changing the trajectory.
RESUMABLE_CHANGES = {
    "train.progress",
    "train.log_every",
    "train.ckpt_every",
    "train.ckpt_every_s",
    "train.keep_last",
    "train.threads",
    "train.eval_every",
    "train.num_eval_batches",
    "train.tensorboard",
    "out_dir",
    # Which engine runs the delay, and how: the trajectory is fixed by the delay policy
    # (docs/runtime.md, "Checkpoints and resume"); data parallelism changes fp32 rounding only.
    "pipeline.engine",
    "pipeline.schedule",
    "pipeline.num_chunks",
    "pipeline.num_replicas",
    "pipeline.backend",
    "pipeline.timeout_s",
    # How a step's batch is cut into microbatches: their gradients are summed and their losses
    # averaged, so this too changes fp32 rounding only (a deeper split may need more of them:
    # 2bw at P stages wants P - 1).
    "train.num_microbatches",
}
# Resumable when the delay policy gives every stage the same delay (sync, 2bw, fixed:N):
# the checkpoint is then re-split by parameter name. Pipedream's and WPipe's delays depend on
# the split, so changing it would change the trajectory.
SPLIT_CHANGES = {"pipeline.num_stages"}


# Changes a user makes on purpose to continue a run differently (the divergence fix).
CONTINUE_CHANGES = {"optim.lr", "optim.adam_lr", "train.grad_clip"}
LENGTH = "train.num_steps"


def _added_default(key: str, current: dict[str, Any]) -> Any:
    """What a saved record without `key` meant: the field's default, for a field added since
    the run was made (the delay correctors, say); None for a key the config no longer has."""
    if key not in current:
        return None
    try:
        return default_of(ExperimentConfig, key)
    except KeyError:
        return None


def config_diff(
    saved: dict[str, Any], current: dict[str, Any], *, resumed_step: int | None = None
) -> list[str]:
    """Dotted keys whose values differ and may not on resume (module docstring). `resumed_step`:
    the step of the checkpoint resumed from (None: no checkpoint, so the length may not
    change either)."""
    a, b = flatten_dict(saved), flatten_dict(current)
    keys = sorted(set(a) | set(b))
    free = RESUMABLE_CHANGES | CONTINUE_CHANGES
    diff = [k for k in keys if k not in free and a.get(k, _added_default(k, b)) != b.get(k)]
    if LENGTH in diff and resumed_step is not None and same_past(saved, current, resumed_step):
        diff.remove(LENGTH)
    if a.get("delay.policy") == b.get("delay.policy") and all(
        _same_delay_per_stage(b.get("delay.policy"), p.get(k))
        for p in (a, b)
        for k in SPLIT_CHANGES
    ):
        diff = [k for k in diff if k not in SPLIT_CHANGES]
    return diff


def _same_delay_per_stage(policy: Any, num_stages: Any) -> bool:
    try:
        return DelaySchedule.build(str(policy), int(num_stages)).uniform
    except (ConfigError, TypeError, ValueError):
        return False


def same_past(saved: dict[str, Any], current: dict[str, Any], step: int) -> bool:
    """Whether steps 0 .. step-1 had the same LR multiplier and the same delay on every stage
    under both configs (which may differ in `train.num_steps`), and `step` is inside the new run."""
    try:
        old, new = ExperimentConfig.from_dict(saved), ExperimentConfig.from_dict(current)
    except ConfigError:
        return False
    if step >= new.train.num_steps:
        return False
    plans = [
        DelaySchedule.build(c.delay, c.pipeline.num_stages, c.train.num_steps, train=c.train)
        for c in (old, new)
    ]
    return all(
        lr_multiplier(k, old.train) == lr_multiplier(k, new.train)
        and plans[0].taus(k) == plans[1].taus(k)
        for k in range(step)
    )


def changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'key: old -> new' for each CONTINUE_CHANGES field and the length that differ (what a
    resume prints and records)."""
    a, b = flatten_dict(saved), flatten_dict(current)
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(CONTINUE_CHANGES | {LENGTH})
        if a.get(k) != b.get(k)
    ]


def parent_checkpoint(spec: str, steps: int | None = None) -> Path:
    """`--init-from` RUN_DIR (its newest checkpoint), RUN_DIR@STEP, or a checkpoint;
    with `steps` (the new run's train.num_steps), one that leaves steps to train."""
    path = _parent_checkpoint(spec)
    step = parent_meta(path)["parent"]["step"]
    if steps is not None and step is not None and step >= steps:
        raise CheckpointError(
            f"--init-from {spec}: that checkpoint is at step {step}, and this run's train.num_steps "
            f"is {steps}: nothing would train; pass a larger --train.num_steps (or an earlier STEP)"
        )
    return path


def _parent_checkpoint(spec: str) -> Path:
    run, _, step = spec.partition("@")
    path = Path(run)
    if path.is_file() or (path / MANIFEST).is_file():
        return path
    kept = list_checkpoints(path)
    steps = ", ".join(str(checkpoint_step(p)) for p in kept) or "none"
    if not kept:
        raise CheckpointError(
            f"--init-from {spec}: no checkpoint in {path} (checkpoints: none); give a run "
            f"directory that has one, RUN@STEP, or a checkpoint (ckpt_XXXXXXXX)"
        )
    if not step:
        return kept[-1]
    if not step.isdigit() or not checkpoint_path(path, int(step)).exists():
        raise CheckpointError(
            f"--init-from {spec}: {path} has no checkpoint of step {step} (it has: {steps})"
        )
    return checkpoint_path(path, int(step))


def parent_meta(init_from: Path | None) -> dict[str, Any]:
    """What meta.json records of a branched run's parent ({} for a run of its own)."""
    if init_from is None:
        return {}
    step = checkpoint_step(init_from)
    return {"parent": {"checkpoint": str(Path(init_from).resolve()), "step": step}}


def saved_run_location(config_file: str | os.PathLike) -> tuple[str, str] | None:
    """`(out_dir, name)` of the run whose own config.json `config_file` is (a meta.json beside
    it), so that `stalepipe train --config RUN/config.json --resume` continues that run from
    any working directory; None for any other file."""
    path = Path(config_file)
    if path.name != "config.json" or not (path.parent / "meta.json").is_file():
        return None
    run_dir = path.parent.resolve()
    return str(run_dir.parent), run_dir.name
