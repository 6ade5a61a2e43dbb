"""Adding an optimizer is one file plus one test: `dummy_optimizer.py` registers 'dummy' with a
hyperparameter of its own (`dampening`), and the config, the registry, the training entry point,
`--help` and the report take it with no other change."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from stalepipe.cli import main
from stalepipe.config import OPTIMIZERS, ConfigError, ExperimentConfig, OptimConfig, apply_overrides
from stalepipe.presets import cpu_tiny
from stalepipe.training.models import build_model
from stalepipe.training.optim import build_optimizer, resolve_config


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
    assert resolved.dampening == 0.0 and "dampening" in OPTIMIZERS["dummy"].reads
    with pytest.raises(ConfigError, match=r"optim.beta1 is not used by optim.name='dummy'"):
        OptimConfig(name="dummy", beta1=0.9)  # a field it does not read is refused as usual
    opt = build_optimizer(cfg.optim, build_model(cpu_tiny().model, seed=0).named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    assert {g["kind"]: g["weight_decay"] for g in opt.param_groups}["vector"] == 0.0
    assert all(g["peak_lr"] == 0.1 for g in opt.param_groups)


def test_its_own_field_is_set_checked_and_refused_elsewhere(dummy):
    cfg = apply_overrides(ExperimentConfig(), {"optim.name": "dummy", "optim.dampening": "0.5"})
    assert cfg.optim.dampening == 0.5 and cfg.to_dict()["optim"]["dampening"] == 0.5
    assert ExperimentConfig.from_dict(cfg.to_dict()) == cfg  # config.json reads back
    opt = build_optimizer(cfg.optim, build_model(cpu_tiny().model, seed=0).named_parameters())
    assert (opt.defaults["dampening"], opt.defaults["momentum"]) == (0.5, 0.9)
    with pytest.raises(ConfigError, match=r"optim.dampening must be in \[0, 1\], got 2.0"):
        OptimConfig(name="dummy", dampening=2.0)
    with pytest.raises(ConfigError, match=r"optim.dampening is not used by optim.name='adamw'"):
        apply_overrides(ExperimentConfig(), {"optim.dampening": "0.5"})


def test_it_is_unknown_until_registered():
    with pytest.raises(ConfigError, match=r"unknown optimizer optim.name='dummy'"):
        OptimConfig(name="dummy")
    with pytest.raises(ConfigError, match=r"unknown config key --optim.dampening"):
        apply_overrides(ExperimentConfig(), {"optim.dampening": "0.5"})


def test_stalepipe_train_runs_it_and_help_and_the_report_show_it(dummy, tiny_config, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert next(x for x in lines if "--optim.name" in x).endswith("| nadamw | dummy")
    assert "momentum buffer (dummy)" in next(x for x in lines if "--optim.dampening" in x)

    args = ["train", "--preset", "cpu-tiny", "--out_dir", tiny_config.out_dir]
    args += ["--data.corpus", "excerpt", "--data.data_dir", tiny_config.data.data_dir]
    args += ["--data.seq_len", "32", "--model.num_layers", "2", "--train.batch_size", "4"]
    args += ["--train.num_steps", "3", "--train.num_eval_batches", "1", "--train.progress", "false"]
    assert (
        main([*args, "--name", "dummy", "--optim.name", "dummy", "--optim.dampening", "0.5"]) == 0
    )
    out = capsys.readouterr().out
    assert "done: 3 steps" in out and "val loss" in out
    record = json.loads((Path(tiny_config.out_dir) / "dummy" / "config.json").read_text())
    assert record["optim"]["name"] == "dummy" and record["optim"]["dampening"] == 0.5
    assert main([*args, "--name", "adamw"]) == 0  # a second run, for the report to compare
    assert main(["report", tiny_config.out_dir]) == 0
    report = (Path(tiny_config.out_dir) / "report" / "report.md").read_text()
    assert "| dummy |" in report and "| adamw |" in report
