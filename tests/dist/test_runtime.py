"""The multi-process runtime against the single-process engines (gloo, spawn, 1 thread each).

- sync schedules (gpipe, 1f1b) == plain gradient accumulation, bit for bit (untied embeddings:
  a tied matrix's two gradient halves are summed in another order by a plain backward);
- 2bw and pipedream == the delay emulator's exact mode, bit for bit, dropout on (masks seeded
  per (stage, step, microbatch) in both engines), tied embeddings included, and the last
  stage's copy of the tied matrix == stage 0's;
- with dropout on, 1f1b == the exact mode too (the plain loop draws other masks);
- weight versions kept per stage: 2 for 2bw, P - s for pipedream;
- the validation loss logged at the eval points equals the single-process run's (the runtime
  evaluates in chunks of a microbatch: equal up to fp32 rounding), and the final one is finite.
The full (P, m, optimizer) grid is marked slow; the default suite runs a corner of it.
"""

from __future__ import annotations

import math

import pytest
import torch


def _check_tied(reports: list[dict]) -> None:
    first = next(r for r in reports if r["stage"] == 0)
    last = max(reports, key=lambda r: r["stage"])
    if last["tied_head"] is not None:
        assert torch.equal(last["tied_head"], first["weights"]["tok_emb.weight"])


@pytest.mark.parametrize(("schedule", "P", "m"), [("1f1b", 2, 2), ("gpipe", 3, 2)])
def test_sync_schedules_equal_gradient_accumulation(schedule, P, m, make_cfg, run_dist, dist_utils):
    cfg = make_cfg(schedule, P, m, tied=False, eval_every=3, num_eval_batches=3)
    reports = run_dist(cfg)
    ref = dist_utils["reference"](cfg, mode="fast")  # sync + fast = the plain loop
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), ref)
    _check_val(cfg, reports, dist_utils, steps=[2, 3])


def test_sync_with_dropout_equals_exact_mode(make_cfg, run_dist, dist_utils):
    cfg = make_cfg("1f1b", 3, 2, dropout=0.1)
    run_dist(cfg)
    got = dist_utils["final_model"](cfg)
    dist_utils["assert_bitwise"](got, dist_utils["reference"](cfg))
    plain = dist_utils["reference"](cfg, mode="fast", name="plain")  # other masks: differs
    assert any(not torch.equal(got[k], plain[k]) for k in got)


def _check_val(cfg, reports, dist_utils, steps) -> None:
    """val_loss logged at `steps` (eval points), equal to the single-process run's ("ref")."""
    got, want = dist_utils["val_losses"](cfg), dist_utils["val_losses"](cfg, "ref")
    assert sorted(got) == sorted(want) == steps
    for k in steps:
        assert got[k] == pytest.approx(want[k], rel=0, abs=1e-6), k
    final = next(r for r in reports if r["rank"] == 0)["val_losses"]
    assert final == got and math.isfinite(final[max(final)])


def _assert_async_equals_emulator(
    schedule, P, m, optim, tied, make_cfg, run_dist, dist_utils, steps=4
):
    # Evaluating after every step: the last stage needs tied versions no training step reads.
    cfg = make_cfg(schedule, P, m, tied=tied, optim=optim, steps=steps, eval_every=1, dropout=0.1)
    reports = run_dist(cfg)
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), dist_utils["reference"](cfg))
    _check_val(cfg, reports, dist_utils, steps=list(range(steps)))
    _check_tied(reports)
    peaks = {r["stage"]: r["peak_versions"] for r in reports}
    want = {s: (2 if schedule == "2bw" else P - s) for s in range(P)}
    assert peaks == want
    losses = [loss for _, loss in next(r for r in reports if r["rank"] == 0)["losses"]]
    assert len(losses) == cfg.train.num_steps and all(map(lambda x: x == x, losses))


def test_an_uneven_partition_equals_emulator_exact(make_cfg, run_dist, dist_utils):
    """`pipeline.partition 1,3` (one block on stage 0, three on stage 1; the balanced split of
    this model differs): the runtime's stages and the emulator's are the same split, bit for
    bit."""
    import dataclasses

    from stalepipe.training.models import split_layers

    cfg = make_cfg("2bw", 2, 2, steps=3, eval_every=1, dropout=0.1)
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, partition="1,3"))
    assert split_layers(cfg.model, 2, split="1,3") != split_layers(cfg.model, 2)
    run_dist(cfg)
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), dist_utils["reference"](cfg))


@pytest.mark.parametrize(
    ("schedule", "P", "m", "optim"),
    [("2bw", 2, 2, "adamw"), ("2bw", 3, 2, "muon"), ("pipedream", 3, 1, "adamw")],
)
def test_async_equals_emulator_exact(schedule, P, m, optim, make_cfg, run_dist, dist_utils):
    _assert_async_equals_emulator(schedule, P, m, optim, True, make_cfg, run_dist, dist_utils)


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw", "muon"])
@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("mult", ["P-1", "P", "2P"])
def test_2bw_grid(P, mult, optim, make_cfg, run_dist, dist_utils):
    m = {"P-1": max(P - 1, 1), "P": P, "2P": 2 * P}[mult]
    _assert_async_equals_emulator("2bw", P, m, optim, True, make_cfg, run_dist, dist_utils)


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw", "muon"])
@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("steps_per_P", [2, 3])  # enough steps to reach P - s versions
def test_pipedream_grid(P, steps_per_P, optim, make_cfg, run_dist, dist_utils):
    # PipeDream updates per microbatch: m microbatches of the IR = m steps of one microbatch.
    _assert_async_equals_emulator(
        "pipedream", P, 1, optim, True, make_cfg, run_dist, dist_utils, steps=P * steps_per_P + 1
    )


@pytest.mark.parametrize("schedule", ["2bw", "1f1b"])
def test_sends_are_released_as_the_run_goes(schedule, make_cfg, run_dist):
    """gloo reports a send complete only once it is waited; the executor releases the sends
    every receiver has taken (at each STEP, `Comm.retire_sends`), so the sends a process holds
    do not grow with the steps. Before, a run held every activation and gradient it sent."""
    peaks = {}
    for steps in (4, 16):
        cfg = make_cfg(schedule, 2, 2, steps=steps, eval_every=steps)
        peaks[steps] = max(r["peak_sends"] for r in run_dist(cfg))
    assert 0 < peaks[16] == peaks[4] <= 4 * 2, peaks  # a few steps' worth of m = 2
