"""The `momentum-controlled` study (issue 34): momentum without study 2's confounds."""

from __future__ import annotations

from stalepipe.lab.studies.scales import REGIME, SYNC, TWO_BW, lr_axis
from stalepipe.lab.studies.study import Study
from stalepipe.lab.sweeps.grid import Bundle, axis

CONTROLLED_MOMENTA = ("0.8", "0.9", "0.95", "0.98", "0.99")


def study_momentum_controlled(scale: str) -> list[list[list[Bundle]]]:
    """Momentum without the confounds of study 2 (issue 34): AdamW at beta2 = 0.999 (so every
    beta1 here stays below sqrt(beta2)) and Muon, beta1 / mu in 0.8-0.99, each at the scale's
    LR, a third of it and three times it, under sync and 2bw: the gap is read at one fixed LR
    (the middle one) and with each arm at its own best LR (tuned on sync and on 2bw apart)."""
    adamw = [("adamw", {"optim.name": "adamw", "optim.beta2": "0.999"})]
    muon = [("muon", {"optim.name": "muon"})]
    return [
        [opt, axis("optim.beta1", CONTROLLED_MOMENTA), lr_axis(scale, name), [SYNC, TWO_BW]]
        for name, opt in (("adamw", adamw), ("muon", muon))
    ]


STUDY = Study(
    name="momentum-controlled",
    grids=study_momentum_controlled,
    about="beta1 0.8-0.99 x 3 LRs",
    order=80,
    scales=REGIME,
)
