"""Runs per core-hour of a study scale (default `cpu-regime`), today and with cheap speed-ups.

Each variant trains the scale's base config (AdamW, sync, or `--optim` / `--policy`) for
`--steps` steps in this process on one thread; the variants alternate over `--rounds` so that
machine noise hits them alike. A full run is then modelled from what was measured: the loop's
steady-state seconds per step (its own clock: evals and checkpoints left out) x the full
length, plus the scale's evaluations at the measured cost of one, plus the fixed cost
(start-up, compilation, the final evaluation and checkpoint). Printed per variant: that
model's seconds per full run, runs per core-hour, the speed-up over the study as configured,
and whether the train losses equal the baseline's bit for bit (a speed-up must keep the
numbers exact; fewer evaluations do by construction: evaluation draws no random numbers).

    python benchmarks/speed/regime_throughput.py [--scale cpu-regime] [--steps 30] [--rounds 2]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

from stalepipe.config import apply_overrides
from stalepipe.lab.studies.scales import base_config
from stalepipe.training.data import ensure_prepared
from stalepipe.training.rundir.metrics import read_metrics
from stalepipe.training.train.loop import train

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import parser, pin_threads, timing_args


def variants(steps: int) -> dict[str, dict[str, str]]:
    """name -> overrides for the short benchmark runs (four evaluations where evals are on)."""
    every = str(max(steps // 4, 1))
    return {
        "baseline": {"train.eval_every": every},
        "evals only at the end": {"train.eval_every": "0"},
        "log every 50 steps": {"train.eval_every": every, "train.log_every": "50"},
        "torch.compile": {"train.eval_every": every, "train.compile": "true"},
    }


def time_variant(cfg, overrides: dict[str, str], steps: int, out_dir: str, tag: str):
    """Wall seconds of the run (start-up, compilation, evals and the checkpoint included), the
    loop's steady-state seconds per step (its last `tokens_per_s`), the number of evaluations
    and the train losses."""
    run = apply_overrides(dataclasses.replace(cfg, name=tag, out_dir=out_dir), overrides)
    t0 = time.perf_counter()
    train(run, verbose=False)
    seconds = time.perf_counter() - t0
    rows = read_metrics(f"{out_dir}/{tag}")
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    steady = run.train.batch_size * run.data.seq_len / tps[-1] if tps else float("nan")
    evals = sum("val_loss" in r for r in rows)
    return seconds, steady, evals, [r["loss"] for r in rows if "loss" in r]


def main() -> None:
    p = parser(__doc__, whole=True)
    p.add_argument("--scale", default="cpu-regime")
    timing_args(p, steps=60, rounds=2)
    p.add_argument("--policy", default="sync")
    p.add_argument("--optim", default="adamw")
    args = p.parse_args()
    pin_threads(1)
    full = base_config(args.scale)
    ensure_prepared(full.data)
    cfg = apply_overrides(
        full,
        {"train.num_steps": str(args.steps), "train.warmup_steps": str(max(args.steps // 10, 1)),
         "delay.policy": args.policy, "optim.name": args.optim, "train.progress": "false",
         "train.threads": "1", "train.ckpt_every_s": "0"},
    )  # fmt: skip
    table = variants(args.steps)
    wall: dict[str, list[float]] = {k: [] for k in table}
    steady: dict[str, list[float]] = {k: [] for k in table}
    evals: dict[str, int] = {}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, o in table.items():
                tag = f"{name.replace(' ', '_').replace('.', '')}_{r}"
                w, st, n, loss = time_variant(cfg, o, args.steps, tmp, tag)
                wall[name].append(w)
                steady[name].append(st)
                evals[name] = n
                losses.setdefault(name, loss)
    report(args, full, wall, steady, evals, losses)


def report(args, full, wall, steady, evals, losses) -> None:
    """The full-run model (module docstring) per variant, and one derived row: half the evals."""
    med = {k: statistics.median(v) for k, v in wall.items()}
    st = {k: statistics.median(v) for k, v in steady.items()}
    per_eval = (med["baseline"] - med["evals only at the end"]) / max(evals["baseline"] - 1, 1)
    full_evals = full.train.num_steps // (full.train.eval_every or full.train.num_steps)

    def full_run(name: str, n_evals: int) -> float:
        fixed = med[name] - args.steps * st[name] - (evals[name] - 1) * per_eval
        return fixed + full.train.num_steps * st[name] + (n_evals - 1) * per_eval

    rows = [(n, full_run(n, 1 if n == "evals only at the end" else full_evals)) for n in med]
    rows.insert(1, (f"{full_evals // 2} evals (derived)", full_run("baseline", full_evals // 2)))
    base = rows[0][1]
    print(
        f"{args.scale}: {args.optim} {args.policy}, {args.steps} steps x {args.rounds} rounds, one "
        f"thread; full run {full.train.num_steps} steps, {full_evals} evals; one eval "
        f"{per_eval:.2f} s, steady {st['baseline']:.4f} s/step"
    )
    print(f"{'variant':<24} {'steady s/step':>13} {'full run s':>10} {'runs/core-h':>11} "
          f"{'speed-up':>8} {'exact':>5}")  # fmt: skip
    for name, seconds in rows:
        key = "baseline" if name.endswith("(derived)") else name
        exact = "yes" if losses[key] == losses["baseline"] else "NO"
        print(f"{name:<24} {st[key]:13.4f} {seconds:10.0f} {3600 / seconds:11.1f} "
              f"{base / seconds:7.2f}x {exact:>5}")  # fmt: skip


if __name__ == "__main__":
    main()
