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

from stalepipe.lab.sim.timing import CostModel
from stalepipe.training.schedules.generators import make_schedule
from stalepipe.training.schedules.schedule import PipelineSchedule, dependencies, execution_order


@dataclass(frozen=True)
class Steady:
    """What one timing gives: the steady step and, per rank, its busy time per step and its gap
    (its first forward of the next step minus its last backward of this one: the window its
    update and its gradient traffic can use before it is late; `sim.parallel`'s hybrids)."""

    step_time: float
    busy: tuple[float, ...]
    gap: tuple[float, ...]


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
        R = sched.num_ranks
        # a dependency's transfer as an index into a flat R x R table plus a last 0 (same rank)
        self.links = [
            [(j, R * R if src < 0 else src * R + r) for j, src in deps]
            for r, deps in zip(self.ranks, self.deps)
        ]
        self.per_rank = [[0] * len(self.kinds) for _ in range(R)]  # actions of each kind a rank
        for r, k in zip(self.ranks, self.slots):
            self.per_rank[r][k] += 1
        # what the summary reads: every STEP's end, and the two last steps' backward ends and
        # forward starts per rank
        last = sched.num_steps - 2
        wanted = {("B", last), ("BW", last), ("F", last + 1)}
        self.marks = [
            (i, a.kind, a.step, r)
            for i, (r, a) in enumerate(zip(self.ranks, self.actions))
            if a.kind == "STEP" or (a.kind, a.step) in wanted
        ]

    def time(self, costs: CostModel) -> Steady:
        """The steady step under `costs` (as `timing.summarize` measures it: the median gap
        between step completions), with each rank's gap in the step before the last."""
        R, n = self.sched.num_ranks, self.sched.num_steps
        hop = [costs.transfer(a, b) for a in range(R) for b in range(R)] + [0.0]
        table = [_duration(costs, kind, stage) for kind, stage in self.kinds]
        end = [0.0] * len(self.actions)
        free = [0.0] * R
        for i, (r, k, links) in enumerate(zip(self.ranks, self.slots, self.links)):
            start = free[r]
            for j, h in links:
                t = end[j] + hop[h]
                if t > start:
                    start = t
            end[i] = free[r] = start + table[k]
        done = [0.0] * n
        last_back = [0.0] * R
        first_fwd = [math.inf] * R
        for i, kind, step, r in self.marks:
            if kind == "STEP":
                done[step] = max(done[step], end[i])
            elif kind == "F":
                first_fwd[r] = min(first_fwd[r], end[i] - table[self.slots[i]])
            else:
                last_back[r] = max(last_back[r], end[i])
        steps = [b - a for a, b in zip(done, done[1:])]
        gap = tuple(first_fwd[r] - last_back[r] for r in range(R))
        busy = tuple(sum(c * d for c, d in zip(self.per_rank[r], table)) / n for r in range(R))
        return Steady(statistics.median(steps), busy, gap)


def _duration(costs: CostModel, kind: str, stage: int) -> float:
    """`CostModel.duration` of an action of `kind` on `stage`."""
    bi, bw = costs.backward_input[stage], costs.backward_weight[stage]
    durations = {"F": costs.forward[stage], "B": bi + bw, "BI": bi, "BW": bw}
    return durations[kind] if kind != "STEP" else costs.optimizer[stage]


@functools.lru_cache(maxsize=1024)
def plan(schedule: str, num_ranks: int, num_microbatches: int, num_steps: int) -> Plan:
    """The `Plan` of a registered schedule (cached; ConfigError when it refuses the sizes)."""
    return Plan(make_schedule(schedule, num_ranks, num_microbatches, num_steps))
