"""Tokens/s of stalepipe's training loop vs a minimal hand-written PyTorch loop.

Both train the same model on the same batches with AdamW, gradient clipping and the same
microbatching, in this one process, alternating rounds so that machine noise hits both alike.
The ratio is what matters (goal >= 0.95); absolute numbers depend on the machine.

    python benchmarks/speed/train_throughput.py [--preset cpu-small] [--steps 30] [--rounds 3]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from stalepipe.config import apply_overrides
from stalepipe.presets import get_preset
from stalepipe.training.data import TokenLoader, ensure_prepared
from stalepipe.training.models import build_model
from stalepipe.training.rundir.metrics import TIMING_WARMUP_STEPS, read_metrics
from stalepipe.training.train.loop import train

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import parser, pin_threads, timing_args


def hand_written(cfg, data_dir: str, steps: int) -> float:
    """The loop a researcher writes in ten minutes; returns tokens/s of `steps` steps after
    the warm-up steps the training loop leaves out of its own figure (TIMING_WARMUP_STEPS)."""
    tc = cfg.train
    loader = TokenLoader(data_dir, "train", cfg.data.seq_len, cfg.data.seed)
    model = build_model(cfg.model, tc.seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr or 1e-3, betas=(0.9, 0.95), weight_decay=0.1
    )
    m = tc.num_microbatches
    t0 = time.perf_counter()
    for step in range(TIMING_WARMUP_STEPS + steps):
        if step == TIMING_WARMUP_STEPS:
            t0 = time.perf_counter()
        x, y = loader.batch(step, tc.batch_size)
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            (model(xm, ym) / m).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * tc.batch_size * cfg.data.seq_len / (time.perf_counter() - t0)


def stalepipe_loop(cfg, steps: int, out_dir: str, round_: int) -> float:
    """stalepipe's `train` with logging, the delay engine (sync) and metrics; returns tokens/s
    as the loop measures it: `steps` steps after its warm-up, evaluations and checkpoints left
    out."""
    run = dataclasses.replace(cfg, name=f"bench{round_}", out_dir=out_dir)
    run = apply_overrides(
        run,
        {
            "train.num_steps": str(TIMING_WARMUP_STEPS + steps),
            "train.log_every": str(TIMING_WARMUP_STEPS + steps),
            "train.eval_every": "0",
            "train.progress": "false",
        },
    )
    train(run, verbose=False)
    return read_metrics(f"{out_dir}/bench{round_}")[-1]["tokens_per_s"]


def main() -> None:
    ap = parser(__doc__, whole=True)
    ap.add_argument("--preset", default="cpu-small")
    timing_args(ap, steps=30, rounds=3, threads=0)
    args = ap.parse_args()
    threads = pin_threads(args.threads)
    cfg = get_preset(args.preset)
    data_dir = str(ensure_prepared(cfg.data))
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            theirs.append(hand_written(cfg, data_dir, args.steps))
            ours.append(stalepipe_loop(cfg, args.steps, tmp, r))
    mo, mt = statistics.median(ours), statistics.median(theirs)
    print(
        f"preset {args.preset}, {args.steps} steps x {args.rounds} rounds, "
        f"batch {cfg.train.batch_size} x seq {cfg.data.seq_len}, threads {threads}"
    )
    print(f"{'loop':<22}{'tokens/s (median)':>20}{'rounds':>40}")
    print(f"{'hand-written PyTorch':<22}{mt:>20,.0f}{str([round(t) for t in theirs]):>40}")
    print(f"{'stalepipe train':<22}{mo:>20,.0f}{str([round(t) for t in ours]):>40}")
    print(f"ratio stalepipe / hand-written: {mo / mt:.3f}  (goal >= 0.95)")


if __name__ == "__main__":
    main()
