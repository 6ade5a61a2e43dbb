"""The GPU check must run on CPU in its reduced mode (it is what a GPU session runs first)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_reduced_mode_prints_its_table():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--reduced", "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split()[0] for line in out.stdout.splitlines()[2:]]
    assert rows == ["sync", "2bw", "2bw+EF"]
