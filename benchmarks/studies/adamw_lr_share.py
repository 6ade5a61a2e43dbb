"""How much of AdamW's gap drop between the size ladder's widths 96 and 136 its LR change
predicts (issue 51, item 6): the ladder chose AdamW's LR per width on one seed (0.006 at width
96, 0.00106 at 136: 5.7x lower), and AdamW's gap rises steeply with the LR.

    python benchmarks/studies/adamw_lr_share.py

The gap's LR slope is read where AdamW 2bw ran at three LRs with paired sync runs: the
`hparams` study at 0.43M (`cpu-regime`, width 96, 1,200 steps; docs/results/optimizers-regime),
`ln gap = a + k ln LR` by least squares over every seed's paired gap, k's 95 % t-interval. The
LR change alone then predicts the gap ratio `(0.006 / 0.00106)^k` between the ladder's widths
96 and 136, set beside the ratio the ladder measured (its width means of the paired gaps on the
whole validation split, docs/results/ladder-regime). The slope is measured at width 96 and at
cpu-regime's length, not at the ladder's rungs: that transfer is an assumption, printed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from stalepipe.lab.analysis import scaling, stats
from stalepipe.lab.studies.ladder import LADDER_LRS

HPARAMS = Path("docs/results/optimizers-regime")
LADDER = Path("docs/results/ladder-regime")
GROUPS = {"adamw_lr0.001": 0.001, "adamw": 0.003, "adamw_lr0.009": 0.009}


def _final(run: Path) -> float:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "val_loss" in r][-1]["val_loss"]


def lr_points() -> list[tuple[float, float]]:
    """(LR, paired 2bw gap) for every seed of the hparams study's AdamW LR axis."""
    out = []
    for group, lr in GROUPS.items():
        for sync in sorted(HPARAMS.glob(f"{group}_sync_s*")):
            delayed = HPARAMS / sync.name.replace("_sync_", "_2bw_")
            if delayed.is_dir():
                out.append((lr, _final(delayed) - _final(sync)))
    return out


def ladder_ratio() -> tuple[float, float, float]:
    """AdamW 2bw's mean paired gap at the ladder's widths 96 and 136, and their ratio."""
    runs = [r for r in scaling.ladder_runs(LADDER) if r.optimizer == "adamw"]
    means = []
    for width in (96, 136):
        lr = float(LADDER_LRS["adamw", width])
        mine = [r for r in runs if r.width == width and r.lr == lr]
        base = min(r.tokens for r in mine)
        by = {(r.arm, r.seed): r.loss for r in mine if r.tokens == base}
        gaps = [by["2bw", s] - by["sync", s] for a, s in by if a == "sync" and ("2bw", s) in by]
        means.append(float(np.mean(gaps)))
    return means[0], means[1], means[0] / means[1]


def main() -> None:
    points = lr_points()
    x = np.log([lr for lr, _ in points])
    y = np.log([g for _, g in points])
    k, a = np.polyfit(x, y, 1)
    resid = y - (a + k * x)
    df = len(points) - 2
    se = math.sqrt(float(resid @ resid) / df / float(((x - x.mean()) ** 2).sum()))
    half = stats.t_quantile(0.975, df) * se
    step = float(LADDER_LRS["adamw", 96]) / float(LADDER_LRS["adamw", 136])
    lo, hi = step ** (k - half), step ** (k + half)
    g96, g136, measured = ladder_ratio()
    print(f"AdamW 2bw gap against LR at 0.43M (cpu-regime, {len(points)} paired seeds, 3 LRs):")
    for lr in GROUPS.values():
        gaps = [g for l, g in points if l == lr]
        print(f"  LR {lr:g}: gap {np.mean(gaps):.3f} ({len(gaps)} seeds)")
    print(f"  ln gap = {a:.2f} + {k:.3f} ln LR, k 95 % [{k - half:.3f}, {k + half:.3f}] ({df} df)")
    print(
        f"ladder widths 96 -> 136: LR {LADDER_LRS['adamw', 96]} -> {LADDER_LRS['adamw', 136]} "
        f"({step:.2f}x lower); the LR change alone predicts the gap to fall {step**k:.2f}x "
        f"[{lo:.2f}, {hi:.2f}]"
    )
    lrs = sorted(GROUPS.values())
    means = [float(np.log(np.mean([g for l, g in points if l == lr]))) for lr in lrs]
    at = lambda lr: float(np.interp(math.log(lr), np.log(lrs), means))  # noqa: E731
    local = math.exp(at(float(LADDER_LRS["adamw", 96])) - at(float(LADDER_LRS["adamw", 136])))
    print(
        f"  the same read locally (log-log interpolation of the LR means, the curve being "
        f"convex): {local:.2f}x"
    )
    print(
        f"measured: {g96:.4f} -> {g136:.4f}, {measured:.2f}x; the LR change predicts "
        f"{100 * math.log(local) / math.log(measured):.0f}-"
        f"{100 * math.log(step**k) / math.log(measured):.0f} % of it in log terms (local, "
        "power fit), if the slope at 0.43M and 1,200 steps holds at the ladder's rungs"
    )


if __name__ == "__main__":
    main()
