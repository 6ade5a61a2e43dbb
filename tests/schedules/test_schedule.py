"""Schedule IR: every generator validates, versions follow the delay policy, memory figures
match the closed forms, the text form round-trips, and the validator catches corruption."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from stalepipe.config import PIPELINE_SCHEDULES, ConfigError, DelayConfig
from stalepipe.training.delay import DelaySchedule
from stalepipe.training.schedules.generators import make_schedule
from stalepipe.training.schedules.schedule import (
    Action,
    PipelineSchedule,
    ScheduleError,
    execution_order,
    peak_activations,
    peak_versions,
    validate,
    version_last_use,
)

GRID = [(P, m) for P in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 7, 8, 16)]
GOLDEN = Path(__file__).parent / "golden"


def build(name: str, P: int, m: int, N: int = 1, **kw) -> PipelineSchedule | None:
    """The schedule, or None where the generator refuses these sizes by design."""
    try:
        return make_schedule(name, P, m, N, **kw)
    except ConfigError:
        refusals = {"2bw": m < P - 1, "interleaved-1f1b": m % P != 0, "dualpipev": m < 2 * P}
        assert refusals.get(name), f"{name} refused P={P} m={m}"
        return None


@pytest.mark.parametrize("name", list(PIPELINE_SCHEDULES))
def test_every_generator_validates_on_a_grid(name):
    built = 0
    for P, m in GRID:
        for N in (1, 3):
            sched = build(name, P, m, N)
            if sched is None:
                continue
            validate(sched)
            built += 1
            assert len(execution_order(sched)) == sum(len(acts) for acts in sched.ranks)
    assert built >= 10


@pytest.mark.parametrize("name", list(PIPELINE_SCHEDULES))
def test_versions_come_from_the_delay_policy(name):
    sched = build(name, 4, 8, 5, sync_start=1, sync_cooldown=1)
    S, N = sched.num_stages, sched.num_steps
    for _, _, a in sched.actions():
        if a.kind == "STEP":
            assert (a.reads, a.makes) == (-1, a.step + 1)
        else:
            want = DelaySchedule.build(
                DelayConfig(policy=sched.policy, sync_start=1, sync_cooldown=1), S, N
            ).version(a.stage, a.step)
            assert (a.reads, a.makes) == (want, -1), a


def test_2bw_versions_trace():
    sched = make_schedule("2bw", 3, 4, 5)
    for _, _, a in sched.actions():
        if a.kind == "F":  # steps 0 and 1 both see W_0, then step k sees W_{k-1}
            assert a.reads == max(a.step - 1, 0)


def test_pipedream_is_one_update_per_microbatch_with_stage_staleness():
    P = 4
    sched = make_schedule("pipedream", P, 4, 3)
    assert (sched.num_steps, sched.num_microbatches) == (12, 1)
    for _, _, a in sched.actions():
        if a.kind == "F":
            assert a.reads == max(a.step - (P - 1 - a.stage), 0)
    assert peak_versions(sched) == [P - s for s in range(P)]


@pytest.mark.parametrize("P,m", [(2, 1), (4, 3), (4, 8), (8, 7), (8, 16)])
def test_2bw_keeps_two_versions_and_1f1b_stash(P, m):
    sched = make_schedule("2bw", P, m, 4)
    assert peak_versions(sched) == [2] * P
    assert peak_activations(sched) == [min(P - s, 4 * m) for s in range(P)]


@pytest.mark.parametrize("P,m", [(1, 1), (3, 2), (4, 8), (8, 4), (8, 16)])
def test_1f1b_stash_is_min_of_depth_and_microbatches(P, m):
    sched = make_schedule("1f1b", P, m, 2)
    assert peak_activations(sched) == [min(P - s, m) for s in range(P)]
    assert peak_versions(sched) == [1] * P
    assert peak_activations(make_schedule("gpipe", P, m)) == [m] * P


def test_zb_h1_stashes_no_more_than_1f1b_peak():
    for P, m in [(4, 8), (8, 16), (5, 3)]:
        assert max(peak_activations(make_schedule("zb-h1", P, m))) <= min(P, m)


def test_wpipe_groups_stale_and_fresh():
    sched = make_schedule("wpipe", 4, 4, 4)
    assert sched.num_stages == 8
    assert peak_versions(sched) == [2] * 4 + [1] * 4


def test_2bw_with_too_few_microbatches_is_refused():
    with pytest.raises(ConfigError, match=r"2bw needs --microbatches >= stages - 1 = 7 \(got 6\)"):
        make_schedule("2bw", 8, 6, 2)


def test_bad_sizes_and_names_are_refused():
    with pytest.raises(ConfigError, match="unknown schedule"):
        make_schedule("gpipe2", 2, 2)
    with pytest.raises(ConfigError, match="--microbatches must be >= 1"):
        make_schedule("1f1b", 2, 0)
    with pytest.raises(ConfigError, match="divisible"):
        make_schedule("interleaved-1f1b", 4, 6)


def test_sync_windows_flush_the_async_pipeline():
    sched = make_schedule("2bw", 4, 4, 8, sync_start=2, sync_cooldown=2)
    validate(sched)
    fwd = {(a.step, a.stage): a.reads for _, _, a in sched.actions() if a.kind == "F"}
    assert [fwd[(k, 0)] for k in range(8)] == [0, 1, 1, 2, 3, 4, 6, 7]


@pytest.mark.parametrize("name", list(PIPELINE_SCHEDULES))
def test_text_form_round_trips(name):
    sched = make_schedule(name, 4, 8, 2, sync_cooldown=1)
    text = sched.to_text()
    back = PipelineSchedule.from_text(text)
    assert back == sched and back.to_text() == text


def test_text_form_example():
    text = make_schedule("2bw", 2, 2, 2).to_text().splitlines()
    assert text[1] == (
        "rank 0: F0.0@v0 F0.1@v0 B0.0@v0 F1.0@v0 B0.1@v0 STEP0@v1 F1.1@v0 B1.0@v0 B1.1@v0 STEP1@v2"
    )


def test_bad_text_is_refused():
    text = make_schedule("1f1b", 2, 2).to_text()
    with pytest.raises(ScheduleError, match="bad action token 'X0.0@v0'"):
        PipelineSchedule.from_text(text.replace("F0.0@v0", "X0.0@v0", 1))
    with pytest.raises(ScheduleError, match="must start with"):
        PipelineSchedule.from_text("rank 0: F0.0@v0")


def _replace_rank(sched: PipelineSchedule, rank: int, acts: list[Action]) -> PipelineSchedule:
    ranks = list(sched.ranks)
    ranks[rank] = tuple(acts)
    return dataclasses.replace(sched, ranks=tuple(ranks), _index={})


def test_validator_catches_a_missing_backward():
    sched = make_schedule("1f1b", 3, 4)
    acts = [a for a in sched.ranks[1] if a.key != ("B", 1, 0, 2)]
    with pytest.raises(ScheduleError, match=r"microbatch 0.2 on stage 1 needs one B"):
        validate(_replace_rank(sched, 1, acts))


def test_validator_catches_a_dependency_violation():
    sched = make_schedule("1f1b", 3, 4)
    acts = list(sched.ranks[2])
    i = next(i for i, a in enumerate(acts) if a.key == ("B", 2, 0, 0))
    acts.insert(0, acts.pop(i))  # backward before its own forward
    with pytest.raises(ScheduleError, match=r"rank 2 at B0.0@v0:s2 waits for \('F', 2, 0, 0\)"):
        validate(_replace_rank(sched, 2, acts))


def test_validator_catches_a_cross_rank_deadlock():
    sched = make_schedule("gpipe", 2, 2)
    acts = list(sched.ranks[1])
    acts[0], acts[1] = acts[1], acts[0]  # F0.1 before F0.0 is fine ...
    validate(_replace_rank(sched, 1, acts))
    acts = [a for a in sched.ranks[0] if a.kind != "F"] + [
        a for a in sched.ranks[0] if a.kind == "F"
    ]
    with pytest.raises(ScheduleError, match="deadlock"):  # ... backwards first is not
        validate(_replace_rank(sched, 0, acts))


def test_validator_catches_wrong_versions_duplicates_and_misplaced_actions():
    sched = make_schedule("2bw", 2, 2, 3)
    acts = list(sched.ranks[0])
    stale = next(i for i, a in enumerate(acts) if a.kind == "F" and a.step == 2)
    bad = acts[:stale] + [dataclasses.replace(acts[stale], reads=0)] + acts[stale + 1 :]
    with pytest.raises(ScheduleError, match="reads version 0; policy '2bw' says 1"):
        validate(_replace_rank(sched, 0, bad))
    with pytest.raises(ScheduleError, match="appears twice"):
        validate(_replace_rank(sched, 0, acts + [acts[0]]))
    moved = acts + [Action("F", 1, 0, 0, reads=0)]
    with pytest.raises(ScheduleError, match="stage 1 lives on rank 1"):
        validate(_replace_rank(sched, 0, moved))


def test_validator_catches_a_version_used_before_it_exists():
    # 2bw where stage 0 runs step 2's first forward (needs W_1) before update 0 exists
    sched = make_schedule("2bw", 2, 1, 3)
    acts = list(sched.ranks[0])
    i = next(i for i, a in enumerate(acts) if a.key == ("F", 0, 2, 0))
    acts.insert(1, acts.pop(i))
    with pytest.raises(ScheduleError, match="waits for \\('STEP', 0, 0, -1\\)"):
        validate(_replace_rank(sched, 0, acts))


def test_version_last_use_points_at_the_last_user():
    sched = make_schedule("2bw", 2, 2, 3)
    last = version_last_use(sched)
    acts = sched.ranks[0]
    assert acts[last[(0, 0)]].key == ("B", 0, 1, 1)  # W_0 serves steps 0 and 1


GOLDEN_CASES = {
    "gpipe_p2_m2": ("gpipe", 2, 2, 1),
    "1f1b_p3_m4": ("1f1b", 3, 4, 1),
    "2bw_p2_m2_n2": ("2bw", 2, 2, 2),
    "zb-h1_p3_m3": ("zb-h1", 3, 3, 1),
    "interleaved-1f1b_p2_m2": ("interleaved-1f1b", 2, 2, 1),
    "zb-v_p2_m2": ("zb-v", 2, 2, 1),  # checked by hand against torch's ScheduleZBVZeroBubble
    "dualpipev_p2_m4": ("dualpipev", 2, 4, 1),  # and against deepseek-ai/DualPipe's dualpipev
}


@pytest.mark.parametrize("case", list(GOLDEN_CASES))
def test_golden_csv(case):
    """Small schedules pinned as CSV: regenerate with STALEPIPE_REGEN_GOLDEN=1 after an
    intended change, and review the diff."""
    name, P, m, N = GOLDEN_CASES[case]
    got = make_schedule(name, P, m, N).to_csv()
    path = GOLDEN / f"{case}.csv"
    if os.environ.get("STALEPIPE_REGEN_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(got)
    assert got == path.read_text()
