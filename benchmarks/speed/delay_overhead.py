"""Delay-engine overhead: step time and memory of sync vs 2bw, EF, pipedream(P=4) and every corrector.

Run: OMP_NUM_THREADS=1 python benchmarks/speed/delay_overhead.py [--preset cpu-small] [--steps 12]

Timing: all contenders live in one process and take turns step by step (round robin), so
machine noise hits them alike; ratios are medians over rounds of paired ratios (the two
steps of a round ran back to back), to sync and to the same policy without the corrector.
Memory: each contender also runs alone in a fresh subprocess; we report its peak RSS and the
bytes the engine holds beyond the model and optimizer (stored weight versions, EF buffer,
Taylor's EMA of g^2, weight prediction's predicted point), in units of one copy of the
parameters: "copies" between steps, "peak copies" while the gradient is computed (weight
prediction's point lives then). Goals (issues 4, 15): <= 1.05x the step time of the same policy without the
corrector; extra memory what docs/delay.md states: one copy per stored version, +1 for EF, +1
for DC-ASGD-EMA, +1 stored version and +1 predicted point per stale stage for weight
prediction, nothing for the PipeMare LR schedule and adaptive momentum.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import (
    paired_ratios,
    parser,
    pin_threads,
    proc_status_kb,
    random_tokens,
    round_robin,
    timing_args,
)

CONTENDERS = {
    "sync": ({"policy": "sync"}, 4),
    "2bw": ({"policy": "2bw"}, 4),
    "2bw+ef": ({"policy": "2bw", "ef": True}, 4),
    "pipedream": ({"policy": "pipedream"}, 4),
    "2bw+wp": ({"policy": "2bw", "weight_pred": True}, 4),
    "pd+wp": ({"policy": "pipedream", "weight_pred": True}, 4),
    "2bw+dc-ema": ({"policy": "2bw", "taylor": 0.1, "taylor_curvature": "ema"}, 4),
    "pd+lr": ({"policy": "pipedream", "lr_correction_steps": 100}, 4),
    "2bw+am": ({"policy": "2bw", "adaptive_momentum": True}, 4),
    "pd+am": ({"policy": "pipedream", "adaptive_momentum": True}, 4),
}
# "time/base": each "<policy>+<corrector>" against "<policy>" (pd = pipedream) in the same run


def build(name: str, preset: str):
    from stalepipe.config import DelayConfig
    from stalepipe.presets import get_preset
    from stalepipe.training.delay import DelayEmulator
    from stalepipe.training.models import build_model

    cfg = get_preset(preset)
    delay, P = CONTENDERS[name]
    model = build_model(cfg.model, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    engine = DelayEmulator(model, opt, DelayConfig(**delay), P, 10**6, seq_len=cfg.data.seq_len)
    return cfg, model, engine


def batch(cfg, k: int):
    return [random_tokens(cfg, k)]


def one_step(cfg, engine, k: int) -> float:
    t = time.perf_counter()
    engine.forward_backward(k, batch(cfg, k))
    engine.clip_grad_norm_(1.0)
    engine.step(k)
    return time.perf_counter() - t


def paired(times: list[float], base: list[float]) -> float:
    """Median over rounds of the step time over the base's step time in the same round: the
    two ran back to back, so load that drifts over the run cancels."""
    return statistics.median(paired_ratios(times, base))


def engine_bytes(engine) -> int:
    d = engine.delayed
    n = sum(t.numel() * t.element_size() for h in d._history for ts in h.values() for t in ts)
    for bufs in (d._ef_prev, d._taylor_ms):
        if bufs is not None:
            n += sum(t.numel() * t.element_size() for ts in bufs for t in ts)
    for cache in d._predicted:
        n += sum(t.numel() * t.element_size() for ts in cache.values() for t in ts)
    return n


def memory_child(name: str, preset: str, steps: int) -> None:
    pin_threads(1)
    cfg, model, engine = build(name, preset)
    peak = 0
    for k in range(steps):
        engine.forward_backward(k, batch(cfg, k))
        peak = max(peak, engine_bytes(engine))  # weight prediction's point is alive here
        engine.clip_grad_norm_(1.0)
        engine.step(k)
    rest = engine_bytes(engine)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    out = {"rss_kb": proc_status_kb("VmHWM"), "engine_bytes": rest, "peak_bytes": max(peak, rest)}
    print(json.dumps({**out, "param_bytes": params}))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--preset", default="cpu-small")
    timing_args(ap, steps=12, warmup=3)  # timed steps after the warm-up ones
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        memory_child(args.child, args.preset, args.warmup + 2)
        return

    pin_threads(1)
    built = {name: build(name, args.preset) for name in CONTENDERS}
    times = round_robin(built, lambda c, k: one_step(c[0], c[2], k), args.steps, args.warmup)
    mem = {}
    for name in CONTENDERS:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--preset",
                args.preset,
                "--warmup",
                str(args.warmup),
                "--child",
                name,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        mem[name] = json.loads(out.stdout.strip().splitlines()[-1])

    base_rss = mem["sync"]["rss_kb"]
    pb = mem["sync"]["param_bytes"]
    print(
        f"preset {args.preset}: {pb / 4 / 1e6:.2f}M params, {args.steps} timed steps each, 1 thread"
    )
    print(
        f"{'contender':<11} {'P':>2} {'step ms':>8} {'time/sync':>9} {'time/base':>9} {'peak RSS MB':>11} {'RSS-sync MB':>11} {'engine MB':>9} {'copies':>6} {'peak copies':>11}"
    )
    for name, (_, P) in CONTENDERS.items():
        t = statistics.median(times[name])
        base = name.split("+")[0].replace("pd", "pipedream") if "+" in name else None
        vs = f"{paired(times[name], times[base]):.3f}x" if base else "-"
        m = mem[name]
        print(
            f"{name:<11} {P:>2} {t * 1e3:>8.1f} {paired(times[name], times['sync']):>8.3f}x "
            f"{vs:>9} "
            f"{m['rss_kb'] / 1024:>11.1f} "
            f"{(m['rss_kb'] - base_rss) / 1024:>11.1f} {m['engine_bytes'] / 2**20:>9.1f} "
            f"{m['engine_bytes'] / pb:>6.2f} {m['peak_bytes'] / pb:>11.2f}"
        )


if __name__ == "__main__":
    main()
