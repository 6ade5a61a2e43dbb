"""The runtime's zb-h1, interleaved-1f1b and wpipe schedules, and MoE models on the runtime,
against the single-process engines (gloo, spawn, one thread each; fixtures in
tests/dist/conftest.py).

- zb-h1 (sync, backward split into BI and BW) == plain gradient accumulation, bit for bit;
- interleaved-1f1b (two or three stages per process) == plain gradient accumulation, bit for
  bit, evaluations and a mid-run checkpoint included; tied: == the emulator's exact mode;
- wpipe (first half of the stages stale by one, second half fresh; each of WPipe's 2R
  partitions in a process of its own) == the emulator's exact mode, bit for bit, tied
  embeddings included; weight versions kept: 2 in the first half, 1 in the second;
- MoE with its auxiliary losses on: 2bw == the emulator's exact mode and 1f1b == the plain
  loop, bit for bit, and the logged loss adds the auxiliary losses as the loop's does;
- `stalepipe train --pipeline.engine distributed --pipeline.schedule wpipe` end to end;
- what the runtime refuses for these schedules: one-line ConfigErrors naming the fix.
wpipe and MoE-2bw run with dropout on (masks seeded per (stage, step, microbatch) in both
engines).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from stalepipe.cli import main
from stalepipe.config import ConfigError
from stalepipe.presets import PRESETS
from stalepipe.training.data import TokenLoader
from stalepipe.training.models import build_model
from stalepipe.training.rundir.metrics import read_metrics
from stalepipe.training.schedules.generators import make_schedule, one_stage_per_rank
from stalepipe.training.schedules.schedule import peak_versions, validate
from stalepipe.training.train.pipelined import check_config, runtime_schedule


def _moe(cfg, **model_kw):
    """`cfg` with cpu-moe's router (8 experts, top-2), experts as wide as the fixture's MLP."""
    moe = PRESETS["cpu-moe"]().model
    model = dataclasses.replace(
        cfg.model,
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        expert_ffn_dim=cfg.model.ffn_dim // 2,
        aux_loss_weight=0.01,
        z_loss_weight=0.001,
        **model_kw,
    )
    return dataclasses.replace(cfg, model=model)


def _losses(cfg, name: str | None = None) -> list[float]:
    return [r["loss"] for r in read_metrics(Path(cfg.out_dir) / (name or cfg.name))]


def _rank0(reports: list[dict]) -> dict:
    return next(r for r in reports if r["rank"] == 0)


# --------------------------------------------------------------------------------------------
# zb-h1
# --------------------------------------------------------------------------------------------


def _assert_zb_h1_equals_accumulation(P, m, make_cfg, run_dist, dist_utils) -> None:
    cfg = make_cfg("zb-h1", P, m, tied=False)
    assert any(a.kind == "BW" for a in runtime_schedule(cfg).ranks[0])  # the split backward
    run_dist(cfg)
    ref = dist_utils["reference"](cfg, mode="fast")  # sync + fast = the plain loop
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), ref)
    assert _losses(cfg) == pytest.approx(_losses(cfg, "ref"), rel=1e-6)


def test_zb_h1_equals_gradient_accumulation(make_cfg, run_dist, dist_utils):
    _assert_zb_h1_equals_accumulation(2, 3, make_cfg, run_dist, dist_utils)


@pytest.mark.slow
def test_zb_h1_equals_gradient_accumulation_p4(make_cfg, run_dist, dist_utils):
    _assert_zb_h1_equals_accumulation(4, 4, make_cfg, run_dist, dist_utils)


# --------------------------------------------------------------------------------------------
# interleaved 1F1B: several stages per process
# --------------------------------------------------------------------------------------------


def _interleaved_case(P, C, m, make_cfg, run_dist, dist_utils, **kw) -> list[dict]:
    cfg = make_cfg("interleaved-1f1b", P, m, chunks=C, tied=False, **kw)
    sched = runtime_schedule(cfg)
    assert (sched.num_ranks, sched.num_chunks) == (P // C, C)
    reports = run_dist(cfg)
    assert sorted(r["stages"] for r in reports) == [
        list(range(r, P, P // C)) for r in range(P // C)
    ]
    ref = dist_utils["reference"](cfg, mode="fast")  # sync + fast = the plain loop
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), ref)
    assert _losses(cfg) == pytest.approx(_losses(cfg, "ref"), rel=1e-6)
    return reports


def test_interleaved_1f1b_equals_gradient_accumulation(make_cfg, run_dist, dist_utils):
    """Two processes, two stages each (rank 0: stages 0 and 2, rank 1: stages 1 and 3), with
    evaluations and a checkpoint mid-run (parts of several stages merged)."""
    cfg_kw = {"steps": 4, "eval_every": 2, "ckpt_every": 2}
    _interleaved_case(4, 2, 2, make_cfg, run_dist, dist_utils, **cfg_kw)
    cfg = make_cfg("interleaved-1f1b", 4, 2, chunks=2, tied=False, **cfg_kw)
    got, want = dist_utils["val_losses"](cfg), dist_utils["val_losses"](cfg, "ref")
    assert got.keys() == want.keys() == {1, 3}
    assert got == pytest.approx(want, rel=1e-6)


def test_interleaved_1f1b_tied_equals_emulator_exact(make_cfg, run_dist, dist_utils):
    """A tied embedding between stage 0 (rank 0) and stage 3 (rank 1), dropout on: the
    emulator's exact mode (per-stage masks, first stage's + last stage's gradient)."""
    cfg = make_cfg("interleaved-1f1b", 4, 2, chunks=2, tied=True, dropout=0.1)
    reports = run_dist(cfg)
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), dist_utils["reference"](cfg))
    first, last = (next(r for r in reports if s in r["stages"]) for s in (0, 3))
    assert torch.equal(last["tied_head"], first["weights"]["tok_emb.weight"])


