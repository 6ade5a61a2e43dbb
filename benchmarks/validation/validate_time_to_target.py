"""Time to target, end to end: 2bw against 1f1b on the pipeline runtime, predicted against measured.

    OMP_NUM_THREADS=1 python benchmarks/validation/validate_time_to_target.py --out /tmp/ttt \\
        [--steps 200] [--microbatches 4] [--extend 1.25 1.5 2] [--repeats 3] [--reuse]

docs/verdict.md, 'Validation' (b). Trains, with `stalepipe train` on the pipeline runtime
(P=2, gloo, one CPU thread per process), the model of validate_step_time.py (byte vocabulary,
dim 256, 4 layers, untied, 8x64 tokens per microbatch) with AdamW (peak LR `--lr`), once with 1f1b (sync) and
once with 2bw, same seed, data and LR schedule; no clipping, as the timed benchmark. The target
is the 1f1b run's final val loss (analysis/targets.py). If the 2bw run does not reach it,
2bw is trained again at the next `--extend` multiple of the steps, the LR schedule stretched
(warmup scaled, as `stalepipe sweep --extend` plans it; evaluations as often as before).

- predicted time to target = T(L) / simulated tokens/s: T(L) the run's tokens to the target
  (`targets.seed_target`, interpolated between evals), the tokens/s from `sim.timing` on the
  per-stage medians of timed runs of the same model and m (pipeline_throughput's worker,
  pipeline_spans.measured_costs: validate_step_time.py's cost model), steady state, the
  median of at least `--repeats` rounds, one timed right after each training run;
  so predicted 2bw / 1f1b = token overhead / simulated throughput ratio, the verdict's ratio;
- measured time to target: the run's own training time to T(L), from metrics.jsonl: at each
  logged step, tokens / tokens_per_s (the runtime's steady rate since its third step,
  evaluations and checkpoints left out; the first three steps counted at that rate),
  interpolated at T(L).

Goal: predicted / measured within 15 % for both runs and for the ratio. The load average is
printed before and after.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

from stalepipe.config import ModelConfig
from stalepipe.lab.analysis.overhead import Curve, token_curve, tokens_to_reach
from stalepipe.lab.analysis.results import load_runs
from stalepipe.lab.analysis.targets import seed_target, target_losses
from stalepipe.lab.sim.timing import simulate, summarize
from stalepipe.training.launch.pool import WorkerPool
from stalepipe.training.rundir.metrics import read_metrics
from stalepipe.training.schedules.generators import make_schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import parser, print_load, timing_args
from benchmarks.speed.pipeline_spans import measured_costs
from benchmarks.speed.pipeline_throughput import P, ours

GOAL = 0.15
MODEL = {  # validate_step_time.py's model (pipeline_throughput.py's defaults)
    "model.vocab_size": 256,
    "model.dim": 256,
    "model.num_layers": 4,
    "model.num_heads": 8,
    "model.num_kv_heads": 4,
    "model.ffn_dim": 680,
    "model.max_seq_len": 64,
    "model.tie_embeddings": False,
}


def train(out: Path, name: str, schedule: str, steps: int, args, factor: float = 1.0) -> bool:
    """One `stalepipe train` run on the pipeline runtime, `factor` x the steps (and warmup);
    False if `--reuse` kept a finished one."""
    if args.reuse and any(r.name == name and r.status == "finished" for r in load_runs(out)):
        return False
    cmd = [sys.executable, "-m", "stalepipe", "train", "--preset", "cpu-small",
           *(f"--{k}={v}" for k, v in MODEL.items()),
           "--data.seq_len=64", f"--train.batch_size={8 * args.microbatches}",
           f"--train.num_microbatches={args.microbatches}",
           f"--train.num_steps={round(steps * factor)}",
           f"--train.warmup_steps={round(steps / 10 * factor)}",
           f"--train.eval_every={args.eval_every}", "--train.grad_clip=0",
           "--train.ckpt_every_s=0", "--optim.name=adamw", f"--optim.lr={args.lr}",
           "--pipeline.engine=distributed", f"--pipeline.num_stages={P}",
           f"--pipeline.schedule={schedule}", f"--delay.policy={'2bw' if schedule == '2bw' else 'sync'}",
           f"--out_dir={out}", f"--name={name}"]  # fmt: skip
    print(f"$ stalepipe train ... --pipeline.schedule {schedule} --train.num_steps "
          f"{round(steps * factor)} --name {name}", flush=True)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    return True


def time_curve(run_dir: Path) -> Curve:
    """(tokens, seconds of training) at every logged step with a rate (module doc)."""
    return [(r["tokens"], r["tokens"] / r["tokens_per_s"])
            for r in read_metrics(run_dir) if "tokens_per_s" in r]  # fmt: skip


def at(curve: Curve, x: float) -> float:
    """`curve` (increasing in its first coordinate) linearly interpolated at `x`."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise ValueError(f"{x} outside the curve's range {curve[0][0]}-{curve[-1][0]}")


