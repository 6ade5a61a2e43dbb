"""The runtime's step as docs/design.md traces it ("Walks", "The runtime's step"): which of
stalepipe's files one steady 2BW step calls into, read off `sys.setprofile` on every process of
a real run, and held against the files the design text lists (issue 43: at most 10, nothing in
runtime/ calling back into train/ during a step)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from stalepipe.launch.pooled import worker_entry

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "stalepipe"
# What the design text counts apart from the step's own logic: the leaf helpers a step calls
# (seeds, the LR multiplier, the data), the model's forward, and the loop's bookkeeping.
LEAVES = {
    "delay/rng.py",
    "delay/emulator.py",
    "optim/lr_schedule.py",
    "config/registry.py",  # the LR schedule's lookup by name
    "data/loader.py",
}
MODEL = {"models/partition.py", "models/transformer.py", "models/layers.py", "models/moe.py"}
BOOKKEEPING = {"peers/interrupts.py", "rundir/metrics.py", "train/progress.py"}
FIRST, LAST = 2, 4  # the window: from STEP 2 to STEP 4, steady state at P = 2, m = 2


def traced_entry(cfg) -> list[tuple[str, str, str]]:
    """`worker_entry` under a profiler: (file under src/stalepipe, function, the caller's file)
    of every call made between this process's STEP of step FIRST and its STEP of step LAST."""
    calls: set[tuple[str, str, str]] = set()
    window = [False]
    prefix = str(PACKAGE) + "/"

    def profile(frame, event, _arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(prefix):
            return
        if code.co_name == "post_step" and code.co_filename.endswith("runtime/stage.py"):
            step = frame.f_locals.get("step")
            window[0] = window[0] if step not in (FIRST, LAST) else step == FIRST
        if window[0]:
            caller = frame.f_back.f_code.co_filename if frame.f_back else ""
            caller = caller[len(prefix) :] if caller.startswith(prefix) else "-"
            calls.add((code.co_filename[len(prefix) :], code.co_qualname, caller))

    sys.setprofile(profile)
    try:
        worker_entry(cfg, False, True)
    finally:
        sys.setprofile(None)
    return sorted(calls)


def _design_files() -> tuple[int, list[str]]:
    """The count and the files the design text gives for the runtime's step."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("### The runtime's step", 1)[1].split("\n## ", 1)[0]
    m = re.search(
        r"The step's own logic reads through \*\*(\d+) files\*\*:(.*?)\.(?:\s|$)", section, re.S
    )
    assert m, "docs/design.md's runtime walk has no '**Count.**' line"
    count = int(m.group(1))
    listed = re.findall(r"`([a-z_]+/[a-z_]+\.py)`", m.group(2))
    return count, listed


def test_the_runtime_step_reads_the_files_design_md_lists(make_cfg, run_dist, pool):
    cfg = make_cfg("2bw", P=2, m=2, steps=8)
    calls = pool.run(traced_entry, (cfg,), 2, timeout_s=180)
    files = {f for rank in calls for f, _, _ in rank}
    own = files - LEAVES - MODEL - BOOKKEEPING
    count, listed = _design_files()
    assert own == set(listed), (
        f"the traced step calls {sorted(own)}; docs/design.md lists {sorted(listed)}"
    )
    assert count == len(listed) <= 10
    # Nothing in runtime/ calls back into train/ during a step: the executor is driven from
    # train (the loop, `PipelineEngine.steps`), never the reverse.
    back = {
        (caller, f"{f}:{fn}")
        for rank in calls
        for f, fn, caller in rank
        if caller.startswith("runtime/") and f.startswith("train/")
    }
    assert not back, f"runtime/ called back into train/ during a step: {sorted(back)}"
    # ... and train/ enters the runtime through one door during a step: the executor's `run`.
    entries = {
        f"{f}:{fn}"
        for rank in calls
        for f, fn, caller in rank
        if caller.startswith("train/") and f.startswith("runtime/")
    }
    assert entries == {"runtime/stage.py:StageExecutor.run"}, entries
