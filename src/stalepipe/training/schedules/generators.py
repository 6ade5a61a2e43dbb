"""Schedule generators: (delay schedule, num_microbatches) -> `PipelineSchedule`.

GPipe, 1F1B (PipeDream-Flush), interleaved 1F1B, ZB-H1, PipeDream-2BW, PipeDream (weight
stashing) and WPipe here, ZB-V and DualPipeV in `vshape`; each is registered below with its
facts (`config.registry.ScheduleSpec`: the delay policy it realises, its stages per process), the
one list of pipeline schedules, which the config validates against. `make_schedule` builds one
by name. The IR, the validator and the schedule analyses live in `schedules.schedule`; see its
docstring for the vocabulary. Torch-free: the package root imports this module (registry).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterator

from stalepipe.config import ConfigError, DelayConfig
from stalepipe.config.registry import PIPELINE_SCHEDULES, ScheduleSpec
from stalepipe.training.delay.policies import DelaySchedule, never_delays
from stalepipe.training.schedules.build import Op, build_schedule, check_sizes
from stalepipe.training.schedules.schedule import Action, Key, PipelineSchedule
from stalepipe.training.schedules.vshape import dualpipev, zb_v


def _stream(stage: int, items: list[tuple[int, int]], warmup: int, m: int) -> list[Op]:
    """1F1B over a stream of (step, microbatch) items on one stage: `warmup` forwards, then
    alternate one forward and one backward, then drain; STEP k right after step k's last
    backward. Over one step this is PipeDream-Flush; over many it is the no-flush pipeline."""
    w = min(warmup, len(items))
    ops: list[Op] = [("F", stage, k, j) for k, j in items[:w]]

    def backward(k: int, j: int) -> None:
        ops.append(("B", stage, k, j))
        if j == m - 1:
            ops.append(("STEP", stage, k, -1))

    for i in range(len(items) - w):
        ops.append(("F", stage, *items[w + i]))
        backward(*items[i])
    for it in items[len(items) - w :]:
        backward(*it)
    return ops


def _segments(delay: DelaySchedule) -> list[list[int]]:
    """Runs of steps pipelined without a flush. A flush goes before step k when some stage must
    see fresher weights than the no-flush pipeline gives (sync start / cooldown windows)."""
    segs: list[list[int]] = []
    for k in range(delay.total_steps):
        fresher = any(t < top for t, top in zip(delay.taus(k), delay.max_tau, strict=True))
        if not segs or fresher:
            segs.append([])
        segs[-1].append(k)
    return segs


def gpipe(delay: DelaySchedule, num_microbatches: int, **_: object) -> PipelineSchedule:
    """GPipe (Huang et al. 2019): all m forwards, then all m backwards, then the update; a full
    flush every step. Stashes m microbatches per stage."""
    num_ranks = check_sizes(delay, num_microbatches)
    m, num_steps, orders = num_microbatches, delay.total_steps, []
    for s in range(num_ranks):
        ops: list[Op] = []
        for k in range(num_steps):
            ops += [("F", s, k, j) for j in range(m)] + [("B", s, k, j) for j in range(m)]
            ops.append(("STEP", s, k, -1))
        orders.append(ops)
    return build_schedule("gpipe", delay, 1, m, orders)


def one_f_one_b(delay: DelaySchedule, num_microbatches: int, **_: object) -> PipelineSchedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021): stage s runs min(P-s-1, m) warm-up
    forwards, then one forward / one backward; flush and update every step. Same bubble as
    GPipe, stash min(P-s, m)."""
    P, m = check_sizes(delay, num_microbatches), num_microbatches
    orders = [
        [
            op
            for k in range(delay.total_steps)
            for op in _stream(s, [(k, j) for j in range(m)], P - s - 1, m)
        ]
        for s in range(P)
    ]
    return build_schedule("1f1b", delay, 1, m, orders)


