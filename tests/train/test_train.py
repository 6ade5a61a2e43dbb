"""Training loop: it learns, resumes bit for bit, and refuses bad input without losing data."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from stalepipe.errors import CheckpointError, TrainingError, UserError
from stalepipe.training.rundir.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_checkpoint,
)
from stalepipe.training.rundir.metrics import TIMING_FIELDS, read_metrics
from stalepipe.training.train.loop import train


def _with(cfg, **sections):
    changes = {
        k: dataclasses.replace(getattr(cfg, k), **v) if isinstance(v, dict) else v
        for k, v in sections.items()
    }
    return dataclasses.replace(cfg, **changes)


def test_loss_falls_and_run_directory_is_complete(tiny_config):
    cfg = _with(tiny_config, train={"num_steps": 30, "eval_every": 10}, optim={"lr": 3e-3})
    result = train(cfg, verbose=False)
    assert result.train_losses[-1] < result.train_losses[0] - 0.5
    run = result.run_dir
    assert {"config.json", "meta.json", "metrics.jsonl"} <= {p.name for p in run.iterdir()}
    saved = json.loads((run / "config.json").read_text())
    assert saved["optim"]["lr"] == 3e-3 and saved["optim"]["beta1"] is not None  # resolved
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(30))
    assert [r["step"] for r in records if "val_loss" in r] == [9, 19, 29]
    assert latest_checkpoint(run).name == "ckpt_00000030"


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_resume_equals_uninterrupted_bitwise(tiny_config, tmp_path, dropout):
    cfg = _with(tiny_config, train={"ckpt_every": 5, "keep_last": 5}, model={"dropout": dropout})
    full = train(cfg, verbose=False)
    # Simulate a crash right after the step-10 checkpoint: drop what came later, then resume.
    crashed = tmp_path / "crashed"
    shutil.copytree(full.run_dir, crashed / cfg.name)
    remove_checkpoint(crashed / cfg.name / "ckpt_00000012")
    resumed = train(dataclasses.replace(cfg, out_dir=str(crashed)), resume=True, verbose=False)

    a = load_checkpoint(latest_checkpoint(full.run_dir))
    b = load_checkpoint(latest_checkpoint(resumed.run_dir))
    assert a["step"] == b["step"] == 12
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert resumed.train_losses == full.train_losses[10:]
    meta = [json.loads((r.run_dir / "meta.json").read_text()) for r in (full, resumed)]
    assert [m["resumed"] for m in meta] == [False, True]
    assert meta[0]["git_dirty"] in (True, False, None)
    assert read_metrics(full.run_dir) == _without_time(
        read_metrics(resumed.run_dir), read_metrics(full.run_dir)
    )


def _without_time(resumed, full):
    # tokens/s and timing differ between runs; everything else must be identical
    def strip(r):
        return {k: v for k, v in r.items() if k not in TIMING_FIELDS}

    assert [strip(r) for r in resumed] == [strip(r) for r in full]
    return full


def test_existing_run_directory_is_refused_and_untouched(tiny_config):
    first = train(_with(tiny_config, train={"num_steps": 2}), verbose=False)
    before = {p.name: p.stat().st_mtime_ns for p in first.run_dir.iterdir()}
    with pytest.raises(UserError, match="--resume .* --overwrite"):
        train(_with(tiny_config, train={"num_steps": 2}), verbose=False)
    assert {p.name: p.stat().st_mtime_ns for p in first.run_dir.iterdir()} == before
    again = train(_with(tiny_config, train={"num_steps": 2}), overwrite=True, verbose=False)
    assert again.steps == 2


def test_resume_with_a_different_config_is_refused(tiny_config):
    train(_with(tiny_config, train={"num_steps": 2}), verbose=False)
    with pytest.raises(UserError, match="optim.weight_decay"):
        changed = _with(tiny_config, train={"num_steps": 2}, optim={"weight_decay": 0.5})
        train(changed, resume=True, verbose=False)


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_corrupt_checkpoint_is_reported_with_the_fix(tiny_config, damage):
    cfg = _with(tiny_config, train={"num_steps": 4, "ckpt_every": 2})
    run = train(cfg, verbose=False).run_dir
    last = list_checkpoints(run)[-1]
    shard = next(last.glob("rank_*/*.safetensors"))
    if damage == "truncated":  # by a crash of the disk, say
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        shard.unlink()
    with pytest.raises(
        CheckpointError,
        match=r"^checkpoint file .*ckpt_00000004/rank_000/model-00001-of-00001.safetensors is (missing|100 bytes, "
        r"not \d+); move the checkpoint aside \(mv (.*)ckpt_00000004 \2ckpt_00000004.damaged\) "
        r"to resume, eval or export from the run's previous one, or start over with --overwrite$",
    ):
        train(cfg, resume=True, verbose=False)
    assert last.exists() and [p.name for p in list_checkpoints(run)] == [
        "ckpt_00000002",
        "ckpt_00000004",
    ]  # nothing deleted behind the user's back
    shutil.rmtree(last)  # the fix the message names
    assert len(train(cfg, resume=True, verbose=False).train_losses) == 2  # steps 2 and 3


def test_checkpoint_of_another_model_is_refused(tiny_config, tmp_path):
    from stalepipe.training.models import build_model
    from stalepipe.training.rundir.checkpoint import load_model_state

    run = train(_with(tiny_config, train={"num_steps": 2}), verbose=False).run_dir
    state = load_checkpoint(latest_checkpoint(run))
    other = build_model(
        dataclasses.replace(tiny_config.model, dim=32, num_heads=2, num_kv_heads=1), 0
    )
    with pytest.raises(CheckpointError, match="does not match the model config"):
        load_model_state(other, state["model"], latest_checkpoint(run))
    foreign = tmp_path / "foreign.pt"
    torch.save({"hello": 1}, foreign)
    with pytest.raises(CheckpointError, match="not a stalepipe checkpoint"):
        load_checkpoint(foreign)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny_config, monkeypatch):
    from stalepipe.training.delay import DelayEmulator

    real = DelayEmulator.forward_backward

    def nan_at_step_3(self, step, microbatches):
        loss = real(self, step, microbatches)
        return float("nan") if step == 3 else loss

    monkeypatch.setattr(DelayEmulator, "forward_backward", nan_at_step_3)
    cfg = _with(tiny_config, train={"num_steps": 6, "ckpt_every": 2})
    with pytest.raises(
        TrainingError,
        match=r"non-finite loss \(nan\) at step 3; last good checkpoint: .*ckpt_00000002",
    ):
        train(cfg, verbose=False)
    ckpts = list_checkpoints(f"{tiny_config.out_dir}/tiny")
    assert [c.name for c in ckpts] == ["ckpt_00000002"]
    assert load_checkpoint(ckpts[0])["step"] == 2


def test_diverging_weights_are_never_checkpointed(tiny_config):
    cfg = _with(
        tiny_config,
        name="div",
        train={"num_steps": 6, "ckpt_every": 1, "grad_clip": 0.0},
        optim={"lr": 1e30},
    )
    with pytest.raises(TrainingError, match="non-finite (loss|weights)"):
        train(cfg, verbose=False)
    for c in list_checkpoints(f"{tiny_config.out_dir}/div"):
        state = load_checkpoint(c)
        assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_microbatching_matches_one_big_batch(tiny_config):
    a = train(
        _with(tiny_config, name="a", train={"num_steps": 3, "num_microbatches": 1}), verbose=False
    )
    b = train(
        _with(tiny_config, name="b", train={"num_steps": 3, "num_microbatches": 4}), verbose=False
    )
    sa = load_checkpoint(latest_checkpoint(a.run_dir))["model"]
    sb = load_checkpoint(latest_checkpoint(b.run_dir))["model"]
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-4, atol=1e-6)


def test_tensorboard_scalars_mirror_the_metrics(tiny_config):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train(
        _with(tiny_config, train={"num_steps": 4, "tensorboard": True}), verbose=False
    ).run_dir
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]  # hierarchical names
    assert losses == pytest.approx([r["loss"] for r in read_metrics(run)])
    assert "delay/tau/stage0" in events.Tags()["scalars"] and "optim/lr" in events.Tags()["scalars"]


def test_the_divergence_message_recommends_a_command_that_works(tiny_config, tmp_path, monkeypatch):
    """A NaN loss at step 3 without clipping: the message's command (same config, --resume,
    half the LR, clipping on) is accepted and continues from the last good checkpoint."""
    from stalepipe.cli import main
    from stalepipe.training.delay import DelayEmulator

    real = DelayEmulator.forward_backward
    monkeypatch.setattr(
        DelayEmulator,
        "forward_backward",
        lambda self, step, mb: float("nan") if step == 3 else real(self, step, mb),
    )
    cfg = _with(
        tiny_config,
        name="fix",
        train={"num_steps": 6, "ckpt_every": 2, "grad_clip": 0.0},
        optim={"lr": 1e-3},
    )
    path = tmp_path / "fix.json"
    path.write_text(cfg.to_json())
    with pytest.raises(TrainingError) as err:
        train(cfg, verbose=False)
    fix = "--resume --optim.lr 0.0005 --train.grad_clip 1.0"
    assert str(err.value).endswith(f"continue from it with the same command and {fix}")
    monkeypatch.undo()
    assert main(["train", "--config", str(path), *fix.split()]) == 0
    assert load_checkpoint(latest_checkpoint(f"{tiny_config.out_dir}/fix"))["step"] == 6
