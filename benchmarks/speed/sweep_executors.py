"""Which local executor starts short sweep runs faster: the pool (`experiments.workers`, one
spawned process per run) or submitit's LocalExecutor (a subprocess per task, with pickles and
log files)? Both run the same tiny runs side by side in one invocation, alternating, and the
script prints each one's wall time per run and the ratio.

    python benchmarks/speed/sweep_executors.py --runs 4 --steps 3 --workers 2 --repeats 2
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

from stalepipe.lab.studies.scales import paper_mini_base
from stalepipe.lab.sweeps.grid import axis, expand
from stalepipe.lab.sweeps.sweep import run_sweep
from stalepipe.training.launch import task as trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import parser, timing_args


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    timing_args(ap, steps=3, repeats=2)
    args = ap.parse_args()
    base = paper_mini_base()
    base = dataclasses.replace(
        base, train=dataclasses.replace(base.train, num_steps=args.steps, eval_every=0)
    )
    specs = expand([axis("train.seed", list(range(args.runs)))])
    times: dict[str, list[float]] = {"local (pool)": [], "submitit-local": []}
    work = Path(tempfile.mkdtemp(prefix="sweep-exec-"))
    try:
        for rep in range(args.repeats):
            for name, kind in (("local (pool)", "local"), ("submitit-local", "submitit-local")):
                out = work / f"{kind}-{rep}"
                t = time.perf_counter()
                res = run_sweep(trainer, specs, base, out, workers=args.workers, executor=kind,
                                log=lambda m: None)  # fmt: skip
                assert len(res.ran) == args.runs and not res.failed, res
                times[name].append((time.perf_counter() - t) / args.runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.runs} runs x {args.steps} steps, {args.workers} workers, {args.repeats} repeats")
    print("| executor | seconds per run (best) | all |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {min(ts):.2f} | {' '.join(f'{t:.2f}' for t in ts)} |")
    ratio = min(times["submitit-local"]) / min(times["local (pool)"])
    print(f"submitit-local / pool: {ratio:.2f}x")


if __name__ == "__main__":
    main()
