"""A study in one file outside the package, registered when it is imported: what adding a study
takes (docs/design.md, 'Recipes'). `test_registering_a_study.py` finds it in `stalepipe sweep
--help`, a sweep's plan and `stalepipe report`'s claims table, with no other file changed.

Inside the package a study module declares `STUDY = Study(...)` and `studies/registry.py` finds
it; a module elsewhere calls `register` itself."""

from __future__ import annotations

import math

from stalepipe.lab.analysis.claims import Finding, seed_gaps
from stalepipe.lab.analysis.stats import fmt
from stalepipe.lab.studies.registry import STUDIES, register
from stalepipe.lab.studies.scales import SYNC, TWO_BW
from stalepipe.lab.studies.study import Study
from stalepipe.lab.sweeps.grid import Bundle, axis


def study_dummy(scale: str) -> list[list[list[Bundle]]]:
    """AdamW at two batch sizes, sync and 2bw."""
    return [
        [[("adamw", {"optim.name": "adamw"})], axis("train.batch_size", [4, 8]), [SYNC, TWO_BW]]
    ]


def claim_dummy_delay_costs_loss(rows) -> list[Finding]:
    """Per delayed configuration: its final loss is above sync's."""
    return [
        Finding(
            f"A dummy study's delay costs loss ({r.label})",
            r.gap_diff > 0,
            r.gap.p,
            fmt(r.gap_diff),
            len(seed_gaps(r)),
            need=2,
        )
        for r in rows
        if not r.is_sync and math.isfinite(r.gap_diff)
    ]


STUDY = register(
    Study(
        name="dummy",
        grids=study_dummy,
        about="a test's study: AdamW at batch 4 and 8, sync / 2bw",
        order=max(s.order for s in STUDIES.values()) + 1,
        scales=("cpu",),
        claims=(claim_dummy_delay_costs_loss,),
    )
)
