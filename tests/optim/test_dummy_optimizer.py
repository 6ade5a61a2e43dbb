"""Adding an optimizer is one file plus one test: `dummy_optimizer.py` registers 'dummy', and
the config, the registry and the training entry point take it with no other change."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from stalepipe.cli import main
from stalepipe.config import OPTIMIZERS, ConfigError, ExperimentConfig, OptimConfig, apply_overrides
from stalepipe.models import build_model
from stalepipe.optim import build_optimizer, resolve_config
from stalepipe.presets import cpu_tiny


@pytest.fixture
def dummy():
    """The dummy optimizer registered for one test (the registry is process-wide)."""
    path = Path(__file__).with_name("dummy_optimizer.py")  # tests are no package: by path
    spec = importlib.util.spec_from_file_location("dummy_optimizer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers 'dummy'
    yield module.SPEC
    OPTIMIZERS.unregister("dummy")


def test_the_config_accepts_it_and_the_registry_builds_it(dummy):
    cfg = apply_overrides(ExperimentConfig(), {"optim.name": "dummy", "optim.lr": "0.1"})
    assert cfg.optim.name == "dummy" and "dummy" in OPTIMIZERS
    resolved = resolve_config(cfg.optim)
    assert (resolved.lr, resolved.weight_decay, resolved.beta1) == (0.1, 0.0, None)
    with pytest.raises(ConfigError, match=r"optim.beta1 is not used by optim.name='dummy'"):
        OptimConfig(name="dummy", beta1=0.9)  # a field it does not read is refused as usual
    opt = build_optimizer(cfg.optim, build_model(cpu_tiny().model, seed=0).named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    assert {g["kind"]: g["weight_decay"] for g in opt.param_groups}["vector"] == 0.0
    assert all(g["peak_lr"] == 0.1 for g in opt.param_groups)


def test_it_is_unknown_until_registered():
    with pytest.raises(ConfigError, match=r"unknown optimizer optim.name='dummy'"):
        OptimConfig(name="dummy")


def test_stalepipe_train_runs_it(dummy, tiny_config, capsys):
    args = ["train", "--preset", "cpu-tiny", "--name", "dummy", "--optim.name", "dummy"]
    args += ["--out_dir", tiny_config.out_dir, "--data.corpus", "excerpt"]
    args += ["--data.data_dir", tiny_config.data.data_dir, "--data.seq_len", "32"]
    args += ["--model.num_layers", "2", "--train.batch_size", "4", "--train.num_steps", "3"]
    args += ["--train.num_eval_batches", "1", "--train.progress", "false"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "done: 3 steps" in out and "val loss" in out
