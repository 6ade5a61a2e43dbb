"""Step time of the pipeline runtime against the timing simulator fed with measured costs.

    OMP_NUM_THREADS=1 python benchmarks/validation/validate_step_time.py \
        [--microbatches 2 4 8] [--repeats 3]

docs/verdict.md, 'Validation' (a). P=2 processes (gloo, one CPU thread each), the model and
microbatches of benchmarks/speed/pipeline_throughput.py (whose worker, `ours`, runs each
schedule and times every action). For 2bw, 1f1b and zb-h1 at each m, `--repeats` interleaved
rounds:

- measured: the timed window (the first forward of step `--warmup` to the last rank's end)
  over the timed steps; the median over the rounds and its range;
- predicted: `sim.timing` on a cost model of per-stage medians (forward, backward or BI, BW,
  the rank's update: pipeline_spans.measured_costs), the same timed steps from an empty
  pipeline, makespan / steps. `own`: each run's own medians; `pooled`: one cost model per
  round and m for the three schedules (per stage the median over them of F, of the whole
  backward and of the update; zb-h1's BI : BW split), what the verdict does with one set of
  costs; `mean`: each run's own means over the timed steps instead of medians (a diagnostic:
  a step is a sum of actions, and on a loaded machine the median action time is below the
  mean);
- replayed: the simulator with every action at the time it took (pipeline_replay.py): what the
  spread of action times adds to the medians' prediction. Not a prediction (circular); it
  tells a miss caused by that spread from time the runtime spends outside its actions.

Error = predicted / measured - 1; the goal is |error| <= 10 %. The load average is printed
before and after.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

from stalepipe.lab.sim.timing import CostModel, simulate, summarize
from stalepipe.training.launch.pool import WorkerPool
from stalepipe.training.schedules.generators import make_schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import interleaved_rounds, parser, print_load, timing_args
from benchmarks.speed.pipeline_replay import replayed
from benchmarks.speed.pipeline_spans import measured_costs, window
from benchmarks.speed.pipeline_throughput import P, add_shape_args, bench_model, ours

SCHEDULES = ("2bw", "1f1b", "zb-h1")
GOAL = 0.10


def pooled(models: list[CostModel]) -> CostModel:
    """One cost model for every schedule: per stage the median of the forwards, of the whole
    backwards (BI + BW) and of the updates; the BI : BW split of the models that split it."""
    med = statistics.median
    n = models[0].num_stages
    f = [med(c.forward[s] for c in models) for s in range(n)]
    u = [med(c.optimizer[s] for c in models) for s in range(n)]
    whole = [med(c.backward_input[s] + c.backward_weight[s] for c in models) for s in range(n)]
    split = [c for c in models if any(c.backward_weight)] or models
    share = [med(c.backward_input[s] / (c.backward_input[s] + c.backward_weight[s])
                 for c in split) for s in range(n)]  # fmt: skip
    bi = [w * x for w, x in zip(whole, share)]
    bw = [w - x for w, x in zip(whole, bi)]
    return dataclasses.replace(
        models[0], forward=tuple(f), backward_input=tuple(bi), backward_weight=tuple(bw),
        optimizer=tuple(u),
    )  # fmt: skip


def step_time(costs: CostModel, schedule: str, m: int, timed: int) -> float:
    """The simulator's makespan of `timed` steps from an empty pipeline, per step."""
    return summarize(simulate(make_schedule(schedule, P, m, timed), costs)).makespan / timed


def measure_round(reports: dict, m: int, steps: int, warm: int) -> dict:
    """Per schedule of one round: measured, predicted (own, pooled) and replayed step time."""
    timed = steps - warm
    costs = {k: measured_costs(reports[k]) for k in SCHEDULES}
    pool = pooled(list(costs.values()))
    out = {}
    for k in SCHEDULES:
        t0, t1 = window(reports[k])
        out[k] = {
            "measured": (t1 - t0) / timed,
            "own": step_time(costs[k], k, m, timed),
            "pooled": step_time(pool, k, m, timed),
            "mean": step_time(measured_costs(reports[k], mean_from=warm), k, m, timed),
            "replayed": replayed(reports[k], k, m, steps, warm).makespan / timed,
        }
    return out


def table(results: dict[int, list[dict]]) -> list[str]:
    """The validation table: one line per (schedule, m), step times in ms."""
    head = (f"{'schedule':<8}{'m':>3}{'measured ms [range]':>26}{'predicted':>11}{'error':>8}"
            f"{'<=10%':>7}{'pooled':>9}{'error':>8}{'mean':>8}{'error':>8}{'replayed':>10}")  # fmt: skip
    lines = [head]
    for m, rounds in results.items():
        for k in SCHEDULES:
            med = {f: statistics.median(r[k][f] for r in rounds) for f in rounds[0][k]}
            lo = min(r[k]["measured"] for r in rounds)
            hi = max(r[k]["measured"] for r in rounds)
            err = med["own"] / med["measured"] - 1
            perr = med["pooled"] / med["measured"] - 1
            merr = med["mean"] / med["measured"] - 1
            rng = f"{1e3 * med['measured']:.1f} [{1e3 * lo:.1f}-{1e3 * hi:.1f}]"
            lines.append(
                f"{k:<8}{m:>3}{rng:>26}{1e3 * med['own']:>11.1f}{100 * err:>+7.1f}%"
                f"{'yes' if abs(err) <= GOAL else 'NO':>7}{1e3 * med['pooled']:>9.1f}"
                f"{100 * perr:>+7.1f}%{1e3 * med['mean']:>8.1f}{100 * merr:>+7.1f}%"
                f"{1e3 * med['replayed']:>10.1f}"
            )
    return lines


def main() -> None:
    ap = parser(__doc__)
    add_shape_args(ap)
    timing_args(ap, repeats=3)
    args = ap.parse_args()
    cfg = bench_model(args.dim, args.layers, args.seq)
    print_load("before")
    results: dict[int, list[dict]] = {}
    pool = WorkerPool(P)
    try:
        for m in args.microbatches:
            common = (m, args.mb, args.seq, args.steps, args.warmup)

            def run(k: str, common=common):
                return pool.run(ours, (cfg, k, *common), P, timeout_s=900)

            rounds = interleaved_rounds(SCHEDULES, args.repeats, run)
            results[m] = [measure_round(r, m, args.steps, args.warmup) for r in rounds]
            print(f"m={m} done", flush=True)
    finally:
        pool.close()
    print(
        f"\nstep time, P={P}, {args.mb}x{args.seq} tokens per microbatch, "
        f"{args.steps - args.warmup} timed steps, medians of {args.repeats} interleaved rounds; "
        "predicted = sim.timing on per-stage medians (own run; pooled over the 3 schedules; "
        "own means); "
        "error = predicted / measured - 1"
    )
    print("\n".join(table(results)))
    print_load("after")


if __name__ == "__main__":
    main()
