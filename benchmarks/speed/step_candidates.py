"""What buys a study step speed: today's eager step against `train.compile`, and the most that
batching several seeds into one model (torch.func / vmap over stacked parameters) could give.

Per scale (cpu-regime and the overhead ladder's widths, as `step_roofline.py` builds them),
every (optimizer, arm, eager | compiled) contender trains in this process on one thread, the
contenders in turns step by step (the machine is shared: ratios are read side by side). Printed
per (optimizer, arm): the median steady step times, eager and compiled, their ratio read per
round (median [range]) and of the two fastest steps (the least disturbed by other jobs on a
shared machine), whether the compiled train losses equal eager's bit for bit, and the last
train loss of each (after the warm-up and timed steps on the fixed batch: what the setting
does to the loss, beside what it does to the time); per
scale, the pooled ratio and runs per core-hour of a full run of the scale (its steps x the
steady step time, plus the compilation: the first `--warmup` steps and one evaluation forward
beyond their steady cost, measured on the scale's first compiled contender, which every run
pays in its own process; evaluations and checkpoints otherwise left out). Each scale starts
from a reset dynamo (one shape per process, as in a run); inductor's on-disk cache may already
hold the graphs (said in the output).

The batching bound: one eager model trains a batch of S x 16 sequences; its time per 16
sequences against the 16-sequence step is the most S seeds trained as one batched model could
save (a vmapped model runs the same kernels on the same number of rows, plus the stacking).

    OMP_NUM_THREADS=1 python benchmarks/speed/step_candidates.py [--steps 5] [--warmup 3]
        [--widths 48 64 136] [--skip-regime] [--optims adamw muon] [--batch 2 4]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import (
    median_range,
    paired_ratios,
    parser,
    pin_threads,
    print_load,
    round_robin,
)
from benchmarks.speed.step_roofline import ARMS, StudyStep, scale_config


def compiled_first(run: StudyStep, warmup: int) -> float:
    """Seconds of `warmup` steps and one no-grad evaluation forward of a fresh compiled run
    (its compilation happens here), less `warmup` steady steps (timed after them)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        run.step()
    run.model.eval()
    with torch.no_grad():
        run.model(*run.batch)
    run.model.train()
    first = time.perf_counter() - t0
    return first - sum(run.timed() for _ in range(warmup))


def eval_forward(run: StudyStep) -> float:
    """Seconds of one eager no-grad evaluation forward (what compiled_first's includes)."""
    t0 = time.perf_counter()
    run.model.eval()
    with torch.no_grad():
        run.model(*run.batch)
    run.model.train()
    return time.perf_counter() - t0


def scale_rows(width: int | None, args) -> list[float]:
    """Time one scale's contenders, print their rows, and return every paired ratio (eager
    step time over the compiled step's in the same round) of the scale."""
    import torch._dynamo

    torch._dynamo.reset()
    label = "cpu-regime" if width is None else f"d{width}"
    runs, compile_s = {}, None
    for optim in args.optims:
        for arm in args.arms:
            for mode in ("eager", "compiled"):
                run = StudyStep(scale_config(width, optim, arm), compile_model=mode == "compiled")
                if mode == "compiled" and compile_s is None:  # later ones reuse its graphs
                    compile_s = compiled_first(run, args.warmup) - eval_forward(run)
                for _ in range(args.warmup):
                    run.step()
                runs[optim, arm, mode] = run
    times = round_robin(runs, lambda r, _: r.timed(), args.steps, 0)
    cfg = next(iter(runs.values())).cfg
    pooled = []
    for optim in args.optims:
        for arm in args.arms:
            eager, comp = times[optim, arm, "eager"], times[optim, arm, "compiled"]
            ratios = paired_ratios(eager, comp)
            pooled += ratios
            # the scale's first compiled run trained extra steps while compiling: compare the
            # losses of the steps both ran (the same steps on the same batch)
            e_loss = runs[optim, arm, "eager"].losses
            c_loss = runs[optim, arm, "compiled"].losses[: len(e_loss)]
            exact = c_loss == e_loss
            best = min(eager) / min(comp)
            last = [e_loss[-1], c_loss[-1]]
            print(f"{label:<11} {optim:<6} {arm:<7} {statistics.median(eager) * 1e3:8.1f} "
                  f"{statistics.median(comp) * 1e3:8.1f}  {median_range(ratios, '.2f'):<17} "
                  f"{best:7.2f} {'yes' if exact else 'NO':>5} {last[0]:7.4f} {last[1]:7.4f}",
                  flush=True)  # fmt: skip
    steady = statistics.median(pooled)
    eager_s = statistics.median([t for k, v in times.items() if k[2] == "eager" for t in v])
    full_eager = cfg.train.num_steps * eager_s
    full_comp = full_eager / steady + compile_s
    print(f"{label:<11} all: compiled step {median_range(pooled, '.2f')}x faster; compilation "
          f"{compile_s:.0f} s a run (first {args.warmup} steps and an eval forward, beyond "
          f"their steady time); a {cfg.train.num_steps}-step run {full_eager:.0f} s eager, "
          f"{full_comp:.0f} s compiled: {full_eager / full_comp:.2f}x runs per core-hour "
          f"(evals left out)", flush=True)  # fmt: skip
    return pooled


def batch_rows(width: int | None, args) -> None:
    """The batching bound's row of one scale (module docstring)."""
    label = "cpu-regime" if width is None else f"d{width}"
    sizes = [1, *args.batch]
    runs = {s: StudyStep(scale_config(width, "adamw", "2bw", {"train.batch_size": str(16 * s)}))
            for s in sizes}  # fmt: skip
    times = round_robin(runs, lambda r, _: r.timed(), args.steps, 1)
    base = statistics.median(times[1])
    shown = "  ".join(f"S={s}: {statistics.median(times[s]) / s / base:.3f}" for s in args.batch)
    print(f"{label:<11} time per 16 sequences at S x 16 / at 16 (AdamW 2bw): {shown}", flush=True)


def main() -> None:
    ap = parser(__doc__, whole=True)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per contender")
    ap.add_argument("--warmup", type=int, default=3, help="untimed (compiling) steps")
    ap.add_argument("--widths", type=int, nargs="*", default=[48, 64, 136])
    ap.add_argument("--optims", nargs="*", default=["adamw", "muon"])
    ap.add_argument("--arms", nargs="*", default=list(ARMS))
    ap.add_argument("--batch", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--skip-regime", action="store_true", help="only the --widths")
    args = ap.parse_args()
    pin_threads(1)
    print_load("before")
    cache = Path(f"/tmp/torchinductor_{__import__('getpass').getuser()}")
    print(f"torch {torch.__version__}, 1 thread; inductor cache {cache} "
          f"{'exists' if cache.exists() else 'empty'} at the start")  # fmt: skip
    scales = [*([] if args.skip_regime else [None]), *args.widths]
    if not args.skip_compile:
        print(f"{'model':<11} {'optim':<6} {'arm':<7} {'eager ms':>8} {'comp ms':>8}  "
              f"{'eager/compiled':<17} {'of mins':>7} {'exact':>5} {'loss e':>7} {'loss c':>7}")  # fmt: skip
        for width in scales:
            scale_rows(width, args)
    for width in scales if args.batch else []:
        batch_rows(width, args)
    print_load("after")


if __name__ == "__main__":
    main()
