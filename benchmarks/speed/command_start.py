"""How long the lab's commands take from a fresh interpreter, beside what loading torch alone costs.

    OMP_NUM_THREADS=1 python benchmarks/speed/command_start.py [--rounds 5]

Each command runs as a user types it (`python -m stalepipe ...`), the contenders taking turns
for `--rounds` rounds (medians). The lab (simulator, verdict, record readers) and a model's
arithmetic (`config/shapes.py`) are torch-free, so `simulate`, `info` and `presets` should cost
about an interpreter and the package, not the ~2 s torch takes; `train --help` is the floor the
CLI already had. The last column says whether the command's process loaded torch.
docs/benchmarks.md records it.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import load_average, parser

# what each contender runs after `python`; the reference is torch's import alone
COMMANDS = {
    "import torch (reference)": ["-c", "import torch"],
    "stalepipe train --help": ["-m", "stalepipe", "train", "--help"],
    "stalepipe simulate": [
        "-m", "stalepipe", "simulate", "--model", "smollm-360m", "--stages", "4",
        "--microbatches", "8",
    ],
    "stalepipe info": ["-m", "stalepipe", "info", "--preset", "moe-10b"],
    "stalepipe presets": ["-m", "stalepipe", "presets"],
}  # fmt: skip

# appended to a command's process: whether it loaded torch (printed to stderr at exit)
_PROBE = (
    "import atexit, sys; atexit.register(lambda: print('torch' in sys.modules, file=sys.stderr))"
)


def _run(args: list[str]) -> tuple[float, bool]:
    """Seconds the command took, and whether its process loaded torch."""
    if args[0] == "-m":  # run the module under the probe, as `python -m` would
        code = f"{_PROBE}; import runpy; sys.argv = {args[1:]!r}; runpy.run_module("
        code += f"{args[1]!r}, run_name='__main__')"
        argv = [sys.executable, "-c", code]
    else:
        argv = [sys.executable, "-c", f"{_PROBE}; {args[1]}"]
    t0 = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed: {out.stderr[-500:]}")
    return took, out.stderr.strip().splitlines()[-1] == "True"


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the commands, taking turns")
    args = ap.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    loaded: dict[str, bool] = {}
    for _ in range(args.rounds):
        for name, argv in COMMANDS.items():
            took, loaded[name] = _run(argv)
            times[name].append(took)
    ref = statistics.median(times["import torch (reference)"])
    print(f"{'command':<26} {'median':>8} {'/ torch':>8}  loads torch")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name:<26} {med:7.2f}s {med / ref:7.2f}x  {'yes' if loaded[name] else 'no'}")
    print(f"{args.rounds} rounds, turns taken; load average after: {load_average()}")


if __name__ == "__main__":
    main()
