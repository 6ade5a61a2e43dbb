"""A CUDA request this machine cannot serve is one line naming the fix, before anything is
written. The suite runs on CPU-only torch; GPU counts are simulated by patching torch.cuda."""

from __future__ import annotations

import pytest
import torch

from stalepipe.config import apply_overrides
from stalepipe.errors import EXIT_USER
from stalepipe.presets import get_preset
from stalepipe.training.train.devices import DeviceError, check_device


def _cfg(**overrides: str):
    return apply_overrides(get_preset("cpu-tiny"), overrides)


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `n` visible GPUs (on a CUDA build of torch)."""

    def have(n: int) -> None:
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return have


def test_cpu_needs_nothing():
    check_device(_cfg())


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only torch build")
def test_cuda_on_a_cpu_only_build_names_the_fix():
    with pytest.raises(DeviceError) as e:
        check_device(_cfg(**{"train.device": "cuda"}))
    msg = str(e.value)
    assert msg.startswith("--train.device cuda: this torch build (")
    assert "has no CUDA support; install a CUDA build of torch" in msg
    assert msg.endswith("or pass --train.device cpu") and "\n" not in msg
    assert e.value.exit_code == EXIT_USER


def test_cuda_build_without_a_gpu(gpus):
    gpus(0)
    with pytest.raises(DeviceError, match=r"^--train.device cuda:0: torch finds no usable GPU"):
        check_device(_cfg(**{"train.device": "cuda:0"}))


def test_a_gpu_index_beyond_the_count(gpus):
    gpus(2)
    check_device(_cfg(**{"train.device": "cuda:1"}))
    with pytest.raises(
        DeviceError,
        match=r"^--train.device cuda:2: this machine has 2 GPUs \(cuda:0 to cuda:1\); pass "
        r"--train.device cuda:1 or a lower index$",
    ):
        check_device(_cfg(**{"train.device": "cuda:2"}))


def test_one_gpu_per_local_process(gpus, monkeypatch):
    gpus(2)
    check_device(_cfg(**{"train.device": "cuda"}))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun --nproc-per-node 4
    with pytest.raises(DeviceError, match=r"puts 4 processes on this machine, one GPU each, but "):
        check_device(_cfg(**{"train.device": "cuda"}))
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    dist = {"pipeline.engine": "distributed", "train.device": "cuda"}
    check_device(_cfg(**dist, **{"pipeline.num_stages": "2"}))
    with pytest.raises(DeviceError, match=r"start at most 2 per machine"):
        check_device(_cfg(**dist, **{"pipeline.num_stages": "3"}))


def _cuda_run(tmp_path, excerpt_data_dir, engine: str):
    """A cuda run of cpu-tiny named 'new' under tmp_path/runs (which does not exist yet)."""
    return _cfg(
        **{
            "name": "new",
            "out_dir": str(tmp_path / "runs"),
            "data.corpus": "excerpt",
            "data.data_dir": excerpt_data_dir,
            "train.device": "cuda",
            "pipeline.engine": engine,
        }
    )


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only torch build")
@pytest.mark.parametrize("engine", ["emulate", "distributed"])
def test_train_refuses_before_touching_the_run_directory(tmp_path, excerpt_data_dir, engine):
    from stalepipe.training.launch.train import launch_train
    from stalepipe.training.rundir.startup import StartUp
    from stalepipe.training.train.loop import train

    cfg = _cuda_run(tmp_path, excerpt_data_dir, engine)
    with pytest.raises(DeviceError):
        if engine == "emulate":
            train(cfg, overwrite=True, verbose=False)
        else:
            launch_train(cfg, StartUp(overwrite=True), verbose=False)
    assert not (tmp_path / "runs").exists()  # refused before the run directory was made


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only torch build")
def test_the_cli_prints_one_line_and_exits_2(tmp_path, excerpt_data_dir, capsys):
    """`main` here: `python -m stalepipe` exits with what it returns (`__main__.py`)."""
    from stalepipe.cli import main

    cfg = _cuda_run(tmp_path, excerpt_data_dir, "emulate")
    args = ["--preset", "cpu-tiny", "--train.device", "cuda", "--name", "new", "--overwrite"]
    args += [
        "--out_dir",
        cfg.out_dir,
        "--data.corpus",
        "excerpt",
        "--data.data_dir",
        excerpt_data_dir,
    ]
    assert main(["train", *args]) == EXIT_USER
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--train.device cuda: this torch build" in line and "--train.device cpu" in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_without_native_bf16_is_warned(monkeypatch, native):
    """The config cannot know the machine: a bf16 run on a CPU that emulates bf16 products
    (an AVX2 core: 6-8x slower than float32) hears it when it starts; one with them does not,
    nor does a float32 run or a CUDA one."""
    from stalepipe.training.train import devices

    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: native)
    (warned,) = devices.machine_warnings(_cfg(**{"train.dtype": "bfloat16"})) or [None]
    assert (warned is None) == native
    if not native:
        assert "train.dtype bfloat16" in warned and "--train.dtype float32" in warned
    assert devices.machine_warnings(_cfg()) == []
    assert (
        devices.machine_warnings(_cfg(**{"train.dtype": "bfloat16", "train.device": "cuda"})) == []
    )


def test_train_prints_the_machine_warning(tmp_path, excerpt_data_dir, monkeypatch, capsys):
    from stalepipe.training.train import devices
    from stalepipe.training.train.loop import train

    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: False)
    cfg = apply_overrides(
        get_preset("cpu-tiny"),
        {
            "train.dtype": "bfloat16",
            "train.num_steps": "1",
            "train.eval_every": "0",
            "train.num_eval_batches": "1",
            "out_dir": str(tmp_path / "runs"),
            "name": "bf16",
            "data.corpus": "excerpt",
            "data.data_dir": str(excerpt_data_dir),
        },
    )
    train(cfg, overwrite=True, verbose=True)
    assert "stalepipe: warning: train.dtype bfloat16 on a CPU without" in capsys.readouterr().err
