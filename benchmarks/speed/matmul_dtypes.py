"""fp32 against bf16 matmul on one CPU thread at the study models' GEMM shapes (issue 55: the
lead for a faster study step). Each shape is timed three times, the dtypes interleaved, and the
median kept; a ratio is read side by side, so a shared machine moves both alike.

    OMP_NUM_THREADS=1 python benchmarks/speed/matmul_dtypes.py
"""

from __future__ import annotations

import time

import torch

# (k, n, m): a width-96 and a width-136 model's FFN GEMM at 16 x 128 tokens, and a square one
SHAPES = ((96, 256, 2048), (136, 384, 2048), (512, 512, 512))


def gflops(dtype: torch.dtype, k: int, n: int, m: int, reps: int = 200) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(10):
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.perf_counter() - t) / 1e9


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for shape in SHAPES:
        runs = [(gflops(torch.float32, *shape), gflops(torch.bfloat16, *shape)) for _ in range(3)]
        fp32, bf16 = (sorted(r[i] for r in runs)[1] for i in (0, 1))
        print(
            f"{shape}: fp32 {fp32:.1f} GFLOP/s, bf16 {bf16:.1f} GFLOP/s, bf16/fp32 {bf16 / fp32:.2f}"
        )


if __name__ == "__main__":
    main()
