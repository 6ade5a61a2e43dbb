"""Experiment configuration: frozen dataclasses and dotted overrides (presets: `presets.py`).

Each component owns one dataclass (`sections.py`) and receives only that one; `ExperimentConfig`
(`experiment.py`) composes them. Every field carries a one-line help text in its metadata;
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
from stalepipe.config.base import ConfigError, unknown_choice
from stalepipe.config.delay import POLICY_NAMES, DelayConfig
from stalepipe.config.experiment import ExperimentConfig
from stalepipe.config.overrides import RENAMED_KEYS, apply_overrides, upgrade_record
from stalepipe.config.sections import (
    FIXED_OPTIM_FIELDS,
    OPTIMIZER_FIELDS,
    RUNTIME_SCHEDULES,
    DataConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
)


def config_help() -> str:
    """Every `stalepipe train` override key with its type, default and help, by section."""
    return _overrides.config_help(ExperimentConfig)


__all__ = [
    "FIXED_OPTIM_FIELDS",
    "OPTIMIZER_FIELDS",
    "POLICY_NAMES",
    "RENAMED_KEYS",
    "RUNTIME_SCHEDULES",
    "ConfigError",
    "DataConfig",
    "DelayConfig",
    "ExperimentConfig",
    "ModelConfig",
    "OptimConfig",
    "PipelineConfig",
    "TrainConfig",
    "apply_overrides",
    "config_help",
    "unknown_choice",
    "upgrade_record",
]
