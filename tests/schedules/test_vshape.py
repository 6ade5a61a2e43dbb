"""V placement, ZB-V and DualPipeV, and the papers' bubble and memory formulas on uniform costs.

Uniform costs throughout: a rank's share of the model costs F = BI = BW = 1 per microbatch
(unless a test says otherwise), so a stage of a two-chunk rank costs 1/2 of each; updates and
messages are free. Memory in units: a rank's share of the weights = 1, one microbatch's stash
on it = 1 (a chunk's is 1/2).
"""

from __future__ import annotations

import dataclasses

import pytest

from stalepipe.config import PIPELINE_SCHEDULES, ConfigError, PipelineConfig
from stalepipe.lab.sim.memory import rank_memory
from stalepipe.lab.sim.timing import SimResult, simulate, summarize, uniform_costs
from stalepipe.training.schedules.generators import make_schedule
from stalepipe.training.schedules.schedule import (
    Action,
    PipelineSchedule,
    ScheduleError,
    stage_rank,
    validate,
)

SIZES = [(2, 4), (3, 6), (4, 8), (4, 13), (8, 16), (8, 32)]  # (R, m) with m >= 2R


def run(name: str, R: int, m: int, N: int = 1, f: float = 1, bi: float = 1, bw: float = 1):
    """Simulate `name` on R ranks; f, bi, bw are one rank's share (split over its chunks)."""
    sched = make_schedule(name, R, m, N)
    v = sched.num_chunks
    costs = uniform_costs(sched.num_stages, f / v, bi / v, bw / v, weight=1 / v, activation=1 / v)
    return sched, summarize(simulate(sched, costs))


def idle_per_rank(r: SimResult) -> float:
    """Mean idle time of a rank over the run: bubble x makespan."""
    return r.bubble * r.makespan


# ---- the placement -------------------------------------------------------------------------


