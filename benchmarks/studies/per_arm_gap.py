"""The gap of a delayed arm against a sync arm in another run group or directory (issue 17).

`stalepipe report` compares each delayed configuration with the sync run of the same
configuration: the same LR. The per-arm reading compares each arm at its own best LR, so the
delayed arm (e.g. Adan 2bw at a tenth of sync's LR, in `lr-tune-regime`) is compared with the
sync arm at the sync-tuned LR (in `optimizers-regime`). Each argument is `ARM=SYNC`, two run
groups: a run directory's path without its `_s<seed>`. Prints one markdown row per pair: the
finished seeds, the final val losses (mean ± std), the gap of the means and its two-sided
Welch p, and where both groups finished the same seeds (at least two) the gap paired by seed
with its 95 % interval and paired p (the report's test: the arms of a seed share data order
and initialisation).

    python benchmarks/studies/per_arm_gap.py \\
        docs/results/lr-tune-regime/adan_lr3e-3_2bw=docs/results/optimizers-regime/adan_sync

Any two groups compare, e.g. PipeDream against 2BW at P = 8 (RESULTS, "Depth P = 8"):
`docs/results/depth8-regime/P8_pipedream_adamw=docs/results/depth8-regime/P8_2bw_adamw`.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from stalepipe.lab.analysis.stats import paired_difference, welch_t_test
from stalepipe.training.rundir.metrics import read_metrics
from stalepipe.training.rundir.status import run_status


def final_losses(group: Path) -> dict[int, float]:
    """The final val loss of each finished seed of a run group (`<group>_s<seed>`), by seed."""
    out = {}
    for d in sorted(group.parent.glob(group.name + "_s*")):
        seed = d.name.rpartition("_s")[2]
        if seed.isdigit() and run_status(d) == "finished":
            last = [r["val_loss"] for r in read_metrics(d) if "val_loss" in r][-1:]
            out.update({int(seed): v for v in last})
    return out


def _fmt(v: list[float]) -> str:
    return f"{statistics.mean(v):.4f}" + (f" ± {statistics.stdev(v):.4f}" if len(v) > 1 else "")


def row(arm: Path, sync: Path) -> str:
    a, s = final_losses(arm), final_losses(sync)
    if not a or not s:
        missing = arm if not a else sync
        raise SystemExit(f"no finished run {missing}_s<seed>; name a run group (no _s suffix)")
    av, sv = list(a.values()), list(s.values())
    p = welch_t_test(av, sv).p if len(a) > 1 and len(s) > 1 else float("nan")
    gap = statistics.mean(av) - statistics.mean(sv)
    d = paired_difference(a, s)  # the seeds both groups finished
    paired = (
        f"{d.diff:+.4f} [{d.low:+.4f}, {d.high:+.4f}] ({d.n}) | {d.p:.1e}" if d.n > 1 else "- | -"
    )
    return (f"| {arm.name} | {len(a)} | {_fmt(av)} | {sync.name} | {len(s)} | {_fmt(sv)} "
            f"| {gap:+.4f} | {p:.1e} | {paired} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pairs", nargs="+", metavar="ARM=SYNC", help="two run groups")
    args = p.parse_args()
    pairs = [pair.partition("=") for pair in args.pairs]
    for (arm, eq, sync), pair in zip(pairs, args.pairs):
        if not (arm and eq and sync):
            p.error(
                f"{pair!r} is not ARM=SYNC (two run groups, e.g. d/adan_lr3e-3_2bw=d/adan_sync)"
            )
    rows = [row(Path(arm), Path(sync)) for arm, _, sync in pairs]
    print(
        "| arm | seeds | val | sync | seeds | val | gap | p (Welch) | gap paired by seed [95 % CI] (pairs) | p (paired) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
