"""What `DelayedOptimizer` is built from: the parameters of each pipeline stage, checked, and
the run's delay schedule, checked against them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from stalepipe.config import ConfigError, DelayConfig
from stalepipe.training.delay.policies import DelaySchedule
from stalepipe.training.delay.stages import StageSplit
from stalepipe.training.delay.tied import SharedUse

StageParams = Iterable[nn.Parameter] | Mapping[str, nn.Parameter]


def unpack_split(
    stages: Sequence[StageParams] | StageSplit,
    shared_with: Mapping[int, Iterable[int]] | None,
) -> tuple[Sequence[StageParams], Mapping[int, Iterable[int]] | None, list[SharedUse]]:
    """(stages, shared_with, the tied reads to untie) of a `StageSplit` or of plain stages
    (which untie nothing: a caller with stage modules unties itself, as `DelayEmulator`)."""
    if not isinstance(stages, StageSplit):
        return stages, shared_with, []
    if shared_with is not None:
        raise ConfigError("a StageSplit carries its own shared_with; do not pass one")
    return stages.params, stages.shared_with, list(stages.shared)


def checked_delay_schedule(
    cfg: DelayConfig, num_stages: int, total_steps: int | None, delay: DelaySchedule | None
) -> DelaySchedule:
    """The run's delay schedule: `delay` when given (it must match cfg's policy and the
    stage count), else `DelaySchedule.build` of cfg's windows over `total_steps`."""
    if delay is None:
        delay = DelaySchedule.build(cfg, num_stages, total_steps)
    if delay.num_stages != num_stages or delay.policy != cfg.policy:
        raise ConfigError(
            f"the delay schedule ({delay.policy}, {delay.num_stages} stages) does not "
            f"match delay.policy {cfg.policy} with {num_stages} stages of parameters"
        )
    return delay


def stage_parameters(
    stages: Sequence[StageParams], optimizer: torch.optim.Optimizer
) -> tuple[list[list[str]], list[list[nn.Parameter]]]:
    """(names, parameters) per stage; every parameter in one stage only, and every parameter
    the optimizer updates in some stage."""
    names: list[list[str]] = []
    params: list[list[nn.Parameter]] = []
    seen: dict[int, str] = {}
    for s, group in enumerate(stages):
        items = (
            list(group.items())
            if isinstance(group, Mapping)
            else [(f"{s}.{i}", p) for i, p in enumerate(group)]
        )
        for name, p in items:
            if id(p) in seen:
                raise ConfigError(
                    f"parameter {name} appears in two stages (also as {seen[id(p)]}); list "
                    f"a shared parameter under its owner only and use shared_with"
                )
            seen[id(p)] = name
        names.append([n for n, _ in items])
        params.append([p for _, p in items])
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                raise ConfigError(
                    f"the optimizer updates a parameter of shape {tuple(p.shape)} that is in "
                    f"no stage; pass every trained parameter in `stages`"
                )
    return names, params


def check_saved_state(state: Mapping[str, Any], names: list[list[str]], policy: str) -> None:
    """Refuse a `DelayedOptimizer.state_dict()` saved for other stages or another policy."""
    if state["num_stages"] != len(names) or state["names"] != names:
        raise ConfigError(
            f"delay state was saved for {state['num_stages']} stages with other parameters; "
            f"resume with the same pipeline.num_stages and model"
        )
    if state["policy"] != policy:
        raise ConfigError(
            f"delay state was saved under policy {state['policy']!r}, not {policy!r}; resume "
            f"with the same --delay.policy"
        )


def owned_tensors(
    saved: Sequence[torch.Tensor], like: Sequence[nn.Parameter]
) -> list[torch.Tensor]:
    """Copies of saved tensors on their parameters' devices and dtypes (`like[i]`'s)."""
    return [t.detach().to(p.device, p.dtype).clone() for t, p in zip(saved, like)]


def owned_copies(
    saved: Sequence[Sequence[torch.Tensor]] | None, like: Sequence[Sequence[nn.Parameter]]
) -> list[list[torch.Tensor]] | None:
    """`owned_tensors` of every stage (None stays None: a buffer not started yet)."""
    if saved is None:
        return None
    return [owned_tensors(ts, ps) for ts, ps in zip(saved, like)]