@pytest.mark.parametrize(("schedule", "P", "m"), [("zb-v", 4, 4), ("dualpipev", 4, 4)])
def test_v_schedules_equal_gradient_accumulation(schedule, P, m, make_cfg, run_dist, dist_utils):
    """ZB-V and DualPipeV: rank r runs stages r and 2R-1-r, so rank 0 holds the embedding and
    the loss and rank R-1 hands stage R-1's output to stage R without a message; backward
    split into BI and BW."""
    cfg = make_cfg(schedule, P, m, chunks=2, tied=False, eval_every=2)
    sched = runtime_schedule(cfg)
    assert (sched.num_ranks, sched.placement) == (P // 2, "v")
    assert any(a.kind == "BW" for a in sched.ranks[0])
    reports = run_dist(cfg)
    assert sorted(r["stages"] for r in reports) == [[r, P - 1 - r] for r in range(P // 2)]
    ref = dist_utils["reference"](cfg, mode="fast")
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), ref)
    assert _losses(cfg) == pytest.approx(_losses(cfg, "ref"), rel=1e-6)
    got, want = dist_utils["val_losses"](cfg), dist_utils["val_losses"](cfg, "ref")
    assert got.keys() == want.keys() and got == pytest.approx(want, rel=1e-6)


def test_zb_v_tied_on_one_process_equals_emulator_exact(make_cfg, run_dist, dist_utils):
    """Both ends of the tied embedding on rank 0: the head reads the owner's matrix, the
    gradients are summed first stage's + last stage's, as in the emulator's exact mode."""
    cfg = make_cfg("zb-v", 4, 4, chunks=2, tied=True, dropout=0.1)
    run_dist(cfg)
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), dist_utils["reference"](cfg))


@pytest.mark.slow
def test_interleaved_1f1b_three_chunks_equals_gradient_accumulation(make_cfg, run_dist, dist_utils):
    cfg = make_cfg("interleaved-1f1b", 4, 4, chunks=2, tied=False)
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, num_layers=6),
        pipeline=dataclasses.replace(cfg.pipeline, num_stages=6, num_chunks=3),
    )
    assert runtime_schedule(cfg).num_ranks == 2
    run_dist(cfg)
    ref = dist_utils["reference"](cfg, mode="fast")
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), ref)


# --------------------------------------------------------------------------------------------
# wpipe
# --------------------------------------------------------------------------------------------


