"""Time of one optimizer step for each registered optimizer, relative to AdamW, on cpu-small.

One process, one model, one fixed set of gradients: every optimizer is timed on the same
gradients, interleaved round-robin over several rounds (machines here are shared and noisy), and
the median per-step time is reported. A forward+backward pass of one batch is timed too, to put
the optimizer cost in proportion. Default hyperparameters; the numbers are step costs, not
training quality.

    OMP_NUM_THREADS=1 python benchmarks/speed/optimizer_step.py \
        [--rounds 5] [--steps 5] [--threads 1]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from stalepipe.config import OptimConfig
from stalepipe.presets import cpu_small
from stalepipe.training.models import build_model, count_params
from stalepipe.training.optim import OPTIMIZERS, build_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import parser, pin_threads, random_tokens, timing_args


def main() -> None:
    ap = parser(__doc__)
    timing_args(ap, rounds=5, steps=5, threads=1)  # steps: optimizer steps timed per round
    args = ap.parse_args()
    pin_threads(args.threads)

    cfg = cpu_small()
    model = build_model(cfg.model, seed=0)
    x, y = random_tokens(cfg, 0)

    fwd_bwd = []
    model(x, y).backward()  # warm-up, untimed (first-call allocations)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(x, y).backward()
        fwd_bwd.append(time.perf_counter() - t0)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    # one model copy per optimizer so that every one steps from the same weights and gradients
    runs = {}
    for name in OPTIMIZERS:
        m = build_model(cfg.model, seed=0)
        for n, p in m.named_parameters():
            p.grad = grads[n].clone()
        runs[name] = (m, build_optimizer(OptimConfig(name=name), m.named_parameters()))
        runs[name][1].step()  # warm-up (allocates state; SOAP's first call only collects stats)

    times: dict[str, list[float]] = {name: [] for name in OPTIMIZERS}
    for _ in range(args.rounds):
        for name, (_, opt) in runs.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            times[name].append((time.perf_counter() - t0) / args.steps)

    med = {name: statistics.median(ts) for name, ts in times.items()}
    fb = statistics.median(fwd_bwd)
    n_params = count_params(cfg.model)
    print(
        f"cpu-small: {n_params['total'] / 1e6:.2f}M params, batch {cfg.train.batch_size}x"
        f"{cfg.data.seq_len}, {args.threads} thread(s); forward+backward {fb * 1e3:.1f} ms"
    )
    print(f"{'optimizer':<10} {'step ms':>9} {'vs adamw':>9} {'vs fwd+bwd':>11}")
    for name, t in med.items():
        print(f"{name:<10} {t * 1e3:>9.2f} {t / med['adamw']:>8.2f}x {t / fb:>10.2f}x")


if __name__ == "__main__":
    main()