def test_v_placement_maps_stages_down_and_back_up():
    assert [stage_rank("v", s, 4) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_rank("interleaved", s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [stage_rank("v", s, 2) for s in range(6)] == [0, 1, 1, 0, 0, 1]  # zig-zag on
    sched = make_schedule("zb-v", 4, 8)
    assert sched.placement == "v" and sched.num_stages == 8
    assert [sched.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [sched.chunk_of(s) for s in (0, 7, 3, 4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_text_form_keeps_the_placement(name):
    sched = make_schedule(name, 3, 6, 2)
    text = sched.to_text()
    assert "placement=v" in text.splitlines()[0]
    assert PipelineSchedule.from_text(text) == sched
    old = make_schedule("interleaved-1f1b", 2, 2).to_text().replace(" placement=interleaved", "")
    # headers from before placement
    assert PipelineSchedule.from_text(old).placement == "interleaved"
    with pytest.raises(ScheduleError, match="placement must be one of interleaved, v"):
        PipelineSchedule.from_text(text.replace("placement=v", "placement=w"))


def test_validator_checks_ranks_under_the_v_placement():
    sched = make_schedule("zb-v", 2, 4)
    ranks = [list(acts) for acts in sched.ranks]
    ranks[1].append(Action("F", 3, 0, 0, reads=0))  # stage 3 lives on rank 0 in a V
    bad = dataclasses.replace(sched, ranks=tuple(map(tuple, ranks)), _index={})
    with pytest.raises(ScheduleError, match="stage 3 lives on rank 0"):
        validate(bad)
    interleaved = dataclasses.replace(sched, placement="interleaved", _index={})
    with pytest.raises(ScheduleError, match="lives on rank"):  # same lists, other placement
        validate(interleaved)


def test_registry_and_the_runtime_refusal():
    assert all(spec.runtime for _, spec in PIPELINE_SCHEDULES.items())  # it runs every one
    for name in PIPELINE_SCHEDULES:
        PipelineConfig(schedule=name, num_stages=4, num_chunks=PIPELINE_SCHEDULES[name].chunks or 2)
    for name in ("zb-v", "dualpipev"):  # two stages per process, placed in a V
        assert PipelineConfig(schedule=name, num_stages=4, num_chunks=2).placement == "v"
        with pytest.raises(ConfigError, match="in a V .*: set pipeline.num_chunks 2$"):
            PipelineConfig(schedule=name, num_stages=4)
    for spelled, meant in (("zbv", "zb-v"), ("dualpipe-v", "dualpipev"), ("1f1c", "1f1b")):
        with pytest.raises(ConfigError, match=f"did you mean '{meant}'"):
            PipelineConfig(schedule=spelled)


def test_dualpipev_needs_two_microbatches_per_stage():
    with pytest.raises(ConfigError, match=r"dualpipev needs --microbatches >= 2 x stages = 8"):
        make_schedule("dualpipev", 4, 7)


# ---- bubbles: the papers' formulas -----------------------------------------------------------


@pytest.mark.parametrize("P,m", [(2, 4), (4, 8), (4, 13), (8, 16)])
def test_1f1b_and_zb_h1_idle_time(P, m):
    # per-rank idle (P-1)(F+B) for 1F1B and (P-1)(F+B-2W) for ZB-H1 (Qi et al., section 2):
    # with F = BI = BW = 1 that is 3(P-1) and (P-1), a third
    assert idle_per_rank(run("1f1b", P, m)[1]) == pytest.approx(3 * (P - 1))
    assert idle_per_rank(run("zb-h1", P, m)[1]) == pytest.approx(P - 1)
    assert run("1f1b", P, m)[1].bubble == pytest.approx((P - 1) / (m + P - 1))


@pytest.mark.parametrize("R,m", SIZES)
def test_zb_v_is_zero_bubble_in_the_steady_state(R, m):
    # Qi et al. section 6: with F = BI = BW ZB-V has no bubble (steps tile without a gap);
    # one step alone pays only the fill, (R-1) chunk forwards of idle per rank
    _, one = run("zb-v", R, m)
    assert idle_per_rank(one) == pytest.approx((R - 1) * 0.5)
    _, many = run("zb-v", R, m, N=4)
    assert many.steady_bubble == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("R,m", SIZES)
@pytest.mark.parametrize("f,bi,bw", [(1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 1), (1, 1.5, 0.5)])
def test_dualpipev_bubble_within_the_table(R, m, f, bi, bw):
    # DualPipe table: bubble (PP/2-1)(F&B + B - 3W), PP = 2R stages, F/B/W one chunk's
    # forward, full backward and weight backward. Here a pair F&B is the forward then the
    # backward (F&B = F + B), and a rank may start the forward while the backward waits, so
    # the simulated idle is at most the table's; with F = BI = BW it is the fill alone.
    _, r = run("dualpipev", R, m, f=f, bi=bi, bw=bw)
    F, B, W = f / 2, (bi + bw) / 2, bw / 2
    assert idle_per_rank(r) <= (R - 1) * ((F + B) + B - 3 * W) + 1e-9
    if f == bi == bw:
        assert idle_per_rank(r) == pytest.approx((R - 1) * F)


# ---- memory: the papers' formulas ------------------------------------------------------------


@pytest.mark.parametrize("R,m", SIZES)
def test_peak_memory_per_rank(R, m):
    # activations in units of one microbatch on one rank's share; weights in shares
    def mem(name: str) -> tuple:
        return summarize(simulate(*_sched_costs(name, R, m))).rank_memory

    one = mem("1f1b")
    assert [x.activations for x in one] == [R - r for r in range(R)]  # P on rank 0
    assert all(x.activations == R for x in mem("zb-h1"))  # ZB-H1: 1F1B's peak on every rank
    # ZB-V: 1F1B's peak, P microbatches (2P chunk-microbatches), on every rank
    assert all((x.activations, x.stashed) == (R, 2 * R) for x in mem("zb-v"))
    # DualPipeV: PP + 1 = 2R + 1 chunk-microbatches, parameters 1x (two of the 2R stages)
    assert all((x.stashed, x.weights) == (2 * R + 1, 1.0) for x in mem("dualpipev"))
    assert all(x.weights == 1.0 for x in one + mem("zb-v"))
    assert all(x.weights == 2.0 for x in mem("2bw"))  # the stashed second version
    assert [x.weights for x in mem("pipedream")] == [R - r for r in range(R)]  # P - s versions


@pytest.mark.parametrize("P", [2, 4, 8])
def test_interleaved_peak_is_megatrons(P):
    # Narayanan et al. SC'21: rank 0 of interleaved 1F1B stashes P (1 + (P-1)/(P v))
    sched, costs = _sched_costs("interleaved-1f1b", P, 2 * P)
    top = summarize(simulate(sched, costs)).rank_memory[0].activations
    assert top == pytest.approx(P * (1 + (P - 1) / (P * 2)))


def _sched_costs(name: str, R: int, m: int):
    sched = make_schedule(name, R, m, 3)
    v = sched.num_chunks
    return sched, uniform_costs(sched.num_stages, weight=1 / v, activation=1 / v)


def test_rank_memory_peak_of_the_sum_is_not_the_sum_of_peaks():
    sched, costs = _sched_costs("zb-v", 4, 8)
    mem = rank_memory(sched, costs.weight_bytes, costs.state_bytes, costs.activation_bytes)
    assert all(x.total == x.weights + x.activations for x in mem)  # weights are constant here
    # per-stage peaks add up to more than the rank ever holds: the two chunks peak apart
    per_stage = {s: 0 for s in range(8)}
    for s in range(8):
        live = 0
        for a in (a for acts in sched.ranks for a in acts if a.stage == s and a.step == 0):
            live += (a.kind == "F") - (a.kind == "BW")
            per_stage[s] = max(per_stage[s], live)
    assert per_stage[0] + per_stage[7] == 2 * 4 + 1 > mem[0].stashed == 8
