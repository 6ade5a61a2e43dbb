"""The GPU check must run on CPU in its reduced mode (it is what a GPU session runs first)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pipeline_throughput_runs_every_contender():
    """A tiny run of the runtime-vs-torch benchmark: it must not rot between benchmark runs."""
    args = ["--microbatches", "2", "--steps", "4", "--warmup", "1", "--repeats", "1"]
    args += ["--dim", "32", "--layers", "4", "--seq", "16", "--mb", "2"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline_throughput.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")}
    assert {"gpipe", "1f1b", "2bw", "torch-gpipe", "torch-1f1b"} <= rows
    assert {"torch-interleaved", "torch-zbv"} <= rows
    assert "2bw / 1f1b = " in out.stdout and "with both computing" in out.stdout
    assert "2bw / the best of torch's schedules" in out.stdout and "load average" in out.stdout
    # Memory per rank: our executors hold exactly the stashes the schedule IR accounts for.
    assert "peak memory per rank" in out.stdout
    held = re.findall(r"executor held (\d+) stashes \(IR: (\d+)\)", out.stdout)
    assert len(held) == 3 and all(a == b for a, b in held), held
