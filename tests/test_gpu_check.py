"""benchmarks/gpu/gpu_check.sh, the first GPU run (issue 18): without CUDA it refuses in one line,
it names the wheels to bring for what is missing, and its reduced CPU mode runs every check."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu" / "gpu_check.sh"


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def gpu_check():
    """benchmarks/gpu/gpu_check.py as a module; it puts the project root on sys.path, as when
    the script runs, to import `benchmarks.gpu.gpu_machine`: both are undone after the tests."""
    path = list(sys.path)
    spec = importlib.util.spec_from_file_location(
        "gpu_check", ROOT / "benchmarks" / "gpu" / "gpu_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        for name in [n for n in sys.modules if n == "gpu_check" or n.startswith("benchmarks")]:
            del sys.modules[name]
        sys.path[:] = path


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_cuda_it_refuses_in_one_line(tmp_path):
    out = _run("--json", str(tmp_path / "out.json"))
    assert out.returncode == 1 and out.stdout == ""
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("gpu_check: no CUDA device: this torch build has no CUDA")
    assert line.endswith("or pass --cpu-smoke for the reduced CPU run")
    assert not (tmp_path / "out.json").exists()


def test_the_script_installs_nothing_and_runs_from_the_source_tree():
    text = SCRIPT.read_text()
    assert "pip install" not in text and "venv" not in text.replace("no venv is", "")
    assert 'PYTHONPATH="$PWD/src' in text


def test_a_missing_package_names_the_wheels_to_bring(gpu_check, monkeypatch):
    real = importlib.util.find_spec
    hidden = {"tqdm", "regex"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda m: None if m in hidden else real(m))
    machine = sys.modules["benchmarks.gpu.gpu_machine"]
    assert machine.missing_packages() == ["tqdm", "regex"]
    text = machine.wheel_commands(["tqdm", "regex"])
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert f"pip download --no-deps --only-binary=:all: --python-version {pyver}" in text
    assert "tqdm>=4.66 regex" in text
    assert "-m pip install --no-index --no-deps --target .gpu_check_site" in text


def test_every_needed_module_is_installed_here(gpu_check):
    assert sys.modules["benchmarks.gpu.gpu_machine"].missing_packages() == []


# cpu-small narrowed and shortened: every check still runs (the runtime's ZB-V needs its 4
# layers), in a fraction of the time
SMALLER = ["model.dim=64", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_dim=176"]
SMALLER += ["data.seq_len=32"]


def test_the_reduced_cpu_mode_runs_every_check(tmp_path):
    smaller = [a for kv in SMALLER for a in ("--set", kv)]
    args = ("--cpu-smoke", "--steps", "1", "--json", str(tmp_path / "r.json"), *smaller)
    out = _run(*args, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("cpu-small on cpu (reduced CPU mode (--cpu-smoke))")
    rows = [line.split()[:3] for line in lines[2:-1]]
    policies = ["sync", "2bw", "2bw+EF"]
    want = [["throughput", p, o] for o in ("adamw", "muon") for p in policies]
    runtime = [["runtime", "P=2", "2bw"], ["runtime", "P=2", "zb-v"]]
    assert rows == [*want, ["resume", "2bw+EF", "adamw"], *runtime]
    assert "bitwise equal" in out.stdout and lines[-1].startswith("all checks passed")
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["ok"] and len(result["rows"]) == 9
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in result["rows"])
    assert all(r["timed_from_step"] == 3 for r in result["rows"])  # after the warm-up


@pytest.mark.parametrize("num_gpus", [1, 2, 4, 8])
def test_every_config_the_gpu_mode_builds_is_valid(gpu_check, tmp_path, num_gpus):
    import argparse

    args = argparse.Namespace(cpu_smoke=False, steps=20, budget_s=450.0)
    s = gpu_check.setup(args, tmp_path)
    s.num_gpus = num_gpus
    for policy in gpu_check.POLICIES:
        for optim in gpu_check.OPTIMIZERS:
            for compiled in (False, True):
                cfg = gpu_check.emulator_config(s, policy, optim, compiled)
                assert cfg.model.dim == 576 and cfg.train.dtype == "bfloat16"  # smollm-135m
                assert cfg.train.compile is compiled and cfg.train.device == "cuda"
    P = gpu_check.runtime_stages(s)
    cfg = gpu_check.runtime_config(s, P)
    assert cfg.pipeline.num_stages == P == num_gpus
    assert cfg.pipeline.schedule == ("2bw" if P > 1 else "1f1b")
    from stalepipe.training.train.pipelined import check_config

    check_config(cfg)  # what the runtime itself refuses
    v = gpu_check.runtime_config(s, P, v_shape=True)  # two stages per GPU, in a V
    assert (v.pipeline.num_stages, v.pipeline.num_chunks, v.pipeline.num_processes) == (2 * P, 2, P)
    check_config(v)
