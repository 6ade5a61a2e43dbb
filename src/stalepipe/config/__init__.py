"""Experiment configuration: frozen dataclasses and dotted overrides (presets: `presets.py`).

Each component owns one dataclass (`sections.py`) and receives only that one; `ExperimentConfig`
(`experiment.py`) composes them. The optimizers, delay policies, pipeline schedules and LR
schedules a config may name are those registered in `registry.py` (each component registers itself
next to its code); the config validates against those registries and lists no names itself. Every field carries a one-line help text in its metadata;
`stalepipe train --help` prints them with their defaults. Overrides use dotted keys:
`--optim.lr 3e-4 --train.num_steps 200` (`overrides.py`).

Validation happens in `__post_init__` and raises `ConfigError` (a `ValueError`) whose message
names the field, its allowed range and the fix, so the CLI can print it as one line. Each rule is
checked once: a section's own rules in its `__post_init__`, rules that join sections in
`ExperimentConfig.__post_init__`. Lower layers may rely on a config they receive being valid.
A setting the run would ignore is refused the same way (`experiment.py`); run records load with
`ExperimentConfig.from_dict(d, strict=False)`, which lets only those through.
"""

from stalepipe.config import overrides as _overrides
from stalepipe.config.base import ConfigError, Setting, unknown_choice
from stalepipe.config.delay import DelayConfig
from stalepipe.config.experiment import ExperimentConfig
from stalepipe.config.overrides import RENAMED_KEYS, apply_overrides, upgrade_record
from stalepipe.config.registry import (
    CORRECTORS,
    DELAY_POLICIES,
    LR_SCHEDULES,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    CorrectorSpec,
    LRScheduleSpec,
    OptimizerSpec,
    ScheduleSpec,
    register_optimizer,
)
from stalepipe.config.sections import (
    DataConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
)


def config_help() -> str:
    """Every `stalepipe train` override key with its type, default and help, by section."""
    return _overrides.config_help(ExperimentConfig)


__all__ = [
    "CORRECTORS",
    "DELAY_POLICIES",
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "PIPELINE_SCHEDULES",
    "RENAMED_KEYS",
    "ConfigError",
    "CorrectorSpec",
    "DataConfig",
    "LogConfig",
    "LRScheduleSpec",
    "DelayConfig",
    "ExperimentConfig",
    "ModelConfig",
    "OptimConfig",
    "OptimizerSpec",
    "PipelineConfig",
    "ScheduleSpec",
    "Setting",
    "TrainConfig",
    "apply_overrides",
    "config_help",
    "register_optimizer",
    "unknown_choice",
    "upgrade_record",
]