def cost_round(pool: WorkerPool, model: ModelConfig, m: int, rates: dict[str, list[float]]) -> None:
    """One timed run of 1f1b and of 2bw (pipeline_throughput's worker, 24 timed steps); appends
    each one's steady-state tokens/s, simulated from its per-stage medians, to `rates`."""
    tokens, timed = m * 8 * 64, 24
    for k in ("1f1b", "2bw") if len(rates["1f1b"]) % 2 == 0 else ("2bw", "1f1b"):
        reports = pool.run(ours, (model, k, m, 8, 64, timed + 2, 2), P, timeout_s=900)
        sim = summarize(simulate(make_schedule(k, P, m, timed), measured_costs(reports)))
        rates[k].append(tokens / sim.step_time)


def train_arms(args, pool: WorkerPool, model: ModelConfig, rates: dict) -> dict[str, Curve]:
    """Train 1f1b, then 2bw at 1x and at each `--extend` multiple until it reaches 1f1b's final
    loss; the val curves (tokens, loss) by run name. The costs are timed right after each
    training run (`cost_round`): the shared machine's load drifts."""

    def curve(name: str) -> Curve:
        run = next(r for r in load_runs(args.out) if r.name == name)
        step_tokens = int(run.config["train.batch_size"]) * int(run.config["data.seq_len"])
        return token_curve(run.val_curve, step_tokens)

    if train(args.out, "1f1b", "1f1b", args.steps, args):
        cost_round(pool, model, args.microbatches, rates)
    curves = {"1f1b": curve("1f1b")}
    target = target_losses(curves["1f1b"])["final"]
    for factor in (1.0, *args.extend):
        name = "2bw" if factor == 1 else f"2bw_x{factor:g}"
        if train(args.out, name, "2bw", args.steps, args, factor):
            cost_round(pool, model, args.microbatches, rates)
        curves[name] = curve(name)
        if math.isfinite(tokens_to_reach(curves[name], target)):
            break
    return curves


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--out", type=Path, required=True, help="directory of the runs")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW's peak LR")
    ap.add_argument("--extend", type=float, nargs="*", default=[1.25, 1.5, 2.0])
    timing_args(ap, repeats=3)  # timed runs per schedule, for the costs
    ap.add_argument("--reuse", action="store_true", help="keep runs already under --out")
    args = ap.parse_args()
    print_load("before")
    model = ModelConfig(**{k.removeprefix("model."): v for k, v in MODEL.items()})
    rates: dict[str, list[float]] = {"1f1b": [], "2bw": []}
    pool = WorkerPool(P)
    try:
        curves = train_arms(args, pool, model, rates)
        while len(rates["1f1b"]) < args.repeats:
            cost_round(pool, model, args.microbatches, rates)
    finally:
        pool.close()
    sync = curves["1f1b"]
    target = target_losses(sync)["final"]
    delayed = {k: c for k, c in curves.items() if k != "1f1b"}
    step_tokens = 8 * args.microbatches * 64
    warmup_tokens = round(args.steps / 10) * step_tokens
    st = seed_target(0, sync, list(delayed.values()), target, warmup_tokens)
    tps = {k: statistics.median(v) for k, v in rates.items()}
    for k, v in rates.items():
        print(f"simulated {k}: {tps[k]:.0f} tokens/s (rounds: {', '.join(f'{x:.0f}' for x in v)})")
    print_load("after")
    if not math.isfinite(st.tokens_delayed):
        print(f"2bw did not reach 1f1b's final loss {target:.4f}: > {st.bound:.2f}x the tokens")
        return
    reached = next(k for k, c in delayed.items() if tokens_to_reach(c, target) == st.tokens_delayed)
    rows = {
        "1f1b": ("1f1b", st.tokens_sync, tps["1f1b"]),
        "2bw": (reached, st.tokens_delayed, tps["2bw"]),
    }
    print(
        f"\ntarget: 1f1b's final val loss {target:.4f} (P={P}, m={args.microbatches}, "
        f"{step_tokens} tokens per step, {args.steps} steps); token overhead of 2bw "
        f"{st.multiplier:.3f} ({reached}), simulated 2bw / 1f1b throughput "
        f"{tps['2bw'] / tps['1f1b']:.3f}"
    )
    print(f"{'schedule':<9}{'run':<10}{'tokens to L':>12}{'sim tok/s':>11}{'run tok/s':>11}"
          f"{'predicted s':>13}{'measured s':>12}{'pred/meas':>11}{'<=15%':>7}")  # fmt: skip
    pm = {}
    for k, (run, tokens, rate) in rows.items():
        pred, meas = tokens / rate, at(time_curve(args.out / run), tokens)
        pm[k] = (pred, meas)
        ok = "yes" if abs(pred / meas - 1) <= GOAL else "NO"
        print(f"{k:<9}{run:<10}{tokens:>12.0f}{rate:>11.0f}{tokens / meas:>11.0f}{pred:>13.1f}"
              f"{meas:>12.1f}{pred / meas:>11.3f}{ok:>7}")  # fmt: skip
    rp, rm = pm["2bw"][0] / pm["1f1b"][0], pm["2bw"][1] / pm["1f1b"][1]
    ok = "yes" if abs(rp / rm - 1) <= GOAL else "NO"
    print(f"{'2bw/1f1b':<9}{'':<10}{'':>34}{rp:>13.3f}{rm:>12.3f}{rp / rm:>11.3f}{ok:>7}")
    (args.out / "validation.json").write_text(json.dumps({"target": target, "rows": pm}))


if __name__ == "__main__":
    main()
