"""The `tokens` study: the gap as the training length grows, x1/4 to x2 the scale's steps."""

from __future__ import annotations

from stalepipe.lab.studies.scales import SYNC, TWO_BW, base_config, length, optimizer_axis
from stalepipe.lab.studies.study import Study
from stalepipe.lab.sweeps.grid import Bundle


def study_tokens(scale: str) -> list[list[list[Bundle]]]:
    tc = base_config(scale).train
    steps, evals = tc.num_steps, tc.num_steps // (tc.eval_every or tc.num_steps)
    lengths = [steps // 4, steps // 2, steps, steps * 2]
    grid_steps = [length(n, evals) for n in lengths]
    return [[optimizer_axis(scale, ("adamw", "muon")), grid_steps, [SYNC, TWO_BW]]]


STUDY = Study(
    name="tokens",
    grids=study_tokens,
    about="the gap as the training length grows (x1/4 .. x2)",
    order=70,
)
