"""Can this machine run the device a config asks for? Checked before anything is written.

The config stays hardware-independent (sweeps are planned on machines without the GPUs that
run them), so `train.device` is only checked against the machine here, when a run starts: a
CUDA request on a torch build without CUDA, on a machine without a visible GPU, or for more
GPUs than there are, is one line naming the fix instead of a traceback from deep inside the
first step, and it comes before the run directory is opened (so `--overwrite` deletes nothing).
"""

from __future__ import annotations

import os

import torch

from stalepipe.config import ExperimentConfig
from stalepipe.errors import UserError
from stalepipe.hardware import peak_bf16_flops


class DeviceError(UserError):
    """The device the config asks for does not exist on this machine."""


def check_device(cfg: ExperimentConfig) -> None:
    """Raise DeviceError (one line, with the fix) unless this process can use `train.device`.

    Counts the GPUs this machine's processes of the run need: one per local process for
    `cuda` under torchrun or on the distributed engine (rank r uses `cuda:<local rank>`),
    index N + 1 for `cuda:N`. Call it first thing, before data is prepared or the run
    directory is opened; a CPU run passes without touching CUDA."""
    check_cuda(cfg.train.device, "--train.device", local_processes(cfg))


def machine_warnings(cfg: ExperimentConfig) -> list[str]:
    """What this machine makes of the config that the config alone cannot say (it stays
    hardware-independent): `train.dtype bfloat16` on a CPU without native bf16 products, where
    torch falls back to slow code (a study step 6-8x slower than float32 on an AVX2 core;
    docs/benchmarks.md, 'Study step speed'). Printed beside `cfg.warnings()` when a run starts."""
    tc = cfg.train
    if tc.dtype != "bfloat16" or tc.device.startswith("cuda") or cpu_has_bf16():
        return []
    return [
        f"train.dtype bfloat16 on a CPU without native bf16 products (torch's CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, no oneDNN bf16): torch falls back to slow "
        "code, a step several times slower than float32 (6-8x measured on an AVX2 core; "
        "docs/benchmarks.md, 'Study step speed'); --train.dtype float32 is faster here"
    ]


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (oneDNN's own check: AVX512-BF16, AMX, or
    AVX-NE-CONVERT)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def check_cuda(device: str, flag: str, local: int = 1) -> None:
    """`check_device` of a device string given as `flag` (`--train.device`, or `stalepipe
    eval --device`), for `local` processes on this machine; a CPU device passes."""
    if not device.startswith("cuda"):
        return
    named = f"{flag} {device}"
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            why = f"this torch build ({torch.__version__}) has no CUDA support"
            fix = "install a CUDA build of torch (README, Running at scale)"
        else:
            why = (
                "torch finds no usable GPU (no device, no driver, or CUDA_VISIBLE_DEVICES hides it)"
            )
            fix = "run on a machine with a GPU (check nvidia-smi)"
        raise DeviceError(f"{named}: {why}; {fix}, or pass {flag} cpu")
    count = torch.cuda.device_count()
    have = f"this machine has {count} GPU{'s' if count != 1 else ''}"
    if ":" in device:
        index = int(device.split(":", 1)[1])
        if index >= count:
            raise DeviceError(
                f"{named}: {have} (cuda:0 to cuda:{count - 1}); pass {flag} cuda:{count - 1} "
                f"or a lower index"
            )
        return
    if local > count:
        raise DeviceError(
            f"{named}: this run puts {local} processes on this machine, one GPU each, but {have}; "
            f"start at most {count} per machine (torchrun --nproc-per-node {count}, or fewer "
            f"pipeline.num_stages x pipeline.num_replicas)"
        )


def local_processes(cfg: ExperimentConfig) -> int:
    """How many of the run's processes share this machine: torchrun's LOCAL_WORLD_SIZE, else
    every rank of the distributed engine (its launcher spawns them here), else one."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if cfg.pipeline.engine == "distributed":
        return cfg.pipeline.num_processes
    return 1


def set_tf32(enabled: bool, device: torch.device) -> None:
    """Apply the run's TF32 policy (`train.tf32`), the one both engines set before their first
    kernel: on CUDA, fp32 matmuls and cuDNN convolutions may run in TF32 when `enabled`, in full
    fp32 otherwise (whatever the process inherited). Nothing on CPU (no TF32 there, and CPU
    runs stay bitwise across engines). Optimizer math that needs full fp32 whatever this says
    (SOAP's projections and eigenbases) turns TF32 off around itself (`optim.soap`).

    torch's legacy flags, not its `fp32_precision` settings: torch refuses a mix of the two,
    and torch.compile reads the legacy ones."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def peak_flops(device: torch.device, world_size: int = 1) -> float:
    """Dense bf16 peak FLOP/s of `world_size` GPUs like `device` (the MFU denominator): 0 on
    CPU and for a GPU not in `sim.devices.PEAK_BF16_FLOPS` (no MFU rather than a wrong
    one)."""
    if device.type != "cuda":
        return 0.0
    return (peak_bf16_flops(torch.cuda.get_device_name(device)) or 0.0) * world_size
