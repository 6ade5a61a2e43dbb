"""The `length` study: AdamW and Muon, sync / 2bw / 2bw+EF at 1x, 2x and 4x the tokens."""

from __future__ import annotations

from stalepipe.lab.studies.scales import (
    SYNC,
    TWO_BW,
    TWO_BW_EF,
    base_config,
    length,
    optimizer_axis,
)
from stalepipe.lab.studies.study import Study
from stalepipe.lab.sweeps.grid import Bundle


def study_length(scale: str) -> list[list[list[Bundle]]]:
    """AdamW and Muon, sync / 2bw / 2bw+EF at 1x, 2x and 4x the scale's tokens (the schedule
    stretched: warmup a tenth, the same number of evaluations); 1x is study 1's run."""
    tc = base_config(scale).train
    steps, evals = tc.num_steps, tc.num_steps // (tc.eval_every or tc.num_steps)
    lengths = [length(n, evals) for n in (steps, steps * 2, steps * 4)]
    return [[optimizer_axis(scale, ("adamw", "muon")), lengths, [SYNC, TWO_BW, TWO_BW_EF]]]


STUDY = Study(
    name="length",
    grids=study_length,
    about="AdamW & Muon sync / 2bw / 2bw+EF at 1x, 2x, 4x the tokens",
    order=90,
)
