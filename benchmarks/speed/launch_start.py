"""How long a distributed launch takes to start its ranks: Python's forkserver (the default,
`launch.train.rank_context`) against spawn, side by side in one process each, alternating.

Each launch trains the test suite's tiny 3-rank 1F1B model for 4 steps on the packaged
excerpt, so most of its time is starting the ranks. Prints each launch's wall time and each
mode's median; the first forkserver launch in a process pays for the server's own imports.

    OMP_NUM_THREADS=1 python benchmarks/speed/launch_start.py [--rounds 2] [--launches 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def one_process(mode: str, launches: int) -> list[float]:
    sys.path.insert(0, str(ROOT / "tests" / "dist"))
    from conftest import tiny_cfg  # the distributed tests' tiny configuration
    from stalepipe.config import DataConfig
    from stalepipe.training.data import prepare_corpus
    from stalepipe.training.launch import train as lt
    from stalepipe.training.rundir.startup import StartUp

    if mode == "spawn":
        lt.rank_context = lambda: multiprocessing.get_context("spawn")
    d = tempfile.mkdtemp()
    data_cfg = DataConfig(corpus="excerpt", tokenizer="byte", data_dir=d + "/data")
    data = str(prepare_corpus(data_cfg, progress=False))
    walls = []
    for i in range(launches):
        cfg = tiny_cfg(d + "/runs", data, "1f1b", 3, 2, steps=4, name=f"r{i}")
        t0 = time.monotonic()
        assert lt.launch_train(cfg, StartUp(overwrite=True), verbose=False) == 0
        walls.append(time.monotonic() - t0)
    return walls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--child", choices=("spawn", "forkserver"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(" ".join(f"{w:.2f}" for w in one_process(args.child, args.launches)))
        return
    seen: dict[str, list[float]] = {"spawn": [], "forkserver": []}
    for r in range(args.rounds):
        for mode in seen:
            cmd = [sys.executable, __file__, "--child", mode, "--launches", str(args.launches)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            walls = [float(w) for w in out.split()]
            seen[mode] += walls
            print(f"round {r} {mode:10s} " + " ".join(f"{w:6.2f}s" for w in walls), flush=True)
    med = {m: statistics.median(w) for m, w in seen.items()}
    print(f"median launch: spawn {med['spawn']:.2f}s, forkserver {med['forkserver']:.2f}s "
          f"({med['spawn'] / med['forkserver']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
