"""The GPU path, checked on CPU (issue 18): steady-state throughput, one TF32 policy for both
engines, train.compile refused where it would do nothing, the GPU count checked before a rank
touches a GPU, MFU against the exact device, SOAP's fp32 math and eigh fallback (host syncs:
test_host_syncs.py). CUDA is simulated by patching torch.cuda where a test needs it."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from stalepipe.config import ConfigError, apply_overrides
from stalepipe.errors import EXIT_USER
from stalepipe.hardware import PEAK_BF16_FLOPS, peak_bf16_flops
from stalepipe.presets import get_preset
from stalepipe.training.rundir import metrics as metrics_mod
from stalepipe.training.rundir.metrics import TIMING_WARMUP_STEPS, Meter, read_metrics
from stalepipe.training.train.devices import DeviceError, peak_flops, set_tf32

CUDA = torch.device("cuda")  # a device object only: nothing here runs a CUDA kernel


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(metrics_mod.time, "perf_counter", c)
    return c


# ---- throughput after the warm-up -------------------------------------------------------------


def test_throughput_leaves_out_the_warmup_and_paused_time(clock):
    meter = Meter(start=0, tokens_per_step=100, flops_per_token=6.0, peak_flops=1200.0, warmup=3)
    for step in range(3):  # compile-like warm-up: 10 s a step
        clock.t += 10
        meter.step_done(step)
    assert meter.timed_from(2) == 0
    assert meter.tokens_per_s(2) == pytest.approx(300 / 30)  # the rate since the start, so far
    for step in range(3, 6):  # steady: 1 s a step, and an evaluation of 50 s after step 4
        clock.t += 1
        meter.step_done(step)
        if step == 4:
            with meter.paused():
                clock.t += 50
    fields = meter.fields(5)
    assert fields["timed_from_step"] == 3
    assert fields["tokens_per_s"] == pytest.approx(300 / 3)
    assert fields["model_flops_per_s"] == pytest.approx(600)
    assert fields["mfu"] == pytest.approx(0.5)
    assert "peak_mem_gib" not in fields  # CPU
    assert meter.elapsed() == pytest.approx(83)  # wall time keeps everything


def test_a_resumed_run_warms_up_again_and_a_short_one_reports_since_its_start(clock):
    meter = Meter(start=10, tokens_per_step=10, flops_per_token=1.0, warmup=3)
    for step in (10, 11):
        clock.t += 5
        meter.step_done(step)
    assert meter.timed_from(11) == 10 and meter.tokens_per_s(11) == pytest.approx(2.0)
    assert "mfu" not in meter.fields(11)  # unknown peak: no MFU


def test_the_loop_logs_steady_state_throughput(tiny_config):
    from stalepipe.training.train.loop import train

    cfg = dataclasses.replace(
        tiny_config, train=dataclasses.replace(tiny_config.train, log_every=1)
    )
    rows = [r for r in read_metrics(train(cfg, verbose=False).run_dir) if "tokens_per_s" in r]
    froms = [r["timed_from_step"] for r in rows]
    w = TIMING_WARMUP_STEPS
    assert froms == [0] * w + [w] * (len(rows) - w)
    assert all(r["tokens_per_s"] > 0 for r in rows)


# ---- TF32: one policy, both engines ---------------------------------------------------------


@pytest.fixture
def tf32_flags():
    """Restore torch's TF32 flags after the test."""
    m, c = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = m, c


@pytest.mark.parametrize("enabled", [True, False])
def test_set_tf32_sets_both_flags_on_cuda_and_nothing_on_cpu(tf32_flags, enabled):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not enabled
    set_tf32(enabled, torch.device("cpu"))
    assert torch.backends.cuda.matmul.allow_tf32 is (not enabled)
    set_tf32(enabled, CUDA)
    assert torch.backends.cuda.matmul.allow_tf32 is enabled
    assert torch.backends.cudnn.allow_tf32 is enabled


class _Stop(Exception):
    pass


def _recorder(seen):
    def record(enabled, device):
        seen.append((enabled, device.type))
        raise _Stop

    return record


