"""Both steps as docs/design.md traces them ("Walks"): which of stalepipe's files one steady 2BW
step calls into, read off `sys.setprofile` on every process of a real run (the runtime's step)
or in this process (the emulator's step, fast and exact mode), and held against the files the
design text lists (issue 43: at most 10 for the runtime, nothing in runtime/ calling back into
train/ during a step; issue 54: the emulator's walk re-traced as the runtime's is)."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

from stalepipe.training.launch.pooled import worker_entry
from stalepipe.training.train.loop import train

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
# ... and for the emulator, whose step calls no runtime: the data-parallel helpers (no-ops in
# one process) are its leaves too.
EMULATOR_LEAVES = LEAVES - {"delay/emulator.py"} | {"train/distributed.py"}
FIRST, LAST = 2, 4  # the window: from STEP 2 to STEP 4, steady state at P = 2, m = 2


def _room_path(path: str) -> str:
    """'training/delay/policies.py' -> 'delay/policies.py': the design text cites a file by its
    room, whichever wing holds it."""
    for wing in ("training/", "lab/"):
        if path.startswith(wing):
            return path[len(wing) :]
    return path


def traced(run, opens: tuple[str, str], first: int, last: int) -> list[tuple[str, str, str]]:
    """`run()` under a profiler: (file under src/stalepipe, function, the caller's file) of every
    call made between the call of `opens` (file, function) for step `first` and its call for
    step `last`."""
    calls: set[tuple[str, str, str]] = set()
    window = [False]
    prefix = str(PACKAGE) + "/"

    def profile(frame, event, _arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(prefix):
            return
        if code.co_name == opens[1] and code.co_filename.endswith(opens[0]):
            step = frame.f_locals.get("step")
            window[0] = window[0] if step not in (first, last) else step == first
        if window[0]:
            caller = frame.f_back.f_code.co_filename if frame.f_back else ""
            caller = _room_path(caller[len(prefix) :]) if caller.startswith(prefix) else "-"
            calls.add((_room_path(code.co_filename[len(prefix) :]), code.co_qualname, caller))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return sorted(calls)


def traced_entry(cfg) -> list[tuple[str, str, str]]:
    """`worker_entry` traced from this process's STEP of step FIRST to its STEP of step LAST."""
    run = lambda: worker_entry(cfg, False, True)  # noqa: E731
    return traced(run, ("runtime/stage.py", "post_step"), FIRST, LAST)


def _design_files(walk: str) -> tuple[int, list[str], list[str]]:
    """The count and the files the design text gives for `walk` ("The runtime's step", ...),
    and the files it says exact mode adds (none for the runtime)."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split(f"### {walk}", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    m = re.search(
        r"The step's own logic reads through \*\*(\d+) files\*\*[^:]*:(.*?)\.(?:\s|$)",
        section,
        re.S,
    )
    assert m, f"docs/design.md's walk {walk!r} has no '**Count.**' line"
    count = int(m.group(1))
    listed = re.findall(r"`([a-z_]+/[a-z_]+\.py)`", m.group(2))
    adds = re.search(
        r"Exact\s+mode\s+with\s+a\s+tied\s+embedding\s+adds\s+(.*?)\.(?:\s|$)", section, re.S
    )
    return count, listed, re.findall(r"`([a-z_]+/[a-z_]+\.py)`", adds.group(1) if adds else "")


def test_the_runtime_step_reads_the_files_design_md_lists(make_cfg, run_dist, pool):
    cfg = make_cfg("2bw", P=2, m=2, steps=8)
    calls = pool.run(traced_entry, (cfg,), 2, timeout_s=180)
    files = {f for rank in calls for f, _, _ in rank}
    own = files - LEAVES - MODEL - BOOKKEEPING
    count, listed, _ = _design_files("The runtime's step")
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


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_the_emulator_step_reads_the_files_design_md_lists(make_cfg, mode):
    """The emulator's walk, traced in this process over steps 3 and 4 of the same 8-step tied
    2BW run (P = 2, m = 2, AdamW, clipping on): the files of the step's own logic are the ones
    the design text lists (exact mode: plus the files it says exact mode adds), delay/ never
    calls back into train/, and train/ enters delay/ only through the emulator's three calls
    of a step."""
    cfg = make_cfg("2bw", P=2, m=2, steps=8)
    cfg = dataclasses.replace(
        cfg,
        pipeline=dataclasses.replace(cfg.pipeline, engine="emulate", schedule="1f1b"),
        delay=dataclasses.replace(cfg.delay, mode=mode),
    )
    run = lambda: train(cfg, verbose=False)  # noqa: E731
    calls = traced(run, ("delay/emulator.py", "forward_backward"), 3, 5)
    files = {f for f, _, _ in calls}
    own = files - EMULATOR_LEAVES - MODEL - BOOKKEEPING
    count, listed, adds = _design_files("The emulator's step")
    assert count == len(listed)
    expected = set(listed) | (set(adds) - MODEL if mode == "exact" else set())
    assert own == expected, (
        f"the traced {mode} step calls {sorted(own)}; docs/design.md lists {sorted(expected)}"
    )
    assert adds, "docs/design.md's emulator walk says nothing of what exact mode adds"
    assert files >= (set(adds) if mode == "exact" else set()), sorted(set(adds) - files)
    back = {
        (c, f"{f}:{fn}") for f, fn, c in calls if c.startswith("delay/") and f.startswith("train/")
    }
    assert not back, f"delay/ called back into train/ during a step: {sorted(back)}"
    entries = {
        f"{f}:{fn}" for f, fn, c in calls if c.startswith("train/") and f.startswith("delay/")
    }
    assert entries == {
        f"delay/emulator.py:DelayEmulator.{fn}"
        for fn in ("forward_backward", "clip_grad_norm_", "step")
    }, entries
