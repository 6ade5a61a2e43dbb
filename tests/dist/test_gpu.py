"""The NCCL / CUDA path of the runtime (skipped without a GPU): one process per GPU, bf16
autocast, compared with the single-process emulator to bf16 tolerance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_bf16_runs_and_matches_emulator(make_cfg, run_dist, dist_utils):
    P = min(2, torch.cuda.device_count())  # NCCL needs one GPU per rank
    cfg = make_cfg("2bw" if P > 1 else "1f1b", P, 2, steps=4)
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, device="cuda", dtype="bfloat16"),
        pipeline=dataclasses.replace(cfg.pipeline, backend="auto"),
    )
    reports = run_dist(cfg)
    assert len(reports) == P
    got = dist_utils["final_model"](cfg)
    ref = dist_utils["reference"](cfg)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k].to(got[k].device), rtol=2e-2, atol=2e-3)
