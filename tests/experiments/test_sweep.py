"""Sweeps: grid expansion, study presets, resume skips finished runs, failures are recorded,
isolated, and rerun only on request."""

import json

import pytest

from stalepipe.config import ConfigError
from stalepipe.errors import UserError
from stalepipe.lab.studies import ladder, scales
from stalepipe.lab.studies.registry import STUDIES, get_study
from stalepipe.lab.sweeps import plan
from stalepipe.lab.sweeps.grid import (
    axis,
    check_overrides,
    dedupe,
    expand,
    parse_grid_arg,
    select_runs,
)
from stalepipe.lab.sweeps.sweep import (
    ERROR_FILE,
    run_status,
    run_sweep,
    write_error,
)
from stalepipe.training.launch import task as trainer


def test_expand_product_names_and_seeds():
    specs = expand(
        [parse_grid_arg("optim.name=adamw,muon"), [("sync", {"delay.policy": "sync"}),
         ("2bw+ef", {"delay.policy": "2bw", "delay.ef": "true"})]],
        seeds=2,
    )  # fmt: skip
    assert [s.name for s in specs] == [
        "adamw_sync_s0", "adamw_sync_s1", "adamw_2bw+ef_s0", "adamw_2bw+ef_s1",
        "muon_sync_s0", "muon_sync_s1", "muon_2bw+ef_s0", "muon_2bw+ef_s1",
    ]  # fmt: skip
    s = specs[3]
    assert s.overrides == {"optim.name": "adamw", "delay.policy": "2bw", "delay.ef": "true"}
    assert (s.seed, s.group) == (1, "adamw_2bw+ef")
    assert [x.name for x in expand([axis("delay.policy", ["fixed:2"])])] == ["fixed-2_s0"]
    assert [x.name for x in expand([axis("optim.lr", [1e-3])], seeds=[5])] == ["lr0.001_s5"]


def test_spec_config_sets_seed_name_and_overrides(tiny_config):
    spec = expand([axis("optim.beta1", ["0.8"])], seeds=[3])[0]
    cfg = spec.config(tiny_config, "/tmp/x")
    assert (cfg.name, cfg.out_dir, cfg.optim.beta1) == ("b10.8_s3", "/tmp/x", 0.8)
    assert cfg.train.seed == cfg.data.seed == 3


def test_grid_arg_and_bad_values(tiny_config):
    with pytest.raises(UserError, match="KEY=V1"):
        parse_grid_arg("optim.name")
    with pytest.raises(ConfigError, match="run lr-1_s0: optim.lr must be > 0"):
        check_overrides(expand([axis("optim.lr", ["-1"])]), tiny_config)
    with pytest.raises(ConfigError, match="unknown config key"):
        check_overrides(expand([axis("optim.lrr", ["1"])]), tiny_config)


def test_only_keeps_the_runs_whose_config_has_the_values():
    base = scales.base_config("cpu-regime")
    specs = get_study("optimizers").specs("cpu-regime", 2)
    names = lambda kept: {s.name for s in kept}  # noqa: E731
    kept = select_runs(specs, base, ["optim.name=adamw,muon"])
    assert names(kept) == {f"{o}_{a}_s{k}" for o in ("adamw", "muon")
                           for a in ("sync", "2bw", "2bw+ef") for k in (0, 1)}  # fmt: skip
    # values compare as the config holds them: "0.01" keeps a run at 1e-2, "true" EF on
    at_1e2 = {o for o, lr in scales.LRS["cpu-regime"].items() if float(lr) == 0.01}
    assert "muon" in at_1e2  # Muon's LR at this scale is written "0.01"
    kept = select_runs(specs, base, ["optim.lr=1e-2", "delay.ef=true"])
    assert names(kept) == {f"{o}_2bw+ef_s{k}" for o in at_1e2 for k in (0, 1)}
    assert select_runs(specs, base, []) == specs
    for bad, msg in [
        (["optim.nme=adamw"], "unknown config key --optim.nme; did you mean --optim.name"),
        (["optim.name"], "--only expects KEY=V1,V2"),
        (["optim.lr=fast"], "--optim.lr expects a float"),
        (["optim.name=sgd"], "no run of this sweep matches"),
        (["delay.policy=pipedream"], "no run of this sweep matches"),
    ]:
        with pytest.raises((UserError, ConfigError), match=msg):
            select_runs(specs, base, bad)


