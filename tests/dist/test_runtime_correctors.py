"""The delay correctors on the multi-process runtime (gloo, spawn, 1 thread each): weight
prediction, DC-ASGD-EMA, the PipeMare LR schedule and adaptive momentum, each on 2bw and
pipedream (and wpipe), equal the emulator's exact mode bit for bit; a checkpoint of the
runtime resumes on the runtime and on the emulator to the uninterrupted run's weights, bit for
bit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from stalepipe.config import ConfigError, OptimConfig
from stalepipe.training.rundir.checkpoint import (
    checkpoint_step,
    list_checkpoints,
    remove_checkpoint,
)
from stalepipe.training.train.loop import train

CASES = {
    # the tied head predicted on the last stage; the sync start's end re-reads an old version
    "2bw-weight_pred-ef": ("2bw", 2, 2, "adamw", True, dict(weight_pred=True, ef=True, sync_start=2)),
    "pipedream-weight_pred": ("pipedream", 2, 1, "adamw", True, dict(weight_pred=True, weight_pred_scale=0.5)),
    "2bw-dc_asgd_ema": ("2bw", 2, 2, "adamw", True, dict(taylor=0.5, taylor_curvature="ema")),
    "pipedream-dc_asgd_ema": ("pipedream", 2, 1, "adamw", True, dict(taylor=0.5, taylor_curvature="ema", taylor_adaptive=True)),
    "2bw-adaptive_momentum": ("2bw", 2, 2, "muon", True, dict(adaptive_momentum=True)),
    # PipeMare's factor is 1 at tau <= 1: only pipedream with P >= 3 (or fixed:N) moves it
    "pipedream-lr_correction-adaptive_momentum": ("pipedream", 3, 1, OptimConfig(name="nadamw", beta1=0.9), True, dict(lr_correction_steps=3, adaptive_momentum=True)),
    "wpipe-weight_pred-dc_asgd_ema": ("wpipe", 2, 2, "adamw", True, dict(weight_pred=True, taylor=0.5, taylor_curvature="ema")),
    "pipedream-all": ("pipedream", 2, 1, "adamw", False, dict(weight_pred=True, taylor=0.3, taylor_curvature="ema", adaptive_momentum=True)),
}  # fmt: skip


def _drop_after(cfg, step: int) -> None:
    for p in list_checkpoints(Path(cfg.out_dir) / cfg.name):
        if checkpoint_step(p) > step:
            remove_checkpoint(p)


def _on_emulator(cfg):
    return dataclasses.replace(
        cfg, pipeline=dataclasses.replace(cfg.pipeline, engine="emulate", schedule="1f1b")
    )


@pytest.mark.parametrize("case", list(CASES))
def test_corrector_runtime_equals_exact_mode_and_resumes(case, make_cfg, run_dist, dist_utils):
    schedule, P, m, optim, tied, delay = CASES[case]
    optim_cfg = optim if isinstance(optim, OptimConfig) else OptimConfig(name=optim)
    cfg = make_cfg(schedule, P, m, tied=tied, steps=5, ckpt_every=2, keep_last=3, dropout=0.1)
    cfg = dataclasses.replace(cfg, optim=optim_cfg, delay=dataclasses.replace(cfg.delay, **delay))
    run_dist(cfg)
    want = dist_utils["final_model"](cfg)
    same = dist_utils["assert_bitwise"]
    same(want, dist_utils["reference"](cfg))
    plain = make_cfg(schedule, P, m, tied=tied, steps=5, dropout=0.1, name="plain")
    plain = dataclasses.replace(plain, optim=optim_cfg)
    assert any(not torch.equal(want[k], v) for k, v in dist_utils["reference"](plain).items())

    _drop_after(cfg, 2)  # runtime checkpoint -> runtime
    run_dist(cfg, resume=True)
    same(dist_utils["final_model"](cfg), want)
    _drop_after(cfg, 2)  # runtime checkpoint -> emulator (exact mode, same split)
    torch.set_num_threads(1)
    train(_on_emulator(cfg), resume=True, verbose=False)
    same(dist_utils["final_model"](cfg), want)


def test_refused_where_they_would_do_nothing(make_cfg):
    cfg = make_cfg("2bw", 2, 2)
    with pytest.raises(ConfigError, match="PipeMare's factor .* is 1 at tau <= 1"):
        dataclasses.replace(cfg, delay=dataclasses.replace(cfg.delay, lr_correction_steps=5))
    sync = make_cfg("1f1b", 2, 2)
    with pytest.raises(ConfigError, match="delay.adaptive_momentum mitigates a delay"):
        dataclasses.replace(sync, delay=dataclasses.replace(sync.delay, adaptive_momentum=True))
