"""Emulator speed-ups on CPU: torch.compile on/off, and data-parallel scaling at 2 processes.

1. compile: tokens/s of the delay emulator's step (2bw + EF) on the CPU demo model with and
   without `torch.compile`, measured after the compile warm-up, in this one process.
2. data parallel: tokens/s of `stalepipe train` under torchrun with 1 and with 2 processes (one
   thread each) for the same global batch; efficiency = tps(2) / (2 * tps(1)).

    python benchmarks/speed/emulator_scaling.py [--preset cpu-tiny] [--steps 40]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stalepipe.config import DelayConfig
from stalepipe.presets import get_preset
from stalepipe.training.data import TokenLoader, ensure_prepared
from stalepipe.training.delay import DelayEmulator
from stalepipe.training.models import build_model
from stalepipe.training.optim import build_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import parser, pin_threads, timing_args


def emulator_tps(cfg, data_dir: str, steps: int, warmup: int, compile_: bool) -> float:
    model = build_model(cfg.model, 0)
    if compile_:
        model.compile()
    opt = build_optimizer(cfg.optim, model.named_parameters())
    engine = DelayEmulator(model, opt, DelayConfig(policy="2bw", ef=True), 2, warmup + steps)
    loader = TokenLoader(data_dir, "train", cfg.data.seq_len, 0)
    m, bs = cfg.train.num_microbatches, cfg.train.batch_size
    t0 = 0.0
    for k in range(warmup + steps):
        if k == warmup:
            t0 = time.perf_counter()
        x, y = loader.batch(k, bs)
        engine.forward_backward(k, list(zip(x.chunk(m), y.chunk(m))))
        engine.step(k)
    return steps * bs * cfg.data.seq_len / (time.perf_counter() - t0)


def torchrun_tps(preset: str, nproc: int, steps: int, out: str) -> float:
    name = f"dp{nproc}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "stalepipe",
        "train",
        "--preset",
        preset,
        "--name",
        name,
        "--out_dir",
        out,
        "--train.num_steps",
        str(steps),
        "--train.log_every",
        str(steps),
        "--train.eval_every",
        "0",
        "--train.num_eval_batches",
        "2",
        "--train.num_microbatches",
        "2",
        "--train.progress",
        "false",
    ]
    subprocess.run(
        cmd,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        timeout=1800,
    )
    lines = Path(out, name, "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if "tokens_per_s" in x][-1]["tokens_per_s"]


def main() -> None:
    ap = parser(__doc__, whole=True)
    ap.add_argument("--preset", default="cpu-tiny")
    timing_args(ap, steps=40)
    ap.add_argument("--skip-compile", action="store_true")
    args = ap.parse_args()
    pin_threads(1)
    cfg = get_preset(args.preset)
    data_dir = str(ensure_prepared(cfg.data))
    print(f"preset {args.preset}, batch {cfg.train.batch_size} x seq {cfg.data.seq_len}, 1 thread")
    if not args.skip_compile:
        eager = emulator_tps(cfg, data_dir, args.steps, 3, False)
        compiled = emulator_tps(cfg, data_dir, args.steps, 3, True)
        print(f"{'emulator 2bw+EF':<24}{'tokens/s':>12}")
        print(f"{'  eager':<24}{eager:>12,.0f}")
        print(f"{'  torch.compile':<24}{compiled:>12,.0f}")
        print(f"compile speed-up: {compiled / eager:.3f}x")
    with tempfile.TemporaryDirectory() as tmp:
        one = torchrun_tps(args.preset, 1, args.steps, tmp)
        two = torchrun_tps(args.preset, 2, args.steps, tmp)
    print(f"{'data parallel':<24}{'tokens/s':>12}")
    print(f"{'  1 process':<24}{one:>12,.0f}")
    print(f"{'  2 processes':<24}{two:>12,.0f}")
    print(f"scaling efficiency at 2 processes: {two / (2 * one):.3f}")


if __name__ == "__main__":
    main()