def test_dedupe_keeps_first_and_rejects_clashes():
    a = expand([axis("delay.policy", ["sync", "2bw"])])
    assert [s.name for s in dedupe(a + a)] == ["sync_s0", "2bw_s0"]
    clash = expand([[("x", {"optim.lr": "1"})]]) + expand([[("x", {"optim.lr": "2"})]])
    with pytest.raises(AssertionError, match="clash"):
        dedupe(clash)


@pytest.mark.parametrize("name", list(STUDIES))
def test_every_study_expands_to_valid_configs(name, monkeypatch):
    study = STUDIES[name]
    if name == "ladder":  # phase 2 waits for phase 1's LRs: expand it with the grids' middles
        lrs = {
            (n, w): ladder.ladder_lrs(n, w)[1] for n in ("adamw", "muon") for w, *_ in ladder.LADDER
        }
        monkeypatch.setattr(ladder, "LADDER_LRS", lrs)
    for scale in study.scales:
        specs = study.specs(scale, seeds=2)
        assert specs and len({s.name for s in specs}) == len(specs)
        check_overrides(specs, study.base(scale))


def test_paper_mini_contents():
    specs = STUDIES["paper-mini"].specs("cpu", seeds=3)
    groups = {s.group for s in specs}
    assert {"adamw_sync", "adamw_2bw", "adamw_2bw+ef", "muon_sync", "muon_2bw",
            "muon_2bw+ef"} <= groups  # fmt: skip
    assert {"adamw_pipedream_P2", "adamw_pipedream_P4"} <= groups
    assert len(specs) == 3 * len(groups)
    with pytest.raises(UserError, match="runs at --scale cpu"):
        STUDIES["paper-mini"].specs("135m", 1)
    with pytest.raises(UserError, match="did you mean 'depth'"):
        get_study("deptj")
    assert "paper-mini" in plan.study_table(seeds=3)