def _assert_wpipe_equals_emulator(P, m, make_cfg, run_dist, dist_utils) -> None:
    cfg = make_cfg("wpipe", P, m, tied=True, steps=5, dropout=0.1)
    sched = runtime_schedule(cfg)
    validate(sched)
    want = [2] * (P // 2) + [1] * (P // 2)  # group 0 double-buffered, group 1 fresh
    assert peak_versions(sched) == want
    reports = run_dist(cfg)
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), dist_utils["reference"](cfg))
    assert {r["stage"]: r["peak_versions"] for r in reports} == dict(enumerate(want))
    first, last = (next(r for r in reports if r["stage"] == s) for s in (0, P - 1))
    assert torch.equal(last["tied_head"], first["weights"]["tok_emb.weight"])
    tau = [r["tau"] for r in read_metrics(Path(cfg.out_dir) / cfg.name)]
    assert tau[-1] == [1] * (P // 2) + [0] * (P // 2)
    assert _losses(cfg) == pytest.approx(_losses(cfg, "ref"), rel=1e-6)


@pytest.mark.parametrize(("P", "m"), [(2, 2), (4, 2), pytest.param(4, 4, marks=pytest.mark.slow)])
def test_wpipe_equals_emulator_exact(P, m, make_cfg, run_dist, dist_utils):
    _assert_wpipe_equals_emulator(P, m, make_cfg, run_dist, dist_utils)


@pytest.mark.slow
def test_wpipe_sync_windows_equal_emulator_exact(make_cfg, run_dist, dist_utils):
    cfg = make_cfg("wpipe", 2, 2, steps=6)
    cfg = dataclasses.replace(
        cfg, delay=dataclasses.replace(cfg.delay, sync_start=2, sync_cooldown=1)
    )
    run_dist(cfg)
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), dist_utils["reference"](cfg))


# --------------------------------------------------------------------------------------------
# MoE
# --------------------------------------------------------------------------------------------


def _step0_losses(cfg) -> tuple[float, float]:
    """(training loss with the auxiliary losses, cross-entropy only) of step 0 at W_0, as the
    plain loop computes them: mean over the microbatches of the whole model."""
    model = build_model(cfg.model, cfg.train.seed)
    loader = TokenLoader(cfg.data.data_dir, "train", cfg.data.seq_len, cfg.data.seed)
    x, y = loader.batch(0, cfg.train.batch_size)
    micro = list(zip(x.chunk(cfg.train.num_microbatches), y.chunk(cfg.train.num_microbatches)))
    out = []
    for train_mode in (True, False):
        model.train(train_mode)
        with torch.no_grad():
            out.append(sum(model(a, b).item() for a, b in micro) / len(micro))
    return out[0], out[1]


@pytest.mark.parametrize(("schedule", "mode"), [("2bw", "exact"), ("1f1b", "fast")])
def test_moe_equals_single_process(schedule, mode, make_cfg, run_dist, dist_utils):
    # 1f1b against the plain loop: untied (a plain backward sums a tied matrix's two halves in
    # another order, see test_runtime.py).
    # Dropout against the exact mode only (the plain loop draws its masks per whole model).
    drop = 0.1 if mode == "exact" else 0.0
    cfg = _moe(make_cfg(schedule, 2, 2, tied=schedule != "1f1b", dropout=drop))
    run_dist(cfg)
    dist_utils["assert_bitwise"](
        dist_utils["final_model"](cfg), dist_utils["reference"](cfg, mode=mode)
    )
    # Every stage's aux loss is in the logged loss, as in the single-process loop's.
    got, want = _losses(cfg), _losses(cfg, "ref")
    assert got == pytest.approx(want, rel=1e-6)
    if not drop:  # step 0 recomputed here without the engines' dropout masks
        with_aux, ce_only = _step0_losses(cfg)
        assert got[0] == pytest.approx(with_aux, rel=1e-6)
        assert abs(with_aux - ce_only) > 100 * 1e-6 * with_aux  # the aux term is visible


def test_moe_router_stats_logged_like_the_loop(make_cfg, run_dist, dist_utils):
    cfg = _moe(make_cfg("1f1b", 2, 2, steps=2, tied=False))
    run_dist(cfg)
    dist_utils["reference"](cfg, mode="fast")

    def moe(name: str) -> list[dict]:
        rows = read_metrics(Path(cfg.out_dir) / name)
        return [{k: v for k, v in r.items() if k.startswith("moe/")} for r in rows]

    # 1f1b == the single process bit for bit, so the routers saw the same tokens: the stages'
    # sums, gathered to rank 0, give the loop's metrics (to the sums' rounding).
    want, got = moe("ref"), moe(cfg.name)
    assert len(want) == len(got) == 2 and want[0] and want[0].keys() == got[0].keys()
    for w, g in zip(want, got, strict=True):
        assert g == pytest.approx(w, rel=1e-5)


# --------------------------------------------------------------------------------------------
# Configuration and CLI
# --------------------------------------------------------------------------------------------


def test_wpipe_runs_one_stage_per_process(make_cfg):
    """The runtime's wpipe lists: each stage's actions in its WPipe rank's order."""
    cfg = make_cfg("wpipe", 4, 3, steps=3)
    wp = make_schedule("wpipe", 2, 3, 3)  # two stages (one per group) on each of 2 ranks
    got = runtime_schedule(cfg)
    assert (got.num_ranks, got.num_chunks, wp.num_stages) == (4, 1, 4)
    for s in range(4):
        assert list(got.ranks[s]) == [a for a in wp.ranks[wp.rank_of(s)] if a.stage == s]
    validate(got)
    one = make_schedule("2bw", 2, 2, 3)
    assert one_stage_per_rank(one) is one


