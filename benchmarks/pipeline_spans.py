"""The timed spans of pipeline_throughput.py's workers and what is read off them: each action's
wall and CPU time (`timed_call`), the timed window, the busy time of a rank (the union of its
work spans minus its waits) and the median duration of one kind of action."""

from __future__ import annotations

import time


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


def median_span(report: dict, kind: str, cpu: bool = False, stage: int | None = None) -> float:
    """Median duration of `kind` spans (wall, or with `cpu` the thread's CPU time), minus the
    waits and the updates nested inside; F and B of `stage` only when given."""
    inner = sorted(report["spans"]["W"] + (report["spans"]["A"] if kind != "A" else []))
    xs = []
    spans = report["spans"][kind]
    if stage is not None:
        spans = [sp for sp, k in zip(spans, report["keys"][kind]) if k[0] == stage]
    if not spans:
        return 0.0  # no action of this kind (BW without a split backward)
    for a, b, c in spans:
        nested = [(x, y, z) for x, y, z in inner if x < b and y > a]
        if cpu:
            xs.append(c - sum(z for x, y, z in nested if x >= a and y <= b))
        else:
            xs.append(b - a - sum(min(y, b) - max(x, a) for x, y, _ in nested))
    return sorted(xs)[len(xs) // 2]  # median: robust to the shared machine's hiccups