def test_run_status(tmp_path):
    d = tmp_path / "r"
    assert run_status(d) == "missing"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"train": {"steps": 3}}))
    (d / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    assert run_status(d) == "partial"
    (d / "metrics.jsonl").write_text('{"step": 2, "loss": 1.0, "val_loss": 1.1}\n')
    assert run_status(d) == "finished"
    write_error(d, "boom")
    assert run_status(d) == "failed"


def test_sweep_resume_skip_and_retry(tiny_config, tmp_path):
    """One tiny real sweep (2 runs x 3 steps, in-process, plus a run that fails at start-up):
    the failure is recorded and the other runs finish; a rerun skips finished runs and keeps
    the failed one; retry_failed reruns it."""
    import dataclasses

    base = dataclasses.replace(
        tiny_config, train=dataclasses.replace(tiny_config.train, num_steps=3, eval_every=0)
    )
    # vocab 64 cannot hold byte tokens: train() raises a DataError before the first step
    specs = expand([[("sync", {"delay.policy": "sync"}), ("bad", {"model.vocab_size": "64"}),
                     ("2bw", {"delay.policy": "2bw"})]])  # fmt: skip
    out = tmp_path / "sweep"
    logs = []
    res = run_sweep(trainer, specs, base, out, log=logs.append)
    assert sorted(res.ran) == ["2bw_s0", "sync_s0"]
    assert list(res.failed) == ["bad_s0"] and "vocab" in res.failed["bad_s0"]
    err = json.loads((out / "bad_s0" / ERROR_FILE).read_text())
    assert "Traceback" in err["traceback"]
    assert run_status(out / "sync_s0") == run_status(out / "2bw_s0") == "finished"
    assert json.loads((out / "sync_s0" / "sweep.json").read_text())["group"] == "sync"
    assert any("[2/3] bad_s0: FAILED: DataError" in m for m in logs), logs

    logs.clear()
    res = run_sweep(trainer, specs, base, out, log=logs.append)
    assert res.ran == [] and sorted(res.finished) == ["2bw_s0", "sync_s0"]
    assert res.skipped_failed == ["bad_s0"] and "vocab" in res.failed["bad_s0"]
    assert "2 finished, 1 failed earlier (rerun with --retry-failed), 0 to run" in logs[0]

    # changing the study's config does not silently rerun or relabel finished runs: it warns
    logs.clear()
    lr_base = dataclasses.replace(base, optim=dataclasses.replace(base.optim, lr=0.5))
    res = run_sweep(trainer, specs[:1], lr_base, out, log=logs.append)
    assert res.ran == [] and res.changed == {"sync_s0": ["optim.lr"]}
    assert "warning: 1 finished run(s) were made with a different config" in logs[1]
    assert run_sweep(trainer, specs[:1], base, out, log=logs.append).changed == {}

    # a finished run whose error.json appears (say, a crash after its last step) is failed
    write_error(out / "2bw_s0", "RuntimeError: simulated crash")
    good = [s for s in specs if s.name != "bad_s0"]
    res = run_sweep(trainer, good, base, out, log=logs.append)
    assert res.ran == [] and res.failed == {"2bw_s0": "RuntimeError: simulated crash"}
    res = run_sweep(trainer, good, base, out, retry_failed=True, log=logs.append)
    assert res.ran == ["2bw_s0"] and not res.failed
    assert not (out / "2bw_s0" / ERROR_FILE).exists()


def test_the_same_run_under_two_names_is_trained_once(tiny_config, tmp_path):
    """A grid point equal to another (a setting spelled at its default) and a run finished in
    the sweep directory under another name (a study swept beside another) are not repeated:
    the dry run lists them as the same, the sweep counts them and trains the rest."""
    import dataclasses

    from stalepipe.lab.sweeps.sweep import plan_status
    from stalepipe.training.optim import resolve_config

    base = dataclasses.replace(
        tiny_config, train=dataclasses.replace(tiny_config.train, num_steps=3, eval_every=0)
    )
    out = tmp_path / "sweep"
    first = expand([[("sync", {"delay.policy": "sync"})]])
    assert run_sweep(trainer, first, base, out, log=lambda m: None).ran == ["sync_s0"]
    lr0 = resolve_config(base.optim).lr  # the default, as train() records it
    lr = str(lr0)
    specs = expand(
        [
            [("lr", {"optim.lr": lr}), ("lr2", {"optim.lr": str(lr0 * 2)})],
            [("sync", {"delay.policy": "sync"}), ("2bw", {"delay.policy": "2bw"})],
        ]
    )
    specs.append(expand([[("again_2bw", {"delay.policy": "2bw", "optim.lr": lr})]])[0])
    plan = {p.spec.name: p.same for p in plan_status(specs, base, out)}
    assert plan == {"lr_sync_s0": "sync_s0", "lr_2bw_s0": "", "lr2_sync_s0": "",
                    "lr2_2bw_s0": "", "again_2bw_s0": "lr_2bw_s0"}  # fmt: skip
    logs = []
    res = run_sweep(trainer, specs, base, out, log=logs.append)
    assert sorted(res.ran) == ["lr2_2bw_s0", "lr2_sync_s0", "lr_2bw_s0"]
    assert res.same == {"lr_sync_s0": "sync_s0", "again_2bw_s0": "lr_2bw_s0"}
    assert "2 the same as another run (not repeated), 0 failed earlier, 3 to run" in logs[0]
    assert "3/3 finished" in logs[-1]
    assert not (out / "lr_sync_s0").exists() and not (out / "again_2bw_s0").exists()
    # a different seed is a different run
    other_seed = expand([[("sync", {"delay.policy": "sync"})]], seeds=[1])
    assert [p.same for p in plan_status(other_seed, base, out)] == [""]


@pytest.mark.slow
def test_parallel_failure_is_isolated(tiny_config, tmp_path):
    """Two worker processes (spawn): a run that raises is recorded in its error.json; the
    other run finishes. Slow only because each spawned process imports torch."""
    import dataclasses

    base = dataclasses.replace(
        tiny_config, train=dataclasses.replace(tiny_config.train, num_steps=2, eval_every=0)
    )
    specs = expand([[("ok", {}), ("bad", {"model.vocab_size": "64"})]])
    res = run_sweep(trainer, specs, base, tmp_path / "s", workers=2, log=lambda m: None)
    assert res.ran == ["ok_s0"]
    assert list(res.failed) == ["bad_s0"] and "vocab" in res.failed["bad_s0"]
    err = json.loads((tmp_path / "s" / "bad_s0" / ERROR_FILE).read_text())
    assert "Traceback" in err["traceback"]


def test_cli_sweep_and_report_errors(tmp_path, capsys):
    from stalepipe.cli import main

    assert main(["sweep", "paper-mini", "--dry-run", "--out", str(tmp_path / "pm")]) == 0
    out = capsys.readouterr().out
    assert "missing   adamw_2bw+ef_s0: --optim.name adamw" in out
    assert "132 runs, 132 to run: ~" in out and "of CPU core time" in out
    assert not (tmp_path / "pm").exists()  # a dry run writes nothing
    done = tmp_path / "pm" / "adamw_2bw+ef_s0"  # a finished run is not counted again
    done.mkdir(parents=True)
    (done / "ckpt_00000200.pt").touch()
    assert main(["sweep", "paper-mini", "--dry-run", "--out", str(tmp_path / "pm")]) == 0
    out = capsys.readouterr().out
    assert "finished  adamw_2bw+ef_s0" in out and "132 runs, 131 to run" in out
    bad = [
        (["sweep"], "name a STUDY or give at least one --grid"),
        (["sweep", "paper-mini", "--scale", "135m", "--dry-run"], "runs at --scale cpu"),
        (["sweep", "--grid", "optim.lr=-1", "--dry-run"], "optim.lr must be > 0"),
        (["sweep", "depth", "--grid", "optim.lr=1"], "drop the STUDY name"),
        (
            ["sweep", "--grid", "optim.name=adamw", "--set", "train.num_steps"],
            "--set expects KEY=VALUE",
        ),
        (["report", str(tmp_path / "nope")], "is not a directory"),
    ]
    for argv, msg in bad:
        assert main(argv) == 2, argv
        assert msg in capsys.readouterr().err, argv


def test_a_signal_stops_the_sweep_with_its_run_checkpointed_not_failed(
    tiny_config, tmp_path, monkeypatch
):
    """SIGTERM during a sweep's run: the run checkpoints (no error.json, not 'failed'), the
    sweep stops with Preempted, and a rerun resumes it."""
    import dataclasses
    import os
    import signal

    from stalepipe.errors import Preempted
    from stalepipe.training.rundir import metrics

    base = dataclasses.replace(
        tiny_config, train=dataclasses.replace(tiny_config.train, num_steps=8, eval_every=0)
    )
    specs = expand([[("2bw", {"delay.policy": "2bw", "pipeline.num_stages": "2"})]], seeds=2)
    write = metrics.MetricsWriter.write

    def write_and_signal(self, record):
        write(self, record)
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(metrics.MetricsWriter, "write", write_and_signal)
    out = tmp_path / "sweep"
    logs = []
    with pytest.raises(Preempted, match="rerun it to resume"):
        run_sweep(trainer, specs, base, out, log=logs.append)
    assert not (out / "2bw_s0" / ERROR_FILE).exists()
    assert (
        run_status(out / "2bw_s0") != "failed"
        and not (out / "2bw_s1").joinpath("metrics.jsonl").exists()
    )
    assert any("stopped by a signal" in m for m in logs), logs
    monkeypatch.undo()
    res = run_sweep(trainer, specs, base, out, log=logs.append)
    assert sorted(res.finished) == ["2bw_s0", "2bw_s1"] and not res.failed


def test_extend_plans_the_delayed_arms_longer(tiny_config):
    """`--extend 1.5,2`: every delayed spec again at 1.5x and 2x its steps with warmup and the
    eval interval stretched (the evaluations stay as many), sync never; factors <= 1 refused."""
    import dataclasses

    from stalepipe.lab.sweeps.grid import extend_delayed

    base = dataclasses.replace(
        tiny_config, train=dataclasses.replace(tiny_config.train, num_steps=40, warmup_steps=4,
                                               eval_every=10)
    )  # fmt: skip
    specs = expand(
        [[("sync", {"delay.policy": "sync"}), ("2bw", {"delay.policy": "2bw"})]], seeds=2
    )
    longer = extend_delayed(specs, base, [1.5, 2])
    assert [s.name for s in longer] == ["2bw_x1.5_s0", "2bw_x2_s0", "2bw_x1.5_s1", "2bw_x2_s1"]
    two = longer[1].config(base, ".")
    assert (two.train.num_steps, two.train.warmup_steps, two.train.eval_every) == (80, 8, 20)
    assert two.delay.policy == "2bw" and two.train.seed == 0
    with pytest.raises(UserError, match="factors must be > 1"):
        extend_delayed(specs, base, [1.0])
    # `--lengths`: sync too, so the report draws every arm's final loss against its length
    both = extend_delayed([s for s in specs if s.seed == 0], base, [1.1, 1.2], sync_too=True)
    assert [s.name for s in both] == ["sync_x1.1_s0", "sync_x1.2_s0", "2bw_x1.1_s0", "2bw_x1.2_s0"]
    assert both[1].config(base, ".").train.num_steps == 48
