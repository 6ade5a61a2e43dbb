"""The steady step of a schedule, fast, for sweeps that time one schedule under many cost
models (the verdict's map times each pipeline at every inter-node bandwidth).

`timing.simulate` is the reference: it derives the execution order and every action's
dependencies for each call. Both depend on the schedule alone ("any order that runs each
action after its dependencies gives the same times"), so `Plan` computes them once, as integer
indices, and `Plan.time` only adds durations and transfers; `tests/sim/test_cluster.py` checks
that the two give the same step times.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

from stalepipe.schedules.generators import make_schedule
from stalepipe.schedules.schedule import PipelineSchedule, dependencies, execution_order
from stalepipe.sim.timing import CostModel


@dataclass(frozen=True)
class Steady:
    """What one timing gives: the steady step and, per rank, its drain (the step's end minus
    the rank's last backward of that step), its gap (its first forward of the next step minus
    that last backward: the window its update and its gradient traffic can use before it is
    late) and busy time per step."""

    step_time: float
    drain: tuple[float, ...]
    busy: tuple[float, ...]
    gap: tuple[float, ...] = ()


class Plan:
    """A schedule's execution order with each action's dependencies as indices into it."""

    def __init__(self, sched: PipelineSchedule) -> None:
        self.sched = sched
        order = execution_order(sched)
        index = {a.key: i for i, (_, a) in enumerate(order)}
        self.ranks = [r for r, _ in order]
        self.actions = [a for _, a in order]
        self.deps = [
            [
                (index[key], -1 if msg is None else sched.rank_of(key[1]))
                for key, msg in dependencies(sched, a)
            ]
            for _, a in order
        ]
        # each action's duration depends on its kind and stage alone: one of a few per call
        self.kinds = sorted({(a.kind, a.stage) for a in self.actions})
        slot = {k: i for i, k in enumerate(self.kinds)}
        self.slots = [slot[a.kind, a.stage] for a in self.actions]

    def time(self, costs: CostModel) -> Steady:
        """The steady step under `costs` (as `timing.summarize` measures it: the median gap
        between step completions), with each rank's drain in the step before the last."""
        R, n = self.sched.num_ranks, self.sched.num_steps
        hop = [[costs.transfer(a, b) for b in range(R)] for a in range(R)]
        table = [_duration(costs, kind, stage) for kind, stage in self.kinds]
        durations = [table[i] for i in self.slots]
        end = [0.0] * len(self.actions)
        free = [0.0] * R
        busy = [0.0] * R
        for i, (r, d, deps) in enumerate(zip(self.ranks, durations, self.deps)):
            start = free[r]
            for j, src in deps:
                t = end[j] if src < 0 else end[j] + hop[src][r]
                start = t if t > start else start
            end[i] = free[r] = start + d
            busy[r] += d
        done = [0.0] * n
        last_back = [[0.0] * R for _ in range(n)]
        first_fwd = [[math.inf] * R for _ in range(n)]
        for r, a, e, d in zip(self.ranks, self.actions, end, durations):
            if a.kind == "STEP":
                done[a.step] = max(done[a.step], e)
            elif a.kind in ("B", "BW"):
                last_back[a.step][r] = max(last_back[a.step][r], e)
            elif a.kind == "F":
                first_fwd[a.step][r] = min(first_fwd[a.step][r], e - d)
        steps = [b - a for a, b in zip(done, done[1:])]
        k = n - 2
        drain = tuple(done[k] - last_back[k][r] for r in range(R))
        gap = tuple(first_fwd[k + 1][r] - last_back[k][r] for r in range(R))
        return Steady(statistics.median(steps), drain, tuple(b / n for b in busy), gap)


def _duration(costs: CostModel, kind: str, stage: int) -> float:
    """`CostModel.duration` of an action of `kind` on `stage`."""
    bi, bw = costs.backward_input[stage], costs.backward_weight[stage]
    return {"F": costs.forward[stage], "B": bi + bw, "BI": bi, "BW": bw, "STEP": 0.0}[kind] or (
        costs.optimizer[stage] if kind == "STEP" else 0.0
    )


@functools.lru_cache(maxsize=1024)
def plan(schedule: str, num_ranks: int, num_microbatches: int, num_steps: int) -> Plan:
    """The `Plan` of a registered schedule (cached; ConfigError when it refuses the sizes)."""
    return Plan(make_schedule(schedule, num_ranks, num_microbatches, num_steps))
