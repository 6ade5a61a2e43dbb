"""Extending a run (`--resume` with another train.num_steps), continuing it with a lower LR, and
branching a new run from another's checkpoint (`--init-from`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from stalepipe.cli import main
from stalepipe.errors import CheckpointError, UserError
from stalepipe.training.rundir.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    remove_checkpoint,
)
from stalepipe.training.rundir.metrics import read_metrics
from stalepipe.training.rundir.status import checkpoint_path
from stalepipe.training.train.loop import train


def _cfg(tiny_config, name, **train_kw):
    kw = {"lr_schedule": "constant", "eval_every": 0, "ckpt_every": 4, "keep_last": 5}
    return dataclasses.replace(
        tiny_config,
        name=name,
        delay=dataclasses.replace(tiny_config.delay, policy="2bw", ef=True),
        pipeline=dataclasses.replace(tiny_config.pipeline, num_stages=2),
        train=dataclasses.replace(tiny_config.train, **{**kw, **train_kw}),
    )


def _final(run_dir) -> dict:
    return load_checkpoint(latest_checkpoint(run_dir))["model"]


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_extending_a_finished_run_equals_a_longer_run(tiny_config):
    longer = train(_cfg(tiny_config, "long", num_steps=12), verbose=False)
    short = _cfg(tiny_config, "short", num_steps=8)
    train(short, verbose=False)
    extended = train(_cfg(tiny_config, "short", num_steps=12), resume=True, verbose=False)
    assert len(extended.train_losses) == 4
    _assert_bitwise(_final(longer.run_dir), _final(extended.run_dir))
    assert [r["step"] for r in read_metrics(extended.run_dir)] == list(range(12))


def test_wsd_extends_from_its_stable_phase(tiny_config):
    wsd = {"lr_schedule": "wsd", "decay_frac": 0.25}
    longer = train(_cfg(tiny_config, "long", num_steps=16, **wsd), verbose=False)
    run = train(_cfg(tiny_config, "run", num_steps=12, **wsd), verbose=False).run_dir
    # the 12-step run decayed from step 9 on: its step-12 checkpoint cannot be extended ...
    with pytest.raises(UserError, match="train.num_steps"):
        train(_cfg(tiny_config, "run", num_steps=16, **wsd), resume=True, verbose=False)
    # ... its step-8 one, from the stable phase, can (here: after dropping the later one)
    remove_checkpoint(checkpoint_path(run, 12))
    extended = train(_cfg(tiny_config, "run", num_steps=16, **wsd), resume=True, verbose=False)
    _assert_bitwise(_final(longer.run_dir), _final(extended.run_dir))


def test_cosine_cannot_be_extended_and_the_message_names_the_way_out(tiny_config):
    train(_cfg(tiny_config, "cos", num_steps=8, lr_schedule="cosine"), verbose=False)
    with pytest.raises(UserError, match=r"train\.num_steps.*(--init-from|new run)"):
        train(
            _cfg(tiny_config, "cos", num_steps=12, lr_schedule="cosine"), resume=True, verbose=False
        )


def test_resume_with_a_lower_lr_uses_it_and_matches_a_branch(tiny_config):
    base = _cfg(tiny_config, "base", num_steps=8)
    train(base, verbose=False)
    lower = dataclasses.replace(base.optim, lr=5e-4)
    remove_checkpoint(checkpoint_path(Path(base.out_dir) / "base", 8))  # resume from step 4
    resumed = train(dataclasses.replace(base, optim=lower), resume=True, verbose=False)
    lrs = {r["step"]: r["lr"] for r in read_metrics(resumed.run_dir) if "lr" in r}
    assert lrs[7] == pytest.approx(5e-4)
    parent = Path(base.out_dir) / "parent"
    train(_cfg(tiny_config, "parent", num_steps=4), verbose=False)
    branch = dataclasses.replace(base, name="branch", optim=lower)
    branched = train(branch, verbose=False, init_from=checkpoint_path(parent, 4))
    _assert_bitwise(_final(resumed.run_dir), _final(branched.run_dir))
    meta = json.loads((branched.run_dir / "meta.json").read_text())
    assert json.dumps(meta).count(str(checkpoint_path(parent, 4).resolve())) >= 1


def test_init_from_cli_branches_and_a_requeued_branch_continues_itself(tiny_config, tmp_path):
    parent = _cfg(tiny_config, "parent", num_steps=8)
    train(parent, verbose=False)
    branch = _cfg(tiny_config, "branch", num_steps=12)
    path = tmp_path / "branch.json"
    path.write_text(branch.to_json())
    args = ["train", "--config", str(path), "--init-from", f"{parent.out_dir}/parent@4"]
    assert main([*args, "--resume"]) == 0
    assert [r["step"] for r in read_metrics(Path(branch.out_dir) / "branch")][0] == 4
    # requeued with the same command: the branch has its own checkpoint now, nothing to redo
    assert main([*args, "--resume"]) == 0
    assert load_checkpoint(latest_checkpoint(Path(branch.out_dir) / "branch"))["step"] == 12


@pytest.mark.parametrize(
    ("spec", "match"),
    [("nowhere", "no checkpoint in nowhere"), ("{run}@5", "no checkpoint of step 5 .*has: 4, 8")],
)
def test_init_from_errors_name_what_exists(tiny_config, spec, match):
    run = train(_cfg(tiny_config, "p", num_steps=8), verbose=False).run_dir
    from stalepipe.training.rundir.resume import parent_checkpoint

    with pytest.raises(CheckpointError, match=match):
        parent_checkpoint(spec.format(run=run))


def test_config_json_resume_continues_the_run_from_any_directory(
    tiny_config, tmp_path, monkeypatch
):
    """The command a refused resume recommends, `--config RUN/config.json --resume`, works from
    another working directory (config.json keeps its relative out_dir and data_dir)."""
    cfg = _cfg(tiny_config, "here", num_steps=8)
    run = train(cfg, verbose=False).run_dir
    remove_checkpoint(checkpoint_path(run, 8))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--config", str(run / "config.json"), "--resume"]) == 0
    assert load_checkpoint(latest_checkpoint(run))["step"] == 8
    assert not any(elsewhere.iterdir())  # nothing written where it was run from


def test_init_from_a_checkpoint_at_or_past_the_end_is_refused_before_anything_is_made(
    tiny_config, tmp_path
):
    parent = _cfg(tiny_config, "parent", num_steps=8)
    train(parent, verbose=False)
    branch = _cfg(tiny_config, "late", num_steps=8)
    path = tmp_path / "late.json"
    path.write_text(branch.to_json())
    args = ["train", "--config", str(path), "--init-from", f"{parent.out_dir}/parent"]
    assert main(args) == 2
    assert not (Path(branch.out_dir) / "late").exists()
