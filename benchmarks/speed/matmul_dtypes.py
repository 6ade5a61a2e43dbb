"""fp32 against bf16 on one CPU thread, at the study models' GEMM shapes and for a whole
training step (issue 55: the lead for a faster study step). What the CPU offers for bf16 is
printed first (torch's CPU capability, oneDNN's bf16 support, the cpuinfo flags that give
native bf16 products): without them torch's bf16 products fall back to slow scalar code.

GEMMs: each shape as `a @ b` and as a linear layer's forward `x @ W^T`, timed three times, the
dtypes interleaved, the median kept. Step: forward and backward of the study model (cpu-regime,
the overhead ladder's width 96; `--widths` adds rungs) on a fixed batch, as today's fp32 engine
runs it, under `train.dtype bfloat16` (autocast; fp32 weights) and with the weights held in
bf16 (the inner step of a bf16-weights / fp32-master setting); the three in turns, `--steps`
rounds after one warm-up, medians and the ratio to fp32's. A ratio is read side by side, so a
shared machine moves the contenders alike.

    OMP_NUM_THREADS=1 python benchmarks/speed/matmul_dtypes.py [--steps 4] [--widths 64 136]
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import parser, print_load, random_tokens, round_robin

# (k, n, m): a width-96 and a width-136 model's FFN GEMM at 16 x 128 tokens, and a square one
SHAPES = ((96, 256, 2048), (136, 384, 2048), (512, 512, 512))
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")


def bf16_support() -> str:
    """What this CPU offers bf16 products, as torch and /proc/cpuinfo say."""
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    native = [f for f in BF16_FLAGS if f in flags] or ["none"]
    onednn = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 "
        f"{'supported' if onednn else 'NOT supported'}, native bf16 flags: {' '.join(native)}"
    )


def gflops(dtype: torch.dtype, k: int, n: int, m: int, linear: bool) -> float:
    """GFLOP/s of an (m x k) by (k x n) product: `a @ b`, or `x @ W^T` with W (n x k), over
    as many repeats as fill ~0.2 s (a slow bf16 fallback gets fewer)."""
    a = torch.randn(m, k, dtype=dtype)
    b = torch.randn(n, k, dtype=dtype) if linear else torch.randn(k, n, dtype=dtype)

    def product():
        return torch.nn.functional.linear(a, b) if linear else a @ b

    t = time.perf_counter()
    product()
    reps = max(1, min(200, int(0.2 / (time.perf_counter() - t))))
    t = time.perf_counter()
    for _ in range(reps):
        product()
    return 2 * m * k * n * reps / (time.perf_counter() - t) / 1e9


def gemm_rows() -> None:
    for shape in SHAPES:
        for linear in (False, True):
            runs = [
                (gflops(torch.float32, *shape, linear), gflops(torch.bfloat16, *shape, linear))
                for _ in range(3)
            ]
            fp32, bf16 = (sorted(r[i] for r in runs)[1] for i in (0, 1))
            print(
                f"{shape} {'x @ W^T' if linear else 'a @ b  '}: fp32 {fp32:.1f} GFLOP/s, "
                f"bf16 {bf16:.1f} GFLOP/s, bf16/fp32 {bf16 / fp32:.2f}",
                flush=True,
            )


class Step:
    """Forward and backward of one model on a fixed batch, in one numerics."""

    def __init__(self, model: torch.nn.Module, batch, autocast: bool) -> None:
        self.model, self.batch, self.autocast = model, batch, autocast

    def timed(self) -> float:
        ctx = (
            torch.autocast("cpu", dtype=torch.bfloat16)
            if self.autocast
            else contextlib.nullcontext()
        )
        t0 = time.perf_counter()
        with ctx:
            loss = self.model(*self.batch)
        loss.float().backward()
        self.model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def step_rows(widths: list[int], steps: int) -> None:
    from benchmarks.speed.step_roofline import scale_config
    from stalepipe.training.models import build_model

    for width in [None, *widths]:
        cfg = scale_config(width, "adamw", "sync")
        batch = random_tokens(cfg, 0)
        fp32 = build_model(cfg.model, 0)
        runs = {
            "fp32": Step(fp32, batch, autocast=False),
            "autocast bf16": Step(fp32, batch, autocast=True),
            "bf16 weights": Step(copy.deepcopy(fp32).to(torch.bfloat16), batch, autocast=False),
        }
        times = round_robin(runs, lambda r, _: r.timed(), steps, 1)
        base = statistics.median(times["fp32"])
        label = "cpu-regime" if width is None else f"d{width}"
        shown = "  ".join(
            f"{name} {statistics.median(t) * 1e3:.0f} ms ({base / statistics.median(t):.2f}x)"
            for name, t in times.items()
        )
        print(f"{label:<11} forward+backward: {shown}", flush=True)


def main() -> None:
    ap = parser(__doc__, whole=True)
    ap.add_argument("--steps", type=int, default=4, help="rounds of the step contenders")
    ap.add_argument("--widths", type=int, nargs="*", default=[], help="overhead-ladder widths")
    ap.add_argument("--skip-step", action="store_true", help="only the GEMMs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print_load("before")
    print(f"torch {torch.__version__}, 1 thread; {bf16_support()}", flush=True)
    gemm_rows()
    if not args.skip_step:
        step_rows(args.widths, args.steps)
    print_load("after")


if __name__ == "__main__":
    main()
