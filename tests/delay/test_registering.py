"""A delay policy and a corrector registered by a test module (`dummy_delay.py`) are taken by the
config, `stalepipe train --help`, a sweep grid, training and a report, with no other file
changed: the registries are the only lists of them (config/registry.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from stalepipe.cli import main
from stalepipe.config import (
    CORRECTORS,
    DELAY_POLICIES,
    ConfigError,
    DelayConfig,
    ExperimentConfig,
    apply_overrides,
)
from stalepipe.lab.analysis.results import build_rows, load_runs
from stalepipe.lab.sweeps.grid import check_overrides, expand, parse_grid_arg, select_runs
from stalepipe.lab.sweeps.sweep import run_sweep
from stalepipe.training.delay import DelayedOptimizer
from stalepipe.training.launch import task as trainer

ALTERNATE = {"delay.policy": "alternate", "pipeline.num_stages": "2"}


@pytest.fixture
def dummy():
    """'alternate' and 'stale_scale' registered for one test (the registries are
    process-wide)."""
    path = Path(__file__).with_name("dummy_delay.py")  # tests are no package: by path
    spec = importlib.util.spec_from_file_location("dummy_delay", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers both
    yield module
    DELAY_POLICIES.unregister("alternate")
    CORRECTORS.unregister("stale_scale")


def test_the_config_takes_them(dummy, tmp_path):
    cfg = apply_overrides(ExperimentConfig(), {**ALTERNATE, "delay.stale_scale": "0.5"})
    assert (cfg.delay.policy, cfg.delay.stale_scale) == ("alternate", 0.5)
    assert DelayConfig().stale_scale == 0.0  # off by default
    assert cfg.to_dict()["delay"]["stale_scale"] == 0.5  # config.json holds it
    assert ExperimentConfig.from_dict(cfg.to_dict()) == cfg
    toml = tmp_path / "c.toml"
    toml.write_text('[delay]\npolicy = "alternate"\nstale_scale = 0.25\n')
    assert main(["info", "--config", str(toml), "--pipeline.num_stages", "2"]) == 0
    with pytest.raises(ConfigError, match=r"delay.stale_scale must be >= 0, got -1.0"):
        apply_overrides(cfg, {"delay.stale_scale": "-1"})
    # refused where it would do nothing, like every corrector that needs a delay
    with pytest.raises(ConfigError, match=r"delay.stale_scale mitigates a delay, but delay.polic"):
        apply_overrides(ExperimentConfig(), {"delay.stale_scale": "0.5"})


def test_they_are_unknown_until_registered():
    with pytest.raises(ConfigError, match=r"unknown config key --delay.stale_scale"):
        apply_overrides(ExperimentConfig(), {"delay.stale_scale": "0.5"})
    with pytest.raises(ConfigError, match=r"delay.policy must be .* got 'alternate'"):
        DelayConfig(policy="alternate")


def test_train_help_lists_them(dummy, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert "alternate" in next(x for x in lines if "--delay.policy" in x)
    assert "staleness-aware gradient scale" in next(x for x in lines if "--delay.stale_scale" in x)


def test_delayed_optimizer_runs_the_corrector_in_its_phase(dummy):
    """Step 1 of 'alternate' is stale: SGD at lr 1 moves by g / (1 + c) there, by g at step 0."""
    w = torch.nn.Parameter(torch.zeros(1))
    cfg = DelayConfig(policy="alternate", stale_scale=1.0)
    opt = DelayedOptimizer(torch.optim.SGD([w], lr=1.0), [[w]], cfg, total_steps=2)
    for _ in range(2):
        with opt.stale_weights():
            w.grad = torch.ones(1)
        opt.step()
    assert w.item() == -1.5


def test_a_sweep_grid_runs_them_and_the_report_shows_them(dummy, tiny_config, tmp_path, capsys):
    base = dataclasses.replace(
        tiny_config, train=dataclasses.replace(tiny_config.train, num_steps=3, eval_every=0)
    )
    # an ad-hoc grid (`sweep --grid`) expands over the corrector's setting ...
    grid = [[("alternate", ALTERNATE)], parse_grid_arg("delay.stale_scale=0,0.5")]
    specs = expand(grid)
    assert [s.name for s in specs] == ["alternate_stale-scale0_s0", "alternate_stale-scale0.5_s0"]
    assert [s.name for s in select_runs(specs, base, ["delay.stale_scale=0.5"])] == [specs[1].name]
    with pytest.raises(ConfigError, match="run sync_stale-scale0.5_s0: delay.stale_scale mitig"):
        check_overrides(expand([parse_grid_arg("delay.policy=sync"), grid[1]]), base)
    # ... and a study's grid names the arms; they train and the report links them
    sync = ("sync", {"delay.policy": "sync", "pipeline.num_stages": "2"})
    stale = ("alternate+stale", {**ALTERNATE, "delay.stale_scale": "0.5"})
    specs = expand([[sync, ("alternate", ALTERNATE), stale]])
    out = tmp_path / "sweep"
    assert sorted(run_sweep(trainer, specs, base, out, log=lambda m: None).ran) == sorted(
        s.name for s in specs
    )
    rows = {r.label: r for r in build_rows(load_runs(out))}
    assert set(rows) == {"sync", "alternate", "alternate+stale"}
    assert rows["alternate+stale"].mitigations == {"delay.stale_scale": 0.5}
    assert rows["alternate+stale"].unmitigated is rows["alternate"]
    assert rows["alternate"].baseline is rows["sync"] and not rows["alternate"].is_sync
    assert rows["alternate+stale"].values != rows["alternate"].values  # it changed the run
    assert main(["report", str(out)]) == 0
    table = (out / "report" / "report.md").read_text()
    line = next(x for x in table.splitlines() if x.startswith("| alternate+stale |"))
    assert line.rstrip(" |").endswith("sync")  # its baseline
