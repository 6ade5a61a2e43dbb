"""The timed spans of pipeline_throughput.py's workers and what is read off them: each action's
wall and CPU time (`timed_call`), the timed window, the busy time of a rank (the union of its
work spans minus its waits), the median duration of one kind of action and the simulator's
cost model made of those medians."""

from __future__ import annotations

import time

from stalepipe.lab.sim.timing import CostModel, uniform_costs


def window(reports: list[dict]) -> tuple[float, float]:
    """From the first stage's first forward of step `warm` to the last rank's end."""
    return reports[0]["marks"]["start"], max(r["marks"]["end"] for r in reports)


def timed_call(fn, out: list, keys: list, key=lambda a, kw: a[:1]):
    """`fn`, recording (wall start, wall end, this thread's CPU seconds) per call into `out`
    and `key` of its arguments (default: the first, a STEP's step) into `keys`: CPU
    time tells a schedule's own work from the machine's (a core shared with the other process
    or with another job stretches the wall time, not the CPU time)."""

    def run(*a, **kw):
        t, c = time.perf_counter(), time.thread_time()
        r = fn(*a, **kw)
        out.append((t, time.perf_counter(), time.thread_time() - c))
        keys.append(key(a, kw))
        return r

    return run


def _union(spans: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Length of the union of `spans` clipped to [t0, t1] (apply spans nest in F and STEP)."""
    total, end = 0.0, t0
    for a, b, _ in sorted(spans):
        a, b = max(a, end), min(b, t1)
        if b > a:
            total += b - a
            end = b
    return total


def busy(report: dict, t0: float, t1: float) -> float:
    sp = report["spans"]
    work = sp["F"] + sp["B"] + sp["V"] + sp["S"] + sp["A"]
    return _union(work, t0, t1) - _union(sp["W"], t0, t1)


def step_breakdown(report: dict, t0: float, t1: float, steps: int) -> dict[str, float]:
    """Where one rank's time per timed step goes, in seconds: F+B (its forwards and backwards,
    net of the waits and updates inside them), the update (the optimizer step), STEP (the
    rest of post_step: the vote, the norm exchange posted, the tied gradient, retiring sends),
    waits (for a peer's message: the bubble), and `other`, the wall time inside no span (the
    executor's own loop: posting receives, taking reports, the generator)."""
    sp = report["spans"]
    fb = _union(sp["F"] + sp["B"] + sp["V"], t0, t1)
    update = _union(sp["A"], t0, t1)
    waits = _union(sp["W"], t0, t1)
    step = _union(sp["S"], t0, t1)
    step_net = step - _union(
        [x for x in sp["A"] if any(a <= x[0] < b for a, b, _ in sp["S"])], t0, t1
    )
    nested_a = update - (step - step_net)  # updates inside F (the rest are inside STEP)
    everything = _union(sp["F"] + sp["B"] + sp["V"] + sp["S"] + sp["A"] + sp["W"], t0, t1)
    parts = {
        "F+B": fb - waits - nested_a,
        "update": update,
        "STEP": step_net,
        "waits": waits,
        "other": (t1 - t0) - everything,
    }
    return {k: v / steps for k, v in parts.items()}


def net_spans(
    report: dict, kind: str, cpu: bool = False, stage: int | None = None, from_step: int = 0
) -> list[float]:
    """Durations of `kind` spans (wall, or with `cpu` the thread's CPU time), minus the waits
    and the updates nested inside; F and B of `stage` only when given (and of its steps from
    `from_step` on)."""
    inner = sorted(report["spans"]["W"] + (report["spans"]["A"] if kind != "A" else []))
    xs = []
    spans = report["spans"][kind]
    if stage is not None:
        keys = report["keys"][kind]
        spans = [sp for sp, k in zip(spans, keys) if k[0] == stage and k[1] >= from_step]
    for a, b, c in spans:
        nested = [(x, y, z) for x, y, z in inner if x < b and y > a]
        if cpu:
            xs.append(c - sum(z for x, y, z in nested if x >= a and y <= b))
        else:
            xs.append(b - a - sum(min(y, b) - max(x, a) for x, y, _ in nested))
    return xs


def median_span(report: dict, kind: str, cpu: bool = False, stage: int | None = None) -> float:
    """Median of `net_spans` (robust to the shared machine's hiccups); 0 with no action of this
    kind (BW without a split backward)."""
    xs = sorted(net_spans(report, kind, cpu, stage))
    return xs[len(xs) // 2] if xs else 0.0


def measured_costs(reports: list[dict], mean_from: int | None = None) -> CostModel:
    """The timing simulator's cost model of one run (one report per rank, in rank order): per
    stage the median forward, backward (B, or BI of a split backward) and BW, and the rank's
    median update shared by its stages; `sim.timing` then takes every action of a kind at that
    one time (not at the time it took: that is pipeline_replay.py). `mean_from`: the mean of
    F, B and BW over the steps from that one on instead of the median."""

    def stat(r: dict, kind: str, stage: int) -> float:
        if mean_from is None:
            return median_span(r, kind, stage=stage)
        xs = net_spans(r, kind, stage=stage, from_step=mean_from)
        return sum(xs) / len(xs) if xs else 0.0

    by_stage = sorted((s, r) for r in reports for s in r["stages"])
    f, b, w = ([stat(r, kind, s) for s, r in by_stage] for kind in "FBV")
    u = [median_span(r, "A") / len(r["stages"]) for _, r in by_stage]
    return uniform_costs(len(by_stage), forward=f, backward_input=b, backward_weight=w, optimizer=u)
