"""Study 1 (`optimizers`): every registered optimizer under sync, 2bw and 2bw+EF, and the
paper's headline claim it owns: AdamW's delay gap is much larger than Muon's. Its other claim,
that EF recovers most of each gap, is the mitigations study's (`mitigations.py`)."""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any

from stalepipe.config import OptimConfig
from stalepipe.lab.analysis import stats
from stalepipe.lab.analysis.claims import (
    HEADLINE_SEEDS,
    Finding,
    regime_failure,
    scale_of,
    seed_gaps,
)
from stalepipe.lab.analysis.stats import fmt, fmt_ci
from stalepipe.lab.studies.mitigations import claim_ef_recovers_gap
from stalepipe.lab.studies.scales import SYNC, TWO_BW, TWO_BW_EF, optimizer_axis
from stalepipe.lab.studies.study import Study
from stalepipe.lab.sweeps.grid import Bundle
from stalepipe.training.delay.policies import PAPER_ASYNC

if TYPE_CHECKING:
    from stalepipe.lab.analysis.results import Row


def study_optimizers(scale: str) -> list[list[list[Bundle]]]:
    return [[optimizer_axis(scale), [SYNC, TWO_BW, TWO_BW_EF]]]


def _defaults(optimizer: str) -> Any:
    """The optimizer's resolved default OptimConfig."""
    from stalepipe.training.optim import resolve_config  # here, not at the top: it imports torch

    return resolve_config(OptimConfig(name=optimizer))


def _main_row(rows: list[Row], optimizer: str) -> Row | None:
    """The optimizer's unmitigated 2bw row at its defaults (P = 1, the study's main training
    length, batch size and model width, the most common ones) and at the LR most of its runs use; ties (an
    even LR grid) go to the LR with the best synchronous loss."""

    def most_common(key: str) -> Any:
        top = Counter(r.config.get(key) for r in rows).most_common(1)
        return top[0][0] if top else None

    d = _defaults(optimizer)
    eq = {
        "pipeline.num_stages": 1,
        "train.num_steps": most_common("train.num_steps"),
        "train.batch_size": most_common("train.batch_size"),
        "model.dim": most_common("model.dim"),
        "optim.beta1": d.beta1,
        "optim.beta2": d.beta2,
        "optim.weight_decay": d.weight_decay,
    }
    lrs = Counter(r.config.get("optim.lr") for r in rows if r.config.get("optim.name") == optimizer)
    top = [lr for lr, n in lrs.items() if n == max(lrs.values())]

    def sync_loss(lr: object) -> float:
        c = {**eq, "optim.name": optimizer, "optim.lr": lr}
        return min(
            (
                r.mean
                for r in rows
                if r.is_sync and r.values and all(r.config.get(k) == v for k, v in c.items())
            ),
            default=math.inf,
        )

    lr = min(top, key=lambda v: (sync_loss(v), str(v))) if top else None
    want = {**eq, "optim.lr": lr}
    for r in rows:
        if r.is_sync or r.mitigations or not math.isfinite(r.gap_diff):
            continue
        c = r.config
        if (
            c.get("optim.name") == optimizer
            and r.policy == PAPER_ASYNC
            and all(c.get(k) == v for k, v in want.items())
        ):
            return r
    return None


def claim_adamw_gap_exceeds_muon(rows: list[Row]) -> list[Finding]:
    """AdamW's 2bw gap at least twice Muon's; the test: AdamW's gap minus Muon's per seed."""
    adam, muon = _main_row(rows, "adamw"), _main_row(rows, "muon")
    if not (adam and muon):
        return []
    ga, gm = seed_gaps(adam), seed_gaps(muon)
    ratio = adam.gap_diff / muon.gap_diff if muon.gap_diff > 0 else math.inf
    test = stats.seed_difference(ga, gm)
    return [
        Finding(
            "AdamW's gap (2bw) is much larger than Muon's",
            adam.gap_diff > 0 and ratio >= 2,
            test.p,
            f"AdamW {fmt(adam.gap_diff)} {fmt_ci(adam.gap)}, Muon {fmt(muon.gap_diff)} "
            f"{fmt_ci(muon.gap)}; ratio {ratio:.1f}x; difference {fmt(test.diff)} {fmt_ci(test)}",
            min(len(ga), len(gm)),
            need=HEADLINE_SEEDS,
            partly=regime_failure(adam, muon),
            scale=scale_of(adam),
        )
    ]


STUDY = Study(
    name="optimizers",
    grids=study_optimizers,
    about="6 optimizers (7 with NAdamW beyond cpu) x sync / 2bw / 2bw+EF",
    order=10,
    claims=(claim_adamw_gap_exceeds_muon, claim_ef_recovers_gap),
)