def interleaved_1f1b(
    delay: DelaySchedule, num_microbatches: int, *, num_chunks: int = 2, **_: object
) -> PipelineSchedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. SC'21): each rank holds `num_chunks`
    stages (rank r: stages r, r+R, ...); microbatches go through in groups of R, so the
    bubble shrinks by the number of chunks. Needs m divisible by R (as in Megatron)."""
    R, v, m = check_sizes(delay, num_microbatches, num_chunks), num_chunks, num_microbatches
    num_steps = delay.total_steps
    if m % R:
        raise ConfigError(
            f"interleaved-1f1b needs --microbatches divisible by --stages ({m} % {R} != 0)"
        )
    total = m * v
    orders = []
    for r in range(R):

        def item(i: int, backward: bool, r: int = r) -> tuple[int, int]:
            # Megatron's order: microbatches in groups of R, chunk by chunk (reversed backward)
            chunk = (i // R) % v
            return (v - 1 - chunk if backward else chunk) * R + r, (i // (R * v)) * R + i % R

        warmup = min((R - r - 1) * 2 + (v - 1) * R, total)
        ops: list[Op] = []
        for k in range(num_steps):
            seq: list[tuple[str, int, int]] = [("F", *item(i, False)) for i in range(warmup)]
            for i in range(total - warmup):
                seq += [("F", *item(warmup + i, False)), ("B", *item(i, True))]
            seq += [("B", *item(i, True)) for i in range(total - warmup, total)]
            for kind, s, j in seq:
                ops.append((kind, s, k, j))
                if kind == "B" and j == m - 1:  # last microbatch of this stage: update
                    ops.append(("STEP", s, k, -1))
        orders.append(ops)
    return build_schedule("interleaved-1f1b", delay, v, m, orders)


def two_bw(delay: DelaySchedule, num_microbatches: int, **_: object) -> PipelineSchedule:
    """PipeDream-2BW (Narayanan et al. ICML'21): 1F1B over all N*m microbatches without a
    flush; step k uses version k-1 (double-buffered weights). Needs m >= P-1, else the version
    a forward needs is not yet created. Sync start/cooldown steps get a flush before them."""
    P, m = check_sizes(delay, num_microbatches), num_microbatches
    if m < P - 1:
        raise ConfigError(
            f"2bw needs --microbatches >= stages - 1 = {P - 1} (got {m}): with fewer, a forward "
            f"would need weights not yet updated; raise --microbatches or use fewer --stages"
        )
    segs = _segments(delay)
    orders = [
        [
            op
            for seg in segs
            for op in _stream(s, [(k, j) for k in seg for j in range(m)], P - s - 1, m)
        ]
        for s in range(P)
    ]
    return build_schedule("2bw", delay, 1, m, orders)


def pipedream(delay: DelaySchedule, num_microbatches: int, **_: object) -> PipelineSchedule:
    """PipeDream (Narayanan et al. SOSP'19): weight stashing, one update per microbatch-sized
    minibatch. The N*m microbatches become N*m steps of one microbatch (so the returned
    schedule has num_steps = N*m, num_microbatches = 1); stage s keeps P-s versions and has
    staleness P-1-s. Sync windows count in these minibatch steps."""
    P = check_sizes(delay, num_microbatches)
    delay = delay.with_total_steps(delay.total_steps * num_microbatches)
    segs = _segments(delay)
    orders = [
        [op for seg in segs for op in _stream(s, [(k, 0) for k in seg], P - s - 1, 1)]
        for s in range(P)
    ]
    return build_schedule("pipedream", delay, 1, 1, orders)


def _list_schedule(
    name: str,
    delay: DelaySchedule,
    v: int,
    m: int,
    *,
    split: bool,
    priority: Callable[[Op], tuple],
) -> PipelineSchedule:
    """Greedy list scheduling on unit costs (F = 1, B = 2, BI = BW = 1, STEP = 0): whenever a
    rank is idle it starts its ready action of best `priority`. The resulting order is the
    schedule. Per stage, each kind runs in (step, microbatch) order."""
    S, N = delay.num_stages, delay.total_steps
    R = S // v
    cost = {"F": 1.0, "B": 2.0, "BI": 1.0, "BW": 1.0, "STEP": 0.0}
    bk, final = ("BI", "BW") if split else ("B", "B")
    items = [(k, j) for k in range(N) for j in range(m)]
    fq = {s: deque(items) for s in range(S)}
    bq = {s: deque(items) for s in range(S)}
    wq = {s: deque(items if split else []) for s in range(S)}
    sq = {s: deque(range(N)) for s in range(S)}
    queue = {"F": fq, bk: bq, "BW": wq, "STEP": sq}
    end: dict[Key, float] = {}
    free = [0.0] * R
    orders: list[list[Op]] = [[] for _ in range(R)]

    def ok(key: Key, t: float) -> bool:
        e = end.get(key)
        return e is not None and e <= t

    def candidates(r: int, t: float) -> Iterator[Op]:
        for s in range(r, S, R):
            if sq[s]:
                k = sq[s][0]
                if all(ok((final, s, k, j), t) for j in range(m)):
                    yield ("STEP", s, k, -1)
            if bq[s]:
                k, j = bq[s][0]
                if ok(("F", s, k, j), t) and (s == S - 1 or ok((bk, s + 1, k, j), t)):
                    yield (bk, s, k, j)
            if wq[s] and ok(("BI", s, *wq[s][0]), t):
                yield ("BW", s, *wq[s][0])
            if fq[s]:
                k, j = fq[s][0]
                vv = delay.version(s, k)
                if (s == 0 or ok(("F", s - 1, k, j), t)) and (
                    vv == 0 or ok(("STEP", s, vv - 1, -1), t)
                ):
                    yield ("F", s, k, j)

    t, remaining = 0.0, S * (N * m * (3 if split else 2) + N)
    while remaining:
        progressed = False
        for r in range(R):
            if free[r] > t:
                continue
            best = min(candidates(r, t), key=priority, default=None)
            if best is None:
                continue
            kind, s = best[0], best[1]
            queue[kind][s].popleft()
            end[best] = free[r] = t + cost[kind]
            orders[r].append(best)
            remaining -= 1
            progressed = True
        if not progressed:
            later = [f for f in free if f > t]
            assert later, f"{name}: list scheduler stuck at t={t}"
            t = min(later)
    return build_schedule(name, delay, v, m, orders)


def zb_h1(delay: DelaySchedule, num_microbatches: int, **_: object) -> PipelineSchedule:
    """ZB-H1 (Qi et al. ICLR'24, "Zero Bubble Pipeline Parallelism"): the backward is split into
    BI (input grad, on the critical path) and BW (weight grad, deferrable). Rank i runs 1F1B's
    P-i-1 warm-up forwards, then F, BI and the BW of the microbatch i places back, so its
    deferred BWs fill the drain; every rank stashes at most P microbatches, 1F1B's peak. With
    F = BI = BW the bubble is (P-1)(F+BI-BW) instead of 1F1B's (P-1)(F+BI+BW). Synchronous:
    flush and update every step."""
    P, m = check_sizes(delay, num_microbatches), num_microbatches
    orders = []
    for i in range(P):
        warmup, ops = min(P - i - 1, m), []
        for k in range(delay.total_steps):
            seq = [("F", j) for j in range(warmup)]
            for j in range(m - warmup):
                seq += [("F", warmup + j), ("BI", j)]
            seq += [("BI", j) for j in range(m - warmup, m)]
            pending: deque[int] = deque()
            for kind, j in seq:
                ops.append((kind, i, k, j))
                if kind == "BI":
                    pending.append(j)
                    if len(pending) > i:  # keep i weight-gradients deferred
                        ops.append(("BW", i, k, pending.popleft()))
            ops += [("BW", i, k, j) for j in pending] + [("STEP", i, k, -1)]
        orders.append(ops)
    return build_schedule("zb-h1", delay, 1, m, orders)


def wpipe(delay: DelaySchedule, num_microbatches: int, **_: object) -> PipelineSchedule:
    """WPipe (Yang et al. ICLR'22): the model is cut into 2R stages in two groups; rank r holds
    stage r (group 0) and stage R+r (group 1). Group 0 runs the next step's forwards ahead of
    the current step's backwards (stale by one, two versions); group 1 updates before its
    next forward (fresh, one version) -- the `wpipe` delay policy. The order comes from greedy
    list scheduling (backwards first, oldest microbatch first): it reaches 2BW's flush-free
    throughput for m >= R but stashes more activations than 2BW (the paper's hand-made order
    may stash fewer; its text does not pin one down)."""
    check_sizes(delay, num_microbatches, 2)
    rank_pri = {"STEP": 0, "B": 1, "F": 2}
    return _list_schedule(
        "wpipe",
        delay,
        2,
        num_microbatches,
        split=False,
        priority=lambda op: (rank_pri[op[0]], op[2], op[3], -op[1]),
    )


# ---- each schedule's rule on its sizes on the distributed engine (`ScheduleSpec.sizes`) -------


def _interleaved_sizes(P: int, R: int, m: int, B: int, D: int) -> str:
    if not m % R:
        return ""
    ok = [n for n in range(R, B // D + 1, R) if B % (n * D) == 0]
    return (
        f"pipeline.schedule interleaved-1f1b sends microbatches through in groups of "
        f"one per process, so train.num_microbatches ({m}) must be a multiple of "
        f"pipeline.num_stages / pipeline.num_chunks = {R}; set train.num_microbatches "
        f"to {min(ok, key=lambda n: (abs(n - m), -n)) if ok else R}"
        + ("" if ok else f" and train.batch_size to a multiple of {R * D}")
    )


def _dualpipev_sizes(P: int, R: int, m: int, B: int, D: int) -> str:
    if m >= P:
        return ""
    return (
        f"pipeline.schedule dualpipev needs train.num_microbatches >= 2 x processes = "
        f"pipeline.num_stages = {P}, got {m}; set train.num_microbatches to "
        f"{next((n for n in range(P, B // D + 1) if B % (n * D) == 0), P)}"
    )


def _pipedream_sizes(P: int, R: int, m: int, B: int, D: int) -> str:
    if m == 1:
        return ""
    return (
        "pipeline.schedule pipedream updates after every microbatch-sized minibatch: set "
        f"train.num_microbatches to 1 (and train.batch_size to the minibatch size), got {m}"
    )


def _two_bw_sizes(P: int, R: int, m: int, B: int, D: int) -> str:
    if m >= P - 1:
        return ""
    # the fix: the smallest count that works with this batch, or fewer stages
    ok = [n for n in range(P - 1, B // D + 1) if B % (n * D) == 0]
    more = f"train.num_microbatches to {ok[0]} or " if ok else ""
    return (
        f"pipeline.schedule 2bw needs train.num_microbatches >= pipeline.num_stages - 1 "
        f"= {P - 1} (a forward would need weights not yet updated), got {m}; "
        f"set {more}pipeline.num_stages to {m + 1}"
    )


# The pipeline schedules, in the order of listings (help, simulator tables); each with the delay
# policy it realises (docs/design.md, 'The delay contract') and its stages per process.
for _spec in (
    ScheduleSpec(name="gpipe", policy="sync", generate=gpipe, cluster=False),
    ScheduleSpec(name="1f1b", policy="sync", generate=one_f_one_b),
    ScheduleSpec(
        name="interleaved-1f1b",
        policy="sync",
        generate=interleaved_1f1b,
        chunks=None,
        sizes=_interleaved_sizes,
    ),
    ScheduleSpec(name="zb-h1", policy="sync", generate=zb_h1, splits_backward=True),
    ScheduleSpec(name="2bw", policy="2bw", generate=two_bw, sizes=_two_bw_sizes, flushed="1f1b"),
    ScheduleSpec(
        name="pipedream",
        policy="pipedream",
        generate=pipedream,
        sizes=_pipedream_sizes,
        flushed="1f1b",
    ),
    # two groups of stages on each rank in the generated order; one stage per runtime process
    ScheduleSpec(
        name="wpipe", policy="wpipe", generate=wpipe, rank_stages=2, cluster=False, flushed="1f1b"
    ),
    ScheduleSpec(
        name="zb-v", policy="sync", generate=zb_v, chunks=2, placement="v", splits_backward=True
    ),
    ScheduleSpec(
        name="dualpipev",
        policy="sync",
        generate=dualpipev,
        chunks=2,
        placement="v",
        sizes=_dualpipev_sizes,
        splits_backward=True,
    ),
):
    PIPELINE_SCHEDULES.register(_spec)


def one_stage_per_rank(sched: PipelineSchedule) -> PipelineSchedule:
    """`sched` with every stage on a rank of its own (num_chunks 1, rank = stage): each stage
    keeps its actions in its rank's order, so an interleaved schedule runs on one process per
    stage. Dropping the order between the stages of a rank adds no dependency, so a schedule
    that executes without deadlock still does. Schedules without chunks come back unchanged."""
    if sched.num_chunks == 1:
        return sched
    lists: list[list[Action]] = [[] for _ in range(sched.num_stages)]
    for _, _, a in sched.actions():
        lists[a.stage].append(a)
    return dataclasses.replace(
        sched,
        num_ranks=sched.num_stages,
        num_chunks=1,
        placement="interleaved",
        ranks=tuple(tuple(acts) for acts in lists),
        _index={},
    )


def schedule_stages(name: str, num_ranks: int, num_chunks: int = 2) -> int:
    """How many stages schedule `name` runs on `num_ranks` ranks (interleaved-1f1b puts
    `num_chunks` stages on each rank; wpipe, zb-v and dualpipev two)."""
    return num_ranks * PIPELINE_SCHEDULES[name].stages_per_rank(num_chunks)


def make_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    num_steps: int = 1,
    *,
    num_chunks: int = 2,
    sync_start: int = 0,
    sync_cooldown: float = 0.0,
) -> PipelineSchedule:
    """The schedule `name` from `PIPELINE_SCHEDULES` on `num_ranks` ranks, its delay policy
    with these sync windows; an unknown name raises ConfigError listing
    them. `num_chunks` is used by interleaved-1f1b only; sync windows by 2bw, pipedream, wpipe
    (a synchronous schedule has no delay to lift, so `--compare` may pass them to all). The entry point of the
    simulator and its CLI; an engine that has its `DelaySchedule` calls `pipeline_schedule_for`."""
    if name not in PIPELINE_SCHEDULES:
        raise ConfigError(
            f"unknown schedule {name!r}; choose from {PIPELINE_SCHEDULES.choices(', ')}"
        )
    if num_ranks < 1:
        raise ConfigError(f"pipeline stages (--stages) must be >= 1, got {num_ranks}")
    if num_steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {num_steps}")
    if num_chunks < 1:
        raise ConfigError(f"--chunks must be >= 1, got {num_chunks}")
    policy = PIPELINE_SCHEDULES[name].policy
    if never_delays(policy):
        sync_start, sync_cooldown = 0, 0.0  # every step is synchronous already
    num_stages = schedule_stages(name, num_ranks, num_chunks)
    windows = DelayConfig(policy=policy, sync_start=sync_start, sync_cooldown=sync_cooldown)
    delay = DelaySchedule.build(windows, num_stages, num_steps)
    return pipeline_schedule_for(name, delay, num_microbatches, num_chunks=num_chunks)


def pipeline_schedule_for(
    name: str, delay: DelaySchedule, num_microbatches: int, *, num_chunks: int = 2
) -> PipelineSchedule:
    """The schedule `name` realising `delay` (its policy must be the schedule's) over
    `delay.total_steps` steps of `num_microbatches` microbatches."""
    if name not in PIPELINE_SCHEDULES:
        raise ConfigError(
            f"unknown schedule {name!r}; choose from {PIPELINE_SCHEDULES.choices(', ')}"
        )
    spec = PIPELINE_SCHEDULES[name]
    assert delay.policy == spec.policy, (name, delay.policy)
    return spec.generate(delay, num_microbatches, num_chunks=num_chunks)
