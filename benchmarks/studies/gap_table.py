"""The delay's gap against training length and against model size, from a sweep's records.

The `length` and `size` studies (issue 34) add runs beside study 1's in one sweep directory.
This reads them by configuration, not by name: a reference run per optimizer (its synchronous
run of study 1 at `--seed`), then every finished run of that optimizer and seed whose config
differs from the reference only in the axis's keys and in the delay (policy, EF). Per value of
the axis: sync's final val loss, the 2bw gap (delayed minus sync), the 2bw+EF gap, the share EF
recovers, and AdamW's gap over Muon's. One seed per cell, so a direction, not a test
(`stalepipe report` tests the axes that have seeds).

    python benchmarks/studies/gap_table.py docs/results/optimizers-regime
    python benchmarks/studies/gap_table.py docs/results/optimizers-regime --seed 1 --axis length
"""

from __future__ import annotations

import argparse
import math

from stalepipe.lab.analysis.results import Run, config_key, load_runs
from stalepipe.lab.verdict.rule import model_size

# Keys an axis may change against the reference (beside the delay's), and the one it shows.
AXES = {
    "length": (("train.num_steps", "train.warmup_steps", "train.eval_every"), "train.num_steps"),
    "size": (("model.dim", "model.ffn_dim", "model.num_heads", "optim.lr"), "model.dim"),
}
DELAY_KEYS = ("delay.policy", "delay.ef")
OPTIMIZERS = ("adamw", "muon")


def _arm(run: Run) -> str | None:
    policy, ef = run.config.get("delay.policy"), run.config.get("delay.ef", False)
    return {("sync", False): "sync", ("2bw", False): "2bw", ("2bw", True): "2bw+ef"}.get(
        (policy, ef)
    )


def cells(runs: list[Run], opt: str, seed: int, axis: str) -> dict[float, dict[str, Run]]:
    """{axis value: {arm: run}} for optimizer `opt` at `seed`, the reference's value included.
    A cell's sync run is the reference at the reference's value, else the one sync run there
    (a value with several, e.g. an LR grid at another length, is left out); its delayed arms
    are the runs equal to that sync run but for the delay."""
    keys, shown = AXES[axis]
    ref = next((r for r in runs if r.name == f"{opt}_sync_s{seed}"), None)
    if ref is None:
        return {}
    want = config_key(ref.config, drop=keys + DELAY_KEYS)
    candidates: dict[float, list[Run]] = {}
    for r in runs:
        if r.seed != seed or r.config.get("optim.name") != opt or _arm(r) is None:
            continue
        if config_key(r.config, drop=keys + DELAY_KEYS) == want:
            candidates.setdefault(r.config[shown], []).append(r)
    out: dict[float, dict[str, Run]] = {}
    for value, rs in sorted(candidates.items()):
        syncs = [r for r in rs if _arm(r) == "sync"]
        sync = ref if ref in syncs else syncs[0] if len(syncs) == 1 else None
        if sync is None:
            continue
        same = config_key(sync.config, drop=DELAY_KEYS)
        out[value] = {_arm(r): r for r in rs if config_key(r.config, drop=DELAY_KEYS) == same}
    return out


def table(runs: list[Run], seed: int, axis: str) -> list[str]:
    shown = AXES[axis][1]
    head = f"| {shown} | " + ("parameters | " if axis == "size" else "")
    for opt in OPTIMIZERS:
        head += f"{opt} LR | {opt} sync | gap | gap with EF | EF recovers | "
    lines = [head + "AdamW gap / Muon gap |", "|---" * (head.count("|") - 1) + "|"]
    by_opt = {opt: cells(runs, opt, seed, axis) for opt in OPTIMIZERS}
    for value in sorted(set().union(*by_opt.values())):
        row, gaps = [f"{value:g}"], {}
        for opt in OPTIMIZERS:
            arms = by_opt[opt].get(value, {})
            if axis == "size" and opt == OPTIMIZERS[0]:
                row.append(model_size(next(iter(arms.values())).config) if arms else "-")
            if "sync" not in arms:
                row += ["-"] * 5
                continue
            s = arms["sync"].final_val
            g = arms["2bw"].final_val - s if "2bw" in arms else math.nan
            ge = arms["2bw+ef"].final_val - s if "2bw+ef" in arms else math.nan
            gaps[opt] = g
            share = f"{100 * (1 - ge / g):.0f}%" if math.isfinite(ge / g) else "-"
            share = "all (EF below sync)" if ge < 0 else share
            lr = arms["sync"].config.get("optim.lr")
            row += [f"{lr:g}", f"{s:.4f}", f"{g:.4f}", f"{ge:.4f}", share]
        ratio = gaps.get("adamw", math.nan) / gaps.get("muon", math.nan)
        row.append(f"{ratio:.1f}" if math.isfinite(ratio) else "-")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--axis", choices=[*AXES, "both"], default="both")
    args = ap.parse_args()
    runs = [r for r in load_runs(args.sweep_dir) if r.status == "finished"]
    for axis in AXES if args.axis == "both" else (args.axis,):
        print(f"{axis} (seed {args.seed}; gap = delayed minus sync, final val loss)")
        print("\n".join(table(runs, args.seed, axis)), end="\n\n")


if __name__ == "__main__":
    main()