@pytest.mark.parametrize("tf32", [True, False])
def test_both_engines_apply_train_tf32_before_training(tiny_config, monkeypatch, tf32):
    from stalepipe.training.train import loop, pipelined

    seen: list = []
    monkeypatch.setattr(loop, "set_tf32", _recorder(seen))
    monkeypatch.setattr(pipelined, "set_tf32", _recorder(seen))
    cfg = dataclasses.replace(tiny_config, train=dataclasses.replace(tiny_config.train, tf32=tf32))
    with pytest.raises(_Stop):
        loop.train(cfg, verbose=False)
    runtime = apply_overrides(cfg, {"pipeline.engine": "distributed", "pipeline.schedule": "1f1b"})
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(_Stop):  # before the process group: nothing ran yet
        pipelined.run_worker(runtime, verbose=False)
    assert seen == [(tf32, "cpu"), (tf32, "cpu")]


# ---- train.compile: every block compiled on both engines; refused where the backward is split --

ZB = {"pipeline.engine": "distributed", "pipeline.schedule": "zb-h1"}


def test_compile_is_refused_only_where_the_runtime_splits_the_backward():
    for overrides in ({}, {"delay.mode": "exact"}, {"pipeline.engine": "distributed"}):
        apply_overrides(get_preset("cpu-tiny"), {"train.compile": "true", **overrides})
    with pytest.raises(ConfigError) as e:
        apply_overrides(get_preset("cpu-tiny"), {"train.compile": "true", **ZB})
    fixes = "set train.compile to false, or pipeline.schedule to 1f1b"
    assert str(e.value).endswith(fixes) and "\n" not in str(e.value)
    apply_overrides(get_preset("cpu-tiny"), ZB)  # the split backward itself runs eager


def test_compile_blocks_compiles_every_block_and_nothing_else():
    """Both engines compile the same modules: the whole model's blocks, a stage's blocks."""
    from stalepipe.training.models import build_model, build_stage, compile_blocks
    from stalepipe.training.models.layers import Block

    cfg = get_preset("cpu-tiny").model
    for module in (build_model(cfg, 0), build_stage(cfg, 0, 2, 1)):
        compile_blocks(module)  # lazy: nothing compiles before a call
        compiled = [n for n, m in module.named_modules() if m._compiled_call_impl is not None]
        assert compiled == [n for n, m in module.named_modules() if isinstance(m, Block)]
        assert compiled


def test_compiling_an_moe_model_warns_what_it_costs():
    (w,) = apply_overrides(get_preset("cpu-moe"), {"train.compile": "true"}).warnings()
    assert w.startswith("train.compile with MoE layers: each layer's dispatch breaks the graph")
    assert apply_overrides(get_preset("cpu-tiny"), {"train.compile": "true"}).warnings() == []


def test_the_cli_refuses_compile_with_a_split_backward_in_one_line(tmp_path, capsys):
    """`main` here: `python -m stalepipe` exits with what it returns (`__main__.py`), and other
    tests run the CLI as a process of its own."""
    from stalepipe.cli import main

    args = ["--preset", "cpu-tiny", "--train.compile", "true", "--pipeline.engine", "distributed",
            "--pipeline.schedule", "zb-h1"]  # fmt: skip
    assert main(["train", *args, "--out_dir", str(tmp_path)]) == EXIT_USER
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "train.compile" in line and "set train.compile to false" in line
    assert not any(tmp_path.iterdir())


# ---- more ranks than GPUs: one line before any rank touches a GPU -------------------------------


