"""How long the verdict's crossover map takes (issue 32: a full map in under 10 s on 2 cores).

    OMP_NUM_THREADS=1 python benchmarks/speed/verdict_map_speed.py \
        [--cluster h100-ib] [--model smollm-360m] [--arms muon+ef,muon,adamw+ef]

Times `verdict.cluster.crossover_map` from a cold cache (the pipeline timings are
cached per process), in one process and in its default worker processes (one a CPU), and counts
the configurations it times (each cell: the central assumptions and their 8 corners);
docs/benchmarks.md records it.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from stalepipe.lab.sim import parallel
from stalepipe.lab.sim.optimizer import Arm
from stalepipe.lab.sim.parallel import all_options
from stalepipe.lab.verdict.cluster import crossover_map, setting

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import load_average, parser


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--cluster", default="h100-ib")
    ap.add_argument("--model", default="smollm-360m")
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--arms", default="", help="e.g. muon+ef,muon,adamw+ef (default: AdamW)")
    args = ap.parse_args()
    s = setting(args.model, args.cluster, args.gpus, None)
    arms = [Arm(a.partition("+")[0], a.endswith("+ef")) for a in args.arms.split(",") if a]
    took = {}
    for workers in (1, None):
        parallel.cache_clear()
        t0 = time.perf_counter()
        cells = crossover_map(s, workers, arms or None)
        took[workers] = time.perf_counter() - t0
    configs = sum(
        len(
            all_options(
                replace(s.workload(c.gpus, c.global_batch), arm=c.arm),
                replace(s.cluster, inter_node_gbps=c.inter_gbps),
            )
        )
        for c in cells
    )  # the central assumptions' (the map timed the corners' too)
    print(
        f"crossover map, {args.model} on {args.cluster} around {args.gpus} GPUs: {len(cells)} cells, "
        f"{configs} configurations at the central assumptions (and 8 corners each); cold cache: "
        f"{took[1]:.2f} s in one process, {took[None]:.2f} s in {os.cpu_count()} (load average "
        f"after: {load_average()})"
    )


if __name__ == "__main__":
    main()