def test_refusals_name_the_fix(make_cfg):
    check_config(make_cfg("zb-h1", 3, 1))  # ZB-H1 runs with any P and m
    check_config(make_cfg("wpipe", 4, 1))
    refused = [
        (
            dataclasses.replace(make_cfg("wpipe"), delay=make_cfg("2bw").delay),
            "--delay.policy wpipe",
        ),
        (
            dataclasses.replace(make_cfg("zb-h1"), delay=make_cfg("2bw").delay),
            "--delay.policy sync",
        ),
        (  # the schedule that realises the policy asked for comes first
            dataclasses.replace(make_cfg("1f1b"), delay=make_cfg("2bw").delay),
            r"pass --pipeline.schedule 2bw, or --delay.policy sync$",
        ),
    ]
    for cfg, fix in refused:
        with pytest.raises(ConfigError, match=fix) as e:
            check_config(cfg)
        assert "\n" not in str(e.value)
    # The config itself refuses what no engine could run (config.py, checked once).
    with pytest.raises(
        ConfigError, match=r"even pipeline.num_stages.*set pipeline.num_stages to 2 or 4$"
    ):
        make_cfg("wpipe", 3, 2)
    with pytest.raises(
        ConfigError, match=r"set train.num_microbatches to 4 or pipeline.num_stages to 3$"
    ):
        make_cfg("2bw", 4, 2)


def test_interleaved_refusals_name_the_fix(make_cfg):
    check_config(make_cfg("interleaved-1f1b", 4, 2, chunks=2))
    refused = [
        (lambda: make_cfg("interleaved-1f1b", 4, 2), r"set pipeline.num_chunks to 2 or more"),
        (lambda: make_cfg("1f1b", 4, 2, chunks=2), r"set pipeline.num_chunks 1 or one of"),
        (lambda: make_cfg("zb-v", 4, 4), r"in a V .*: set pipeline.num_chunks 2$"),
        (lambda: make_cfg("zb-v", 6, 4, chunks=3), r"set pipeline.num_chunks 2$"),
        (
            lambda: make_cfg("dualpipev", 4, 2, chunks=2, batch_size=16),
            r"dualpipev needs train.num_microbatches >= .* = 4, got 2; set .* to 4$",
        ),
        (lambda: make_cfg("interleaved-1f1b", 4, 2, chunks=3), r"set pipeline.num_chunks to 2$"),
        (lambda: make_cfg("interleaved-1f1b", 4, 2, chunks=4), r"set pipeline.num_chunks to 2$"),
        (  # m a multiple of the 2 processes: the nearest count this batch allows
            lambda: make_cfg("interleaved-1f1b", 4, 3, chunks=2, batch_size=12),
            r"must be a multiple of .* = 2; set train.num_microbatches to 4$",
        ),
    ]
    for make, fix in refused:
        with pytest.raises(ConfigError, match=fix) as e:
            make()
        assert "\n" not in str(e.value)


def test_cli_wpipe_end_to_end(make_cfg, capfd):
    cfg = make_cfg("wpipe", 2, 2)
    args = [
        *("train", "--preset", "cpu-tiny", "--name", "cli-wpipe", "--out_dir", cfg.out_dir),
        *("--data.corpus", "excerpt", "--data.data_dir", cfg.data.data_dir),
        *("--data.seq_len", "16", "--model.dim", "32", "--model.num_layers", "2"),
        *("--model.ffn_dim", "64", "--model.max_seq_len", "16"),
        *("--train.num_steps", "3", "--train.batch_size", "4", "--train.num_microbatches", "2"),
        *("--train.num_eval_batches", "1", "--train.progress", "false"),
        *("--pipeline.engine", "distributed", "--pipeline.num_stages", "2"),
        *("--pipeline.schedule", "wpipe", "--delay.policy", "wpipe", "--pipeline.timeout_s", "30"),
    ]
    assert main(args) == 0  # spawns the two stage processes itself
    assert "done: 3 steps" in capfd.readouterr().out
    run = Path(cfg.out_dir) / "cli-wpipe"
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["tau"] == [1, 0] and "val_loss" in rows[-1]
    assert json.loads((run / "config.json").read_text())["pipeline"]["schedule"] == "wpipe"