@pytest.fixture
def two_gpus(monkeypatch):
    """A CUDA build with 2 GPUs; touching a GPU or a process group fails the test."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def touched(*_a, **_k):
        raise AssertionError("a GPU or a process group was touched before the device check")

    monkeypatch.setattr(torch.cuda, "set_device", touched)
    monkeypatch.setattr(torch.distributed, "init_process_group", touched)


def _under_torchrun(monkeypatch, world: int) -> None:
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": str(world)}
    for k, v in {**env, "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", "1")


def test_the_runtime_under_torchrun_refuses_more_stages_than_gpus(
    tiny_config, two_gpus, monkeypatch
):
    from stalepipe.training.train.pipelined import run_worker

    cfg = apply_overrides(
        tiny_config,
        {
            "pipeline.engine": "distributed",
            "pipeline.schedule": "1f1b",
            "pipeline.num_stages": "2",
            "model.num_layers": "4",
            "train.device": "cuda",
            "delay.policy": "sync",
            "train.num_microbatches": "4",
        },
    )
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, num_stages=4))
    _under_torchrun(monkeypatch, 4)
    with pytest.raises(DeviceError, match=r"puts 4 processes on this machine, one GPU each, but "):
        run_worker(cfg, verbose=False)


def test_a_data_parallel_run_under_torchrun_refuses_more_ranks_than_gpus(
    tiny_config, two_gpus, monkeypatch
):
    from stalepipe.training.train.loop import train

    cfg = apply_overrides(tiny_config, {"train.device": "cuda", "train.num_microbatches": "4"})
    _under_torchrun(monkeypatch, 4)
    with pytest.raises(DeviceError, match=r"torchrun --nproc-per-node 2"):
        train(cfg, verbose=False)
    assert not os.path.exists(cfg.out_dir)


# ---- peak FLOP/s by exact device name, MFU ---------------------------------------------------


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.5),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA H200", 989.4),
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA B200", 2250),
        ("NVIDIA L40S", 362.05),
        ("NVIDIA A100-SXM4-40GB", 312),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
        (" NVIDIA H200 ", 989.4),
    ],
)
def test_peak_flops_by_exact_device_name(name, tflops):
    assert peak_bf16_flops(name) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize("name", ["NVIDIA H100", "H100", "NVIDIA H200 SXM 141GB", "Tesla T4", ""])
def test_no_peak_for_a_name_that_is_not_listed(name):
    assert peak_bf16_flops(name) is None


def test_every_listed_part_is_a_dense_figure_below_the_sparse_one():
    # dense bf16 peaks lie between an L40S's and a B200's; a sparse figure would be ~2x
    assert all(300e12 < v <= 2.25e15 for v in PEAK_BF16_FLOPS.values())


def test_mfu_counts_every_process_gpu(monkeypatch):
    from stalepipe.training.train.loop import run_meter

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_flops(CUDA, 4) == pytest.approx(4 * 756.5e12)
    assert peak_flops(torch.device("cpu"), 4) == 0.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    assert peak_flops(CUDA) == 0.0  # a substring of several parts: no guess
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    meter = run_meter(get_preset("cpu-tiny"), 0, CUDA)  # one process: no process group
    assert meter.peak == pytest.approx(2250e12)


# ---- SOAP: full fp32 under TF32, eigh's float64 fallback ------------------------------------------


def test_soap_turns_tf32_off_inside_and_restores_it(tf32_flags):
    from stalepipe.training.optim.soap import full_fp32_matmuls

    torch.backends.cuda.matmul.allow_tf32 = True
    with full_fp32_matmuls(CUDA):
        assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.backends.cuda.matmul.allow_tf32 is True
    with pytest.raises(RuntimeError), full_fp32_matmuls(CUDA):
        raise RuntimeError("restored on the way out too")
    assert torch.backends.cuda.matmul.allow_tf32 is True


def test_soap_turns_tf32_off_under_torchs_new_precision_api_too():
    # In a process of its own: after the new API is used, torch refuses the legacy flags.
    code = (
        "import torch\n"
        "from stalepipe.training.optim.soap import full_fp32_matmuls\n"
        "m = torch.backends.cuda.matmul\n"
        "m.fp32_precision = 'tf32'\n"
        "with full_fp32_matmuls(torch.device('cuda')):\n"
        "    assert m.fp32_precision == 'ieee'\n"
        "assert m.fp32_precision == 'tf32'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]


def test_soap_eigh_falls_back_to_float64_when_float32_fails(monkeypatch):
    from stalepipe.training.optim import soap

    real = torch.linalg.eigh
    calls: list[torch.dtype] = []

    def eigh(a, *args, **kwargs):
        calls.append(a.dtype)
        if a.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.eigh: the algorithm failed to converge")
        return real(a, *args, **kwargs)

    g = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    factor = g @ g.T
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    vecs = soap.eigenvectors(factor)
    assert calls == [torch.float32, torch.float64] and vecs.dtype == torch.float32
    want = real(factor.double() + 1e-30 * torch.eye(6, dtype=torch.float64))[1].float()
    assert torch.equal(vecs, want)
    state = soap.soap_init_state(g, shampoo_beta=0.95, max_precond_dim=100)  # the whole init
    assert state["q_left"].dtype == torch.float32 and state["q_left"].shape == (6, 6)


def test_soap_eigenvectors_without_a_failure_are_eighs_own():
    from stalepipe.training.optim import soap

    g = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    f = g @ g.T
    assert torch.equal(soap.eigenvectors(f), torch.linalg.eigh(f + 1e-30 * torch.eye(5))[1])
