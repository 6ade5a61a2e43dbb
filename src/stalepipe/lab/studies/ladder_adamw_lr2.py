"""The `ladder-adamw-lr2` study: the size ladder's AdamW at each width's second-best LR."""

from __future__ import annotations

from stalepipe.lab.studies.ladder import LADDER, ladder_size
from stalepipe.lab.studies.scales import REGIME, SYNC, TWO_BW
from stalepipe.lab.studies.study import Study
from stalepipe.lab.sweeps.grid import Bundle, axis

# Issue 51, item 6 (docs/RESULTS.md, "AdamW's ladder with its LR held apart", registered before
# its runs): AdamW's second-best phase-1 LR at each width (seed 0's sync whole-split loss), so
# each width's gap is read at two LRs and the size trend is fitted with the LR as a covariate.
LADDER_ADAMW_SECOND_LRS: dict[int, str] = {
    32: "0.009",
    48: "0.003",
    64: "0.009",
    96: "0.003",
    136: "0.00212",
}


def study_ladder_adamw_lr2(scale: str) -> list[list[list[Bundle]]]:
    """AdamW sync and 2bw at each ladder width's second-best LR (`LADDER_ADAMW_SECOND_LRS`); the
    run names are phase 1's, so its seed-0 sync runs are reused."""
    return [
        [
            [("adamw", {"optim.name": "adamw"})],
            axis("optim.lr", [LADDER_ADAMW_SECOND_LRS[w]]),
            [ladder_size(w, ffn, params)],
            [SYNC, TWO_BW],
        ]
        for w, ffn, params in LADDER
    ]


STUDY = Study(
    name="ladder-adamw-lr2",
    grids=study_ladder_adamw_lr2,
    about="size ladder: AdamW sync / 2bw at each width's second-best LR",
    order=130,
    scales=REGIME,
)
