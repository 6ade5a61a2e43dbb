"""What may change when a run resumes: the config fields a checkpoint continues under.

A resumed run must follow the trajectory the uninterrupted run would have followed (bit for
bit), so only fields that do not touch it may differ from the saved config.json.
"""

from __future__ import annotations

from typing import Any

from stalepipe.config import ConfigError
from stalepipe.delay import DelaySchedule
from stalepipe.fileio import flatten_dict

# Fields that may differ between a run and its resumption without changing the trajectory.
RESUMABLE_CHANGES = {
    "train.progress",
    "train.log_every",
    "train.ckpt_every",
    "train.ckpt_every_s",
    "train.keep_last",
    "train.threads",
    "train.eval_every",
    "train.eval_batches",
    "train.tensorboard",
    "out_dir",
    # Which engine runs the delay, and how: the trajectory is fixed by the delay policy
    # (docs/runtime.md, "Checkpoints and resume"); data parallelism changes fp32 rounding only.
    "pipeline.engine",
    "pipeline.schedule",
    "pipeline.data_parallel",
    "pipeline.backend",
    "pipeline.timeout_s",
}
# Resumable when the delay policy gives every stage the same delay (sync, 2bw, fixed:N):
# the checkpoint is then re-split by parameter name. Pipedream's and WPipe's delays depend on
# the split, so changing it would change the trajectory.
SPLIT_CHANGES = {"pipeline.num_stages"}


def config_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ, ignoring fields in RESUMABLE_CHANGES (and SPLIT_CHANGES
    when the delay policy delays every stage alike)."""
    a, b = flatten_dict(saved), flatten_dict(current)
    keys = sorted(set(a) | set(b))
    diff = [k for k in keys if k not in RESUMABLE_CHANGES and a.get(k) != b.get(k)]
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
