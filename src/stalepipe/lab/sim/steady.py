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
from typing import Any

from stalepipe.config import ConfigError
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
        self.held = tuple(tuple(sched.stages_of(r)) for r in range(R))  # each rank's stages
        # a dependency's transfer as an index into a flat R x R table plus a last 0 (same rank)
        self.links = [
            [(j, R * R if src < 0 else src * R + r) for j, src in deps]
            for r, deps in zip(self.ranks, self.deps)
        ]
        self.walk = self._walk()
        # the transfers `time` needs (the table's other entries are never read)
        self.hops = sorted({(h // R, h % R) for links in self.links for _, h in links if h < R * R})
        self.per_rank = [[0] * len(self.kinds) for _ in range(R)]  # actions of each kind a rank
        for r, k in zip(self.ranks, self.slots):
            self.per_rank[r][k] += 1
        # per rank (kind slot, count) of the kinds it runs: the others add 0 x a finite duration
        self.busy = [[(k, c) for k, c in enumerate(row) if c] for row in self.per_rank]
        # what the summary reads (as 1 + index, `time`'s `end`): every STEP's end (with its
        # step), and per rank the last step's forward starts (with their kind slot) and the
        # step before's backward ends
        last = sched.num_steps - 2
        marked = list(enumerate(zip(self.ranks, self.actions), 1))
        self.step_marks = [(i, a.step) for i, (_, a) in marked if a.kind == "STEP"]
        self.fwd_marks = [
            (i, r, self.slots[i - 1]) for i, (r, a) in marked if (a.kind, a.step) == ("F", last + 1)
        ]
        self.back_marks = [
            (i, r) for i, (r, a) in marked if a.kind in ("B", "BW") and a.step == last
        ]

    def _walk(self) -> list[tuple[int, int, int, Any]]:
        """What `time` walks, per action as 1 + an index into the order (0: none): the rank's
        previous action, the kind slot, the one dependency across ranks and its transfer (-1:
        several, the transfer then their list of (1 + index, transfer)). One on the rank's own
        earlier action never delays it: the rank runs its list in order, so it is free only
        once that action has ended (durations are >= 0), and the transfer to itself is 0;
        leaving those out gives the same times, faster."""
        out: list[tuple[int, int, int, Any]] = []
        previous: dict[int, int] = {}
        for i, (r, k, links) in enumerate(zip(self.ranks, self.slots, self.links), 1):
            across = tuple((j + 1, h) for j, h in links if self.ranks[j] != r)
            prev = previous.get(r, 0)
            if len(across) > 1:
                out.append((prev, k, -1, across))
            else:
                out.append((prev, k, *(across[0] if across else (0, 0))))
            previous[r] = i
        return out

    def time(self, costs: CostModel) -> Steady:
        """The steady step under `costs` (as `timing.summarize` measures it: the median gap
        between step completions), with each rank's gap in the step before the last."""
        R, n = self.sched.num_ranks, self.sched.num_steps
        hop = [0.0] * (R * R + 1)
        for a, b in self.hops:
            hop[a * R + b] = costs.transfer(a, b)
        table = [_duration(costs, kind, stage) for kind, stage in self.kinds]
        end = [0.0]  # each action's end, after a 0 for "none"
        add = end.append
        for prev, k, j, h in self.walk:
            start = end[prev]  # its rank is free
            if j > 0:
                t = end[j] + hop[h]
                if t > start:
                    start = t
            elif j < 0:
                for i, g in h:
                    t = end[i] + hop[g]
                    if t > start:
                        start = t
            add(start + table[k])
        done = [0.0] * n
        for i, step in self.step_marks:
            if end[i] > done[step]:
                done[step] = end[i]
        first_fwd = [math.inf] * R
        for i, r, k in self.fwd_marks:
            t = end[i] - table[k]
            if t < first_fwd[r]:
                first_fwd[r] = t
        last_back = [0.0] * R
        for i, r in self.back_marks:
            if end[i] > last_back[r]:
                last_back[r] = end[i]
        steps = [b - a for a, b in zip(done, done[1:])]
        gap = tuple(first_fwd[r] - last_back[r] for r in range(R))
        busy = tuple(sum(c * table[k] for k, c in kinds) / n for kinds in self.busy)
        return Steady(statistics.median(steps), busy, gap)


def _duration(costs: CostModel, kind: str, stage: int) -> float:
    """`CostModel.duration` of an action of `kind` on `stage`."""
    if kind == "F":
        return costs.forward[stage]
    if kind == "STEP":
        return costs.optimizer[stage]
    if kind == "B":
        return costs.backward_input[stage] + costs.backward_weight[stage]
    return {"BI": costs.backward_input, "BW": costs.backward_weight}[kind][stage]


def plan(schedule: str, num_ranks: int, num_microbatches: int, num_steps: int) -> Plan:
    """The `Plan` of a registered schedule (cached; ConfigError when it refuses the sizes)."""
    p = _plan(schedule, num_ranks, num_microbatches, num_steps)
    if isinstance(p, ConfigError):
        raise type(p)(*p.args)
    return p


@functools.lru_cache(maxsize=4096)
def _plan(
    schedule: str, num_ranks: int, num_microbatches: int, num_steps: int
) -> Plan | ConfigError:
    """`plan`, its refusal kept too: the cluster model asks every schedule for sizes it refuses
    (the V schedules' m >= 2P) once per configuration, and building the schedule to refuse it
    cost a twentieth of the verdict's map."""
    try:
        return Plan(make_schedule(schedule, num_ranks, num_microbatches, num_steps))
    except ConfigError as e:
        return e.with_traceback(None)
