"""What `DelayedOptimizer` is built from: the parameters of each pipeline stage, checked, and
the run's delay schedule, checked against them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from stalepipe.config import ConfigError, DelayConfig
from stalepipe.delay.policies import DelaySchedule

StageParams = Iterable[nn.Parameter] | Mapping[str, nn.Parameter]


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
