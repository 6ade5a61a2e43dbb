"""The `paper-mini` study: the CPU subset that checks the paper's four qualitative claims, each
owned by the study that tests it at full size (optimizers, mitigations, momentum, depth)."""

from __future__ import annotations

from stalepipe.lab.studies.depth import claim_pipedream_gap_grows_with_depth
from stalepipe.lab.studies.mitigations import claim_ef_recovers_gap
from stalepipe.lab.studies.momentum import claim_momentum_shrinks_gap
from stalepipe.lab.studies.optimizers import claim_adamw_gap_exceeds_muon
from stalepipe.lab.studies.scales import CPU_STEPS, SYNC, TWO_BW, TWO_BW_EF, length, optimizer_axis
from stalepipe.lab.studies.study import Study
from stalepipe.lab.sweeps.grid import Bundle, axis


def study_paper_mini(scale: str) -> list[list[list[Bundle]]]:
    """The CPU subset that checks the paper's four qualitative claims (docs/RESULTS.md)."""
    opt2 = optimizer_axis(scale, ("adamw", "muon"))
    adamw = optimizer_axis(scale, ("adamw",))
    return [
        # AdamW's gap >> Muon's; EF recovers most of each gap
        [opt2, [SYNC, TWO_BW, TWO_BW_EF]],
        # higher momentum shrinks the gap (AdamW beta1; 0.9 is the default run above) ...
        [adamw, axis("optim.beta1", ["0.8", "0.95", "0.98"]), [SYNC, TWO_BW]],
        # ... with beta2 0.99 (beta1 0.95/0.98 with AdamW's default beta2 0.95 are unstable here)
        [
            adamw,
            axis("optim.beta2", ["0.99"]),
            axis("optim.beta1", ["0.8", "0.9", "0.95", "0.98"]),
            [SYNC, TWO_BW],
        ],
        # ... and Muon's (0.95 is the default run above)
        [
            optimizer_axis(scale, ("muon",)),
            axis("optim.beta1", ["0.8", "0.9", "0.98"]),
            [SYNC, TWO_BW],
        ],
        # (not a claim of the list: does the gap close as training gets longer?)
        [opt2, [length(CPU_STEPS * 2), length(CPU_STEPS * 4)], [SYNC, TWO_BW, TWO_BW_EF]],
        # (does EF recover more where the gap is smaller? AdamW at a third of its LR)
        [
            [("adamw", {"optim.name": "adamw"})],
            axis("optim.lr", ["1e-3"]),
            [SYNC, TWO_BW, TWO_BW_EF],
        ],
        # pipedream's gap grows with depth, 2bw's stays flat
        [
            adamw,
            [("pipedream", {"delay.policy": "pipedream"})],
            axis("pipeline.num_stages", [2, 4]),
        ],
        # 2bw's staleness is 1 on every stage at any P: P = 4 next to adamw_2bw (P = 1) shows it
        [adamw, [TWO_BW], axis("pipeline.num_stages", [4])],
    ]


STUDY = Study(
    name="paper-mini",
    grids=study_paper_mini,
    about="CPU check of the paper's 4 qualitative claims",
    order=160,
    scales=("cpu",),
    claims=(
        claim_adamw_gap_exceeds_muon,
        claim_ef_recovers_gap,
        claim_momentum_shrinks_gap,
        claim_pipedream_gap_grows_with_depth,
    ),
)
