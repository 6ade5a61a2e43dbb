"""What the benchmark scripts share: the command line's description and timing flags, the
thread pinning, the machine's load average, contenders timed in turns and ratios read side by
side, a preset's batch of random tokens, and a process's memory from /proc.

The scripts live one folder down, by what they measure (docs/benchmarks.md, "Layout"), and run
from the project root as `python benchmarks/<group>/<name>.py`. Each one that imports this
module or another script's puts the project root on sys.path first, so that every import of a
benchmark module reads the same from every folder (`benchmarks.common`,
`benchmarks.speed.pipeline_spans`), in the script, in the processes it spawns and in tests:

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: benchmarks.*
    from benchmarks.common import parser

Nothing here imports torch at module level: the scripts that read records do not need it.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

# The help of the timing flags `timing_args` adds; a script's docstring says what they time.
TIMING_HELP = {
    "steps": "steps per contender",
    "warmup": "untimed warm-up steps",
    "rounds": "rounds of the contenders, taking turns (medians)",
    "repeats": "repeats of each measurement, interleaved (medians)",
    "threads": "torch intra-op threads (0: torch's default)",
}


def parser(doc: str | None, *, whole: bool = False) -> argparse.ArgumentParser:
    """The script's parser, described by the first paragraph of its docstring (`whole`: the
    whole docstring, as written, usage lines included)."""
    doc = doc or ""
    if whole:
        return argparse.ArgumentParser(
            description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
        )
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


def timing_args(ap: argparse.ArgumentParser, **defaults: int) -> None:
    """Add the timing flags named (keys of TIMING_HELP), each an int with its default."""
    for name, default in defaults.items():
        ap.add_argument(f"--{name}", type=int, default=default, help=TIMING_HELP[name])


def pin_threads(threads: int = 1) -> int:
    """Run torch on `threads` intra-op threads (0: leave torch's default); the count in use."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def load_average() -> str:
    """The machine's 1-, 5- and 15-minute load averages: the machines here are shared."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_load(when: str) -> None:
    """`load average <when>: ...`, flushed (a long benchmark prints it before and after)."""
    print(f"load average {when}: {load_average()}", flush=True)


def round_robin(
    contenders: dict[K, T], step: Callable[[T, int], float], steps: int, warmup: int
) -> dict[K, list[float]]:
    """Time every contender step by step in turns, so that machine noise hits them alike:
    `step(contender, k)` returns the seconds of step k; the first `warmup` rounds are not kept."""
    times: dict[K, list[float]] = {name: [] for name in contenders}
    for k in range(warmup + steps):
        for name, contender in contenders.items():
            seconds = step(contender, k)
            if k >= warmup:
                times[name].append(seconds)
    return times


def interleaved_rounds(names: Sequence[K], rounds: int, run: Callable[[K], T]) -> list[dict[K, T]]:
    """`rounds` rounds of `run(name)` for every name, each round starting with the next name:
    the shared machine's slow phases hit every contender alike."""
    out = []
    for r in range(rounds):
        r %= len(names)
        out.append({name: run(name) for name in [*names[r:], *names[:r]]})
    return out


def paired_ratios(times: Sequence[float], base: Sequence[float]) -> list[float]:
    """Each round's time over the base's in the same round: the two ran back to back, so load
    that drifts over the run cancels."""
    return [t / b for t, b in zip(times, base, strict=True)]


def median_range(ratios: Sequence[float], fmt: str = ".3f") -> str:
    """The median of per-round ratios and their range: `1.052 [0.990-1.101]`."""
    return f"{statistics.median(ratios):{fmt}} [{min(ratios):{fmt}}-{max(ratios):{fmt}}]"


def random_tokens(cfg, seed: int, device: str = "cpu"):
    """A batch of random tokens of `cfg`'s shape (train.batch_size x data.seq_len, the model's
    vocabulary): the inputs and their next tokens, the same for the same seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (cfg.train.batch_size, cfg.data.seq_len + 1)
    x = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)


def proc_status_kb(field: str) -> int:
    """A field of /proc/self/status in kB (VmRSS: resident now, VmHWM: the peak); 0 if absent."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0
