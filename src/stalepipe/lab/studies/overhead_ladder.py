"""The `overhead-ladder` study: Muon's token overhead at four widths, one token budget."""

from __future__ import annotations

from stalepipe.lab.studies.ladder import LADDER, ladder_size
from stalepipe.lab.studies.scales import REGIME, SYNC, TWO_BW, TWO_BW_EF
from stalepipe.lab.studies.study import Study
from stalepipe.lab.sweeps.grid import Bundle

# The overhead ladder (issue 51; docs/RESULTS.md, "Overhead ladder", registered before its runs):
# size apart from training length. Four of the ladder's widths (8.3x in non-embedding
# parameters) at one token budget, 1,400 steps of 16 x 128 tokens (2.87M tokens; the 1.5x runs
# read 4.30M of the 4.78M training tokens: one epoch at every length), Muon at its fixed 0.01
# (the ladder's LR at widths 64-136; Muon's update is normalised per matrix, so no width rule).
# Muon 2bw and 2bw+EF run complete at each of OVERHEAD_LENGTHS x the budget, sync at 1x and
# 1.2x (its final slope, for gap = slope x ln(overhead)).
OVERHEAD_WIDTHS = (48, 64, 96, 136)
OVERHEAD_STEPS = 1_400
OVERHEAD_LR = "0.01"
OVERHEAD_LENGTHS = (1.0, 1.1, 1.2, 1.35, 1.5)
OVERHEAD_SYNC_LENGTHS = (1.0, 1.2)


def overhead_rung(width: int, factor: float) -> Bundle:
    """One width of the overhead ladder at `factor` x its fixed budget: the ladder's shape and
    evaluation, the schedule stretched as `sweep --lengths` stretches it."""
    ffn, params = next((f, n) for w, f, n in LADDER if w == width)
    label, overrides = ladder_size(width, ffn, params)
    steps = round(OVERHEAD_STEPS * factor)
    overrides = {
        **overrides,
        "train.num_steps": str(steps),
        "train.warmup_steps": str(round(OVERHEAD_STEPS // 10 * factor)),
        "train.eval_every": str(round(OVERHEAD_STEPS // 20 * factor)),
    }
    return (label if factor == 1 else f"{label}_x{factor:g}", overrides)


def study_overhead_ladder(scale: str) -> list[list[list[Bundle]]]:
    """The overhead ladder (docs/RESULTS.md, 'Overhead ladder'): Muon sync at 1x and 1.2x, 2bw
    and 2bw+EF at 1-1.5x one fixed token budget, at four widths; widths outermost, so a seed's
    narrow widths finish first."""
    muon = [("muon", {"optim.name": "muon", "optim.lr": OVERHEAD_LR})]
    grids = []
    for w in OVERHEAD_WIDTHS:
        grids.append([muon, [overhead_rung(w, f) for f in OVERHEAD_SYNC_LENGTHS], [SYNC]])
        grids.append([muon, [overhead_rung(w, f) for f in OVERHEAD_LENGTHS], [TWO_BW, TWO_BW_EF]])
    return grids


STUDY = Study(
    name="overhead-ladder",
    grids=study_overhead_ladder,
    about="Muon's token overhead at 4 widths, one token budget, 1-1.5x lengths",
    order=140,
    scales=REGIME,
)
