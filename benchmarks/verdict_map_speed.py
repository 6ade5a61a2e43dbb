"""How long the verdict's crossover map takes (issue 32: a full map in under 10 s on 2 cores).

    OMP_NUM_THREADS=1 python benchmarks/verdict_map_speed.py [--cluster h100-ib] [--model smollm-360m]

Times `analysis.cluster_verdict.crossover_map` from a cold cache (the pipeline timings are
cached per process), and counts the configurations it times; docs/benchmarks.md records it.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from stalepipe.analysis.cluster_verdict import crossover_map, setting
from stalepipe.sim.parallel import all_options


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="h100-ib")
    ap.add_argument("--model", default="smollm-360m")
    ap.add_argument("--gpus", type=int, default=32)
    args = ap.parse_args()
    s = setting(args.model, args.cluster, args.gpus, None)
    t0 = time.perf_counter()
    cells = crossover_map(s)
    took = time.perf_counter() - t0
    configs = sum(
        len(
            all_options(
                s.workload(c.gpus, c.global_batch), replace(s.cluster, inter_node_gbps=c.inter_gbps)
            )
        )
        for c in cells
    )  # cached now: counting costs nothing
    print(
        f"crossover map, {args.model} on {args.cluster} around {args.gpus} GPUs: {len(cells)} cells, "
        f"{configs} configurations, {took:.2f} s (cold cache)"
    )


if __name__ == "__main__":
    main()
