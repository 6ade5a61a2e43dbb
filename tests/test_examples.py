"""The scripts in examples/ run as a user runs them (a subprocess, tiny sizes) and print the
sync / 2bw / 2bw+EF losses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "script,args,needs",
    [
        ("nanogpt_2bw_ef.py", ["--steps", "30"], None),
        ("accelerate_2bw.py", ["--steps", "60"], "accelerate"),
        ("hf_trainer_2bw.py", ["--steps", "16"], "transformers"),
    ],
)
def test_example_prints_the_three_arms(script, args, needs):
    if needs:
        pytest.importorskip(needs)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    losses = dict(re.findall(r"^(sync|2bw|2bw\+EF)\s+(\d+\.\d+)$", out.stdout, re.M))
    assert list(losses) == ["sync", "2bw", "2bw+EF"], out.stdout
    assert losses["sync"] != losses["2bw"]  # the delay changed the run
