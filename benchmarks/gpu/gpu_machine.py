"""The machine side of benchmarks/gpu/gpu_check.py: what the check needs installed (and the wheels
to bring to an offline machine when something is missing), the checks before any run (torch,
CUDA, packages), where the runs go, and the machine as the results describe it."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

# What the check imports besides torch (stalepipe's data path: the packaged excerpt, GPT-2's
# tokenizer through tiktoken from the vocabulary files stalepipe ships; the loader's memmaps;
# progress).
# module -> (pip requirement, pure Python: one wheel fits every platform)
NEEDED = {
    "numpy": ("numpy>=1.26", False),
    "tqdm": ("tqdm>=4.66", True),
    "tiktoken": ("tiktoken>=0.7", False),
    "regex": ("regex", False),  # tiktoken's
}
SITE = ".gpu_check_site"  # where the brought wheels go (gpu_check.sh puts it on PYTHONPATH)


def missing_packages() -> list[str]:
    """The modules of NEEDED this Python cannot import (looked up, not imported)."""
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


def wheel_commands(missing: list[str]) -> str:
    """How to bring the wheels of `missing` to an offline machine like this one."""
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    arch = platform.machine() or "x86_64"
    reqs = " ".join(NEEDED[m][0] for m in missing)
    platforms = f"--platform manylinux2014_{arch} --platform manylinux_2_28_{arch}"
    return (
        f"on a machine with network access (any OS):\n"
        f"  pip download --no-deps --only-binary=:all: --python-version {pyver} {platforms} "
        f"-d stalepipe-wheels {reqs}\n"
        f"copy stalepipe-wheels/ into this checkout, then here:\n"
        f"  {Path(sys.executable).name} -m pip install --no-index --no-deps --target {SITE} "
        f"stalepipe-wheels/*.whl\n"
        f"and run benchmarks/gpu/gpu_check.sh again (it puts {SITE} on PYTHONPATH)"
    )


def preflight(cpu_smoke: bool) -> int | None:
    """None when the check can run here; else its exit status, its one line printed: 1 without
    torch or (unless `cpu_smoke`) without CUDA, 2 when a package is missing."""
    if importlib.util.find_spec("torch") is None:
        print(
            f"gpu_check: {sys.executable} has no torch; run it with the Python of the GPU "
            f"machine's own CUDA PyTorch (PYTHON=... benchmarks/gpu/gpu_check.sh)",
            file=sys.stderr,
        )
        return 1
    import torch

    if not cpu_smoke and not torch.cuda.is_available():
        why = (
            "this torch build has no CUDA"
            if torch.version.cuda is None
            else "torch finds no GPU (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
        )
        print(
            f"gpu_check: no CUDA device: {why} (torch {torch.__version__} from "
            f"{Path(torch.__file__).parent}); run it with the GPU machine's own CUDA PyTorch, "
            f"or pass --cpu-smoke for the reduced CPU run",
            file=sys.stderr,
        )
        return 1
    if missing := missing_packages():
        print(
            f"gpu_check: missing Python packages: {', '.join(NEEDED[m][0] for m in missing)}; "
            f"{wheel_commands(missing)}",
            file=sys.stderr,
        )
        return 2
    return None


def scratch() -> str | None:
    """Where the runs go: memory (/dev/shm) when it has room for a few 135M-parameter
    checkpoints (a container's is often 64 MB), else the default temporary directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 24 * 2**30:
        return str(shm)
    return None


def describe_machine(cuda: bool) -> dict[str, Any]:
    import torch

    from stalepipe.hardware import peak_bf16_flops

    name = torch.cuda.get_device_name() if cuda else "cpu"
    return {
        "device": name,
        "num_gpus": torch.cuda.device_count() if cuda else 0,
        "peak_bf16_flops": peak_bf16_flops(name) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
    }
