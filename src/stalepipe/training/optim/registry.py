"""Config resolution and construction of the registered optimizers.

The optimizers are the specs in `config.registry.OPTIMIZERS` (the built-in ones in `specs.py`):
each names the `OptimConfig` fields it reads, their defaults and its builder. `resolve_config`
turns an `OptimConfig` whose fields may be `None` ("the optimizer's default") into a fully
specified one; `OptimConfig` itself refuses an unknown name or a value in a field the optimizer
does not read. `build_optimizer` builds the optimizer for a set of named parameters (a whole
model, or one pipeline stage). Defaults and their sources are in docs/optimizers.md.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from stalepipe.config import ConfigError, OptimConfig
from stalepipe.config.registry import OPTIMIZERS, resolve_config
from stalepipe.training.optim import lr_schedule
from stalepipe.training.optim.groups import split_params


def build_optimizer(
    cfg: OptimConfig, named_params: Iterable[tuple[str, nn.Parameter]]
) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` (defaults filled by `resolve_config`) over `named_params`.

    Parameters are grouped by kind (`groups.split_params`): each param group carries `kind`
    ('matrix' | 'embed' | 'vector'), the parameter names (`param_names`) and `peak_lr` for the LR
    schedules. 1-D parameters get no weight decay. A tied weight listed twice is updated once.
    Deterministic: the same config and parameter list always give the same groups and updates.
    """
    cfg = resolve_config(cfg)
    split = split_params(named_params)
    if not split.kinds():
        raise ConfigError("build_optimizer got no trainable parameters")
    opt = OPTIMIZERS[cfg.name].build(cfg, split)
    lr_schedule.set_peak_lr(opt)
    return opt
