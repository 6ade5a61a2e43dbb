"""The controlled momentum study's table (issue 34, item 4), from its records.

`stalepipe sweep momentum-controlled` runs AdamW (beta2 = 0.999) and Muon at beta1 (Muon's
momentum) 0.8-0.99, each at three LRs, under sync and 2bw. Per optimizer and beta1 this prints
the 2bw gap read three ways:

- **fixed LR**: both arms at the middle LR of the grid (the scale's tuned LR);
- **sync's best LR**: both arms at the LR where sync ends lowest for that beta1;
- **each arm's best LR**: 2bw's lowest final loss over the LRs against sync's lowest (tuned on
  sync and on 2bw apart).

An LR at the edge of the grid is marked `*` (the optimum may lie outside it). Seeds: the mean
over the finished seeds of each cell (the count is printed); `stalepipe report` has the tests.

    python benchmarks/studies/momentum_table.py docs/results/momentum-controlled-regime [--grid]

`--grid` adds every cell: sync's and 2bw's final loss at each LR.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict

from stalepipe.lab.analysis.results import load_runs

Cell = dict[str, list[float]]  # delay policy -> final losses over seeds


def collect(sweep_dir: str) -> dict[str, dict[float, dict[float, Cell]]]:
    """{optimizer: {beta1: {lr: {policy: [final val loss per seed]}}}} of the finished runs."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
    for r in load_runs(sweep_dir):
        if r.status != "finished" or r.config.get("delay.ef"):
            continue
        c = r.config
        cell = out[c["optim.name"]][c["optim.beta1"]][c["optim.lr"]]
        cell[c["delay.policy"]].append(r.final_val)
    return out


def _mean(cell: Cell, policy: str) -> float:
    return statistics.mean(cell[policy]) if cell.get(policy) else math.nan


def _best(lrs: dict[float, Cell], policy: str, grid: list[float]) -> tuple[float, float]:
    """(lr, mean loss) of `policy`'s lowest mean over the LRs that have it; nan if none."""
    have = [(lr, _mean(c, policy)) for lr, c in lrs.items() if c.get(policy)]
    if len(grid) < 3 or len(have) < len(grid):  # the grid not (all) run: no optimum to read
        return math.nan, math.nan
    return min(have, key=lambda x: x[1])


def _lr_text(lr: float, grid: list[float]) -> str:
    if math.isnan(lr):
        return "-"
    return f"{lr:g}" + ("*" if lr in (grid[0], grid[-1]) else "")


def rows(data: dict) -> list[str]:
    head = (
        "| optimizer | beta1 | seeds | sync (fixed LR) | gap at fixed LR | sync's best LR | "
        "gap there | 2bw's best LR | gap, each arm at its best |"
    )
    out = [head, "|---" * (head.count("|") - 1) + "|"]
    for opt, betas in sorted(data.items()):
        grid = sorted({lr for lrs in betas.values() for lr in lrs})
        fixed = grid[len(grid) // 2]
        for beta1, lrs in sorted(betas.items()):
            cell = lrs.get(fixed, {})
            seeds = min((len(v) for v in cell.values()), default=0)
            s_fixed = _mean(cell, "sync")
            g_fixed = _mean(cell, "2bw") - s_fixed
            lr_s, s_best = _best(lrs, "sync", grid)
            lr_d, d_best = _best(lrs, "2bw", grid)
            g_there = math.nan if math.isnan(lr_s) else _mean(lrs[lr_s], "2bw") - s_best

            cells = [opt, f"{beta1:g}", str(seeds), f"{s_fixed:.4f}", f"{g_fixed:+.4f}"]
            cells += [
                _lr_text(lr_s, grid),
                f"{g_there:+.4f}",
                _lr_text(lr_d, grid),
                f"{d_best - s_best:+.4f}",
            ]
            out.append("| " + " | ".join("-" if "nan" in c else c for c in cells) + " |")
    return out


def grid_rows(data: dict) -> list[str]:
    """`--grid`: every cell's final loss, sync and 2bw at each LR (mean over the seeds)."""
    out = []
    for opt, betas in sorted(data.items()):
        grid = sorted({lr for lrs in betas.values() for lr in lrs})
        lrs_text = " / ".join(f"{lr:g}" for lr in grid)
        head = f"| {opt}, beta1 | sync at LR {lrs_text} | 2bw at LR {lrs_text} |"
        out += ["", head, "|---|---|---|"]
        for beta1, lrs in sorted(betas.items()):
            cells = [
                " / ".join(f"{_mean(lrs.get(lr, {}), pol):.4f}" for lr in grid)
                for pol in ("sync", "2bw")
            ]
            out.append(f"| {beta1:g} | " + " | ".join(c.replace("nan", "-") for c in cells) + " |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir")
    ap.add_argument("--grid", action="store_true", help="also every cell's final loss per LR")
    args = ap.parse_args()
    data = collect(args.sweep_dir)
    print("\n".join(rows(data) + (grid_rows(data) if args.grid else [])))


if __name__ == "__main__":
    main()
