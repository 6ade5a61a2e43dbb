"""Replay a measured pipeline run in the timing simulator, each action at its own measured time.

pipeline_throughput.py's "simulated" bubble gives every forward, backward and update of a rank
that rank's median time. The replay gives every action the wall time it took in the run (the
waits for a peer and the updates nested inside it taken out, the update of step k added to
STEP k) and lets the simulator order them by the schedule's dependencies. Where the replayed
bubble matches the measured one, the bubble above the median simulation is the spread of the
action times on this machine, which a pipeline without a flush has no idle time to absorb; where
the measured bubble is larger, the runtime spends time outside its actions (communication,
Python between actions).
"""

from __future__ import annotations

import dataclasses

from stalepipe.lab.sim.timing import CostModel, SimResult, simulate, summarize, uniform_costs
from stalepipe.training.schedules.generators import make_schedule
from stalepipe.training.schedules.schedule import Action


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Replayed(CostModel):
    """A cost model whose every action lasts what it lasted in the run (keys: Action.key)."""

    times: dict = dataclasses.field(default_factory=dict)
    step_offset: int = 0

    def duration(self, a: Action) -> float:
        kind, stage, step, microbatch = a.key
        return self.times[(kind, stage, step + self.step_offset, microbatch)]


def _net(a: float, b: float, inner: list[tuple[float, float, float]]) -> float:
    """The span [a, b] without the waits and updates nested in it."""
    return b - a - sum(min(y, b) - max(x, a) for x, y, _ in inner if x < b and y > a)


def action_times(report: dict, actions: tuple[Action, ...]) -> dict[tuple, float]:
    """Every action of one rank's report (a benchmark worker's spans and their keys) with its
    measured wall time, keyed like `Action.key`; `actions` is the rank's list. A process posts
    one update per step, at its last STEP of that step (`runtime.stage`): that STEP gets the
    measured time, the rank's other STEPs of the step (other chunks) none."""
    sp, keys = report["spans"], report["keys"]
    times: dict[tuple, float] = {}
    inner = sorted(sp["W"] + sp["A"])
    for (a, b, _), (stage, step, microbatch) in zip(sp["F"], keys["F"], strict=True):
        times[("F", stage, step, microbatch)] = _net(a, b, inner)
    for (a, b, _), (stage, step, microbatch, kind) in zip(sp["B"], keys["B"], strict=True):
        times[(kind, stage, step, microbatch)] = _net(a, b, inner)  # B or BI
    for (a, b, _), (stage, step, microbatch) in zip(sp["V"], keys["V"], strict=True):
        times[("BW", stage, step, microbatch)] = _net(a, b, inner)
    last_step = {}
    for a in actions:
        if a.kind == "STEP":
            times[a.key] = 0.0
            last_step[a.step] = a.key
    updates = [b - a for a, b, _ in sp["A"]]  # the i-th update applied is step i's
    for (a, b, _), (step,) in zip(sp["S"], keys["S"], strict=True):
        times[last_step[step]] = _net(a, b, inner) + updates[step]
    return times


def replayed_bubble(
    reports: list[dict], schedule: str, m: int, steps: int, warm: int, chunks: int = 1
) -> float:
    """The simulator's bubble of `schedule`'s timed steps (`warm` .. `steps` - 1), every action
    at its measured time in `reports` (one per rank, in rank order; `chunks` stages each)."""
    return replayed(reports, schedule, m, steps, warm, chunks).bubble


def replayed(
    reports: list[dict], schedule: str, m: int, steps: int, warm: int, chunks: int = 1
) -> SimResult:
    """The simulator's figures of the timed steps, every action at its measured time."""
    P = len(reports)
    full = make_schedule(schedule, P, m, steps, num_chunks=chunks)
    times: dict[tuple, float] = {}
    for rank, report in enumerate(reports):
        times |= action_times(report, full.ranks[rank])
    shape = uniform_costs(P * chunks)
    fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)}
    costs = _Replayed(**fields, times=times, step_offset=warm)
    sched = make_schedule(schedule, P, m, steps - warm, num_chunks=chunks)
    return summarize(simulate(sched, costs))
