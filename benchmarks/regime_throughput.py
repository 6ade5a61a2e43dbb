"""Runs per core-hour of a study scale (default `cpu-regime`), today and with cheap speed-ups.

Each variant trains the scale's base config (AdamW, sync, or `--policy`) for `--steps` steps
in this process on one thread, with the scale's own eval cadence scaled down to those steps;
the variants alternate over `--rounds` so that machine noise hits them alike. Printed per
variant: seconds per step (median over rounds, evals included), the ratio to the baseline,
whether the train losses equal the baseline's bit for bit (a speed-up must keep the numbers
exact), and the runs per core-hour that gives at the scale's full length.

    python benchmarks/regime_throughput.py [--scale cpu-regime] [--steps 60] [--rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import torch

from stalepipe.config import apply_overrides
from stalepipe.data import ensure_prepared
from stalepipe.experiments.studies import base_config
from stalepipe.train.loop import train
from stalepipe.train.metrics import read_metrics


def variants(full_steps: int, full_eval_every: int, steps: int) -> dict[str, dict[str, str]]:
    """name -> overrides. `baseline` is the study as configured: its eval cadence, per step."""
    every = max(steps * full_eval_every // full_steps, 1)
    return {
        "baseline": {"train.eval_every": str(every)},
        "evals only at the end": {"train.eval_every": "0"},
        "log every 50 steps": {"train.eval_every": str(every), "train.log_every": "50"},
        "torch.compile": {"train.eval_every": str(every), "train.compile": "true"},
    }


def time_variant(cfg, overrides: dict[str, str], steps: int, out_dir: str, tag: str):
    """Seconds per step (wall: start-up, compilation, evals and the checkpoint included), the
    loop's steady-state seconds per step (its last `tokens_per_s`) and the train losses."""
    run = apply_overrides(dataclasses.replace(cfg, name=tag, out_dir=out_dir), overrides)
    t0 = time.perf_counter()
    train(run, verbose=False)
    seconds = (time.perf_counter() - t0) / steps
    rows = read_metrics(f"{out_dir}/{tag}")
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    steady = run.train.batch_size * run.data.seq_len / tps[-1] if tps else float("nan")
    return seconds, steady, [r["loss"] for r in rows if "loss" in r]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scale", default="cpu-regime")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--policy", default="sync")
    p.add_argument("--optim", default="adamw")
    args = p.parse_args()
    torch.set_num_threads(1)
    full = base_config(args.scale)
    ensure_prepared(full.data)
    cfg = apply_overrides(
        full,
        {"train.num_steps": str(args.steps), "train.warmup_steps": str(max(args.steps // 10, 1)),
         "delay.policy": args.policy, "optim.name": args.optim, "train.progress": "false",
         "train.threads": "1", "train.ckpt_every_s": "0"},
    )  # fmt: skip
    table = variants(
        full.train.num_steps, full.train.eval_every or full.train.num_steps, args.steps
    )
    times: dict[str, list[float]] = {k: [] for k in table}
    steady: dict[str, list[float]] = {k: [] for k in table}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, o in table.items():
                s, st, loss = time_variant(cfg, o, args.steps, tmp, f"{name.replace(' ', '_')}_{r}")
                times[name].append(s)
                steady[name].append(st)
                losses.setdefault(name, loss)
    base = statistics.median(times["baseline"])
    print(f"{args.scale}: {args.optim} {args.policy}, {args.steps} steps x {args.rounds} rounds, "
          f"one thread; full run = {full.train.num_steps} steps")  # fmt: skip
    print("runs/core-h: a full run at the wall s/step; steady: the loop's own clock (after its "
          "first steps, evals and checkpoints left out), what compilation tends to")  # fmt: skip
    print(
        f"{'variant':<24} {'s/step':>8} {'steady':>8} {'vs base':>8} {'exact':>6} {'runs/core-h':>12}"
    )
    for name, ts in times.items():
        t = statistics.median(ts)
        exact = "yes" if losses[name] == losses["baseline"] else "NO"
        per_hour = 3600 / (t * full.train.num_steps)
        st = statistics.median(steady[name])
        print(f"{name:<24} {t:8.4f} {st:8.4f} {base / t:7.2f}x {exact:>6} {per_hour:12.1f}")


if __name__ == "__main__":
    main()
