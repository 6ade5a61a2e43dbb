"""Per-rank memory of a schedule, from each rank's action order alone (no timing needed).

A rank runs its list in order, so what it holds changes only at its own actions and the peak
over its list is the peak in time (the transient inside one action is not modelled). After
each action a rank holds, for every stage it owns:

- weights: every weight version alive (a version lives from the STEP that makes it, version 0
  from the start, until both its last use and the next version exist: `peak_versions`' rule),
  times one version's size, plus the stage's `state` (gradient accumulator and optimizer
  state: one copy, whatever the versions);
- activations: every microbatch forwarded and not yet fully backwarded (a split backward frees
  at BW: the weight gradient still reads the stash), times one microbatch's stash.

Sizes come per stage from the cost model: bytes for `timing.analytic_costs` (see there what is
counted), "units" for `timing.uniform_costs` (one rank's share of the weights = 1, one
microbatch's activations on one rank's share = 1; a stage of a rank with v chunks is 1/v).
"""

from __future__ import annotations

from dataclasses import dataclass

from stalepipe.schedules.schedule import PipelineSchedule


@dataclass(frozen=True)
class RankMemory:
    """Peaks over one rank's list, in the cost model's memory unit."""

    weights: float  # live weight versions x version size + optimizer state, at its peak
    activations: float  # stashed microbatches x stash size, at its peak
    total: float  # peak of the sum (<= weights + activations: the peaks may not coincide)
    stashed: int  # most microbatch stashes held at once, over all the rank's stages


def _version_deltas(sched: PipelineSchedule, rank: int, stage: int) -> dict[int, int]:
    """Position in `rank`'s list -> change in `stage`'s live version count after that action
    (position -1: before the first action)."""
    acts = sched.ranks[rank]
    born: dict[int, int] = {0: -1}
    last: dict[int, int] = {}
    for i, a in enumerate(acts):
        if a.stage != stage:
            continue
        if a.kind == "STEP":
            born[a.makes] = i
        else:
            last[a.reads] = i
    delta: dict[int, int] = {}
    for v, b in born.items():
        # alive on positions [b, end): until its last use is done and the next version exists
        end = max(last.get(v, b) + 1, born.get(v + 1, len(acts) + 1))
        delta[b] = delta.get(b, 0) + 1
        delta[end] = delta.get(end, 0) - 1
    return delta


def memory_trace(
    sched: PipelineSchedule,
    rank: int,
    weight: tuple[float, ...],
    state: tuple[float, ...],
    activation: tuple[float, ...],
) -> list[tuple[float, float, int]]:
    """(weights, activations, stashed microbatches) held by `rank` after each action of its
    list, with per-stage sizes of one weight version, the optimizer state and one stash."""
    stages = sched.stages_of(rank)
    deltas = {s: _version_deltas(sched, rank, s) for s in stages}
    versions = {s: deltas[s].get(-1, 0) for s in stages}
    w = sum(versions[s] * weight[s] + state[s] for s in stages)
    act, stashed, out = 0.0, 0, []
    for i, a in enumerate(sched.ranks[rank]):
        for s in stages:
            d = deltas[s].get(i, 0)
            versions[s] += d
            w += d * weight[s]
        if a.kind == "F":
            act, stashed = act + activation[a.stage], stashed + 1
        elif a.kind in ("B", "BW"):
            act, stashed = act - activation[a.stage], stashed - 1
        out.append((w, act, stashed))
    return out


def rank_memory(
    sched: PipelineSchedule,
    weight: tuple[float, ...],
    state: tuple[float, ...],
    activation: tuple[float, ...],
) -> tuple[RankMemory, ...]:
    """Per rank, the peaks of `memory_trace` (sizes per stage, as there)."""
    out = []
    for r in range(sched.num_ranks):
        stages = sched.stages_of(r)
        start = sum(weight[s] + state[s] for s in stages)
        trace = memory_trace(sched, r, weight, state, activation) or [(start, 0.0, 0)]
        out.append(
            RankMemory(
                weights=max(start, max(t[0] for t in trace)),
                activations=max(t[1] for t in trace),
                total=max(start, max(t[0] + t[1] for t in trace)),
                stashed=max(t[2] for t in trace),
            )
        )
    return tuple(out)
