"""Resuming across engines and splits: a checkpoint of either engine (the runtime's merged one,
or the emulator's) continues on the other engine and on another number of stages, in the same
run directory, bit for bit where the trajectory does not depend on the split (sync, 2bw);
pipedream across splits is refused with the fix."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from stalepipe.errors import CheckpointError, UserError
from stalepipe.training.rundir import checkpoint_parts as stage_ckpt
from stalepipe.training.rundir.checkpoint import (
    checkpoint_step,
    list_checkpoints,
    load_checkpoint,
    open_checkpoint,
    remove_checkpoint,
)
from stalepipe.training.rundir.resume import config_diff
from stalepipe.training.train.loop import train


def _on(cfg, engine: str, P: int):
    return dataclasses.replace(
        cfg,
        pipeline=dataclasses.replace(
            cfg.pipeline,
            engine=engine,
            num_stages=P,
            schedule=cfg.pipeline.schedule if engine == "distributed" else "1f1b",
        ),
    )


def _drop_after(cfg, step: int) -> None:
    """Delete the checkpoints after `step` ("crash" there)."""
    for p in list_checkpoints(Path(cfg.out_dir) / cfg.name):
        if checkpoint_step(p) > step:
            remove_checkpoint(p)


def _emulate(cfg) -> None:
    torch.set_num_threads(1)
    train(cfg, resume=True, verbose=False)


def test_2bw_resumes_across_engines_and_splits(make_cfg, run_dist, dist_utils):
    # 2bw delays every stage by one step: the trajectory does not depend on P, and the runtime
    # equals the emulator's exact mode, so every continuation equals the uninterrupted run.
    cfg = make_cfg("2bw", 4, 3, steps=6, ckpt_every=2, keep_last=3, eval_every=3)
    run_dist(cfg)
    want, want_val = dist_utils["final_model"](cfg), dist_utils["val_losses"](cfg)
    same = dist_utils["assert_bitwise"]

    _drop_after(cfg, 2)  # runtime P=4 checkpoint -> emulator P=4 (same split)
    _emulate(_on(cfg, "emulate", 4))
    same(dist_utils["final_model"](cfg), want)
    _drop_after(cfg, 4)  # emulator P=4 checkpoint -> runtime P=2 (re-split per process)
    run_dist(_on(cfg, "distributed", 2), resume=True)
    same(dist_utils["final_model"](cfg), want)
    _drop_after(cfg, 2)  # runtime P=4 checkpoint -> emulator P=2 (re-split in the emulator)
    _emulate(_on(cfg, "emulate", 2))
    same(dist_utils["final_model"](cfg), want)
    got_val = dist_utils["val_losses"](cfg)
    assert sorted(got_val) == sorted(want_val) == [2, 5]
    assert got_val[5] == pytest.approx(want_val[5], abs=1e-6)
    saved = json.loads((Path(cfg.out_dir) / cfg.name / "config.json").read_text())
    assert saved["pipeline"]["num_stages"] == 2 and saved["pipeline"]["engine"] == "emulate"


def test_sync_checkpoint_is_stage_agnostic(make_cfg, run_dist, dist_utils):
    cfg = make_cfg("1f1b", 4, 2, steps=6, ckpt_every=3, tied=False)
    run_dist(cfg)
    want = dist_utils["final_model"](cfg)
    assert load_checkpoint(list_checkpoints(Path(cfg.out_dir) / cfg.name)[0])["step"] == 3
    _drop_after(cfg, 3)
    run_dist(_on(cfg, "distributed", 1), resume=True)  # --resume --pipeline.num_stages 1
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), want)


def test_chunked_checkpoints_resume_on_other_layouts(make_cfg, run_dist, dist_utils):
    """A sync run's checkpoint written by processes of two stages each (interleaved-1f1b,
    zb-v) continues on one stage per process and the other way round, bit for bit."""
    cfg = make_cfg("interleaved-1f1b", 4, 2, chunks=2, steps=6, ckpt_every=2, keep_last=3)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tie_embeddings=False))
    run_dist(cfg)
    want = dist_utils["final_model"](cfg)

    def on(schedule: str, chunks: int):
        pc = dataclasses.replace(cfg.pipeline, schedule=schedule, num_chunks=chunks)
        return dataclasses.replace(cfg, pipeline=pc)

    _drop_after(cfg, 2)  # interleaved (2 processes) -> 1f1b (4 processes)
    run_dist(on("1f1b", 1), resume=True)
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), want)
    _drop_after(cfg, 4)  # 1f1b (4 processes) -> zb-v (2 processes, a V)
    run_dist(on("zb-v", 2), resume=True)
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), want)


def test_pipedream_refuses_another_split(make_cfg):
    cfg = _on(make_cfg("pipedream", 3, 1, steps=4, ckpt_every=2, name="pd"), "emulate", 3)
    torch.set_num_threads(1)
    train(cfg, overwrite=True, verbose=False)
    run_dir = Path(cfg.out_dir) / cfg.name
    _drop_after(cfg, 2)
    before = (run_dir / "config.json").read_text()
    with pytest.raises(UserError, match="pipeline.num_stages: 3 -> 2"):
        train(_on(cfg, "emulate", 2), resume=True, verbose=False)
    assert (run_dir / "config.json").read_text() == before  # nothing written
    # The checkpoint copied into a new run directory: the loaders refuse it with the fix.
    other = dataclasses.replace(_on(cfg, "emulate", 2), name="pd2")
    (Path(cfg.out_dir) / "pd2").mkdir()
    shutil.copytree(run_dir / "ckpt_00000002", Path(cfg.out_dir) / "pd2" / "ckpt_00000002")
    with pytest.raises(CheckpointError, match="resume with --pipeline.num_stages 3"):
        train(other, resume=True, verbose=False)
    flat = open_checkpoint(run_dir / "ckpt_00000002")
    names = stage_ckpt.saved_split(flat)[2]
    split = [names[0] + names[1], names[2]]
    with pytest.raises(CheckpointError, match="delays each stage differently"):
        stage_ckpt.stage_state(flat, [0], split, {"state": {}, "param_groups": []}, [{1}, set()])
    train(cfg, resume=True, verbose=False)  # the run's own split resumes


@pytest.mark.parametrize(
    ("policy", "change", "allowed"),
    [
        ("2bw", {"num_stages": 2, "engine": "emulate"}, True),
        ("sync", {"num_stages": 1, "schedule": "gpipe", "num_replicas": 2}, True),
        ("2bw", {"backend": "gloo", "timeout_s": 5.0}, True),
        ("fixed:2", {"num_stages": 3}, True),
        ("pipedream", {"engine": "emulate"}, True),
        ("pipedream", {"num_stages": 2}, False),
        ("wpipe", {"num_stages": 2}, False),
    ],
)
def test_resumable_pipeline_changes(policy, change, allowed):
    saved = {
        "delay": {"policy": policy},
        "pipeline": {"num_stages": 4, "engine": "distributed", "schedule": "2bw"},
    }
    current = {**saved, "pipeline": {**saved["pipeline"], **change}}
    assert (config_diff(saved, current) == []) == allowed
