"""The paper's studies as Python presets over sweep axes (`stalepipe sweep STUDY`).

Each study is a function `(scale) -> list of grids`; a grid is a list of axes (see `grid.axis`),
and the study is the union of its grids' products times the seeds. The scales, their base
configs and each optimizer's LR at each are `studies/scales.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from stalepipe.config import (
    ExperimentConfig,
    unknown_choice,
)
from stalepipe.errors import UserError
from stalepipe.lab.analysis import claims as c
from stalepipe.lab.analysis.claims import ClaimCheck
from stalepipe.lab.studies.scales import (  # noqa: F401 - studies.X names stay importable
    CPU_SCALES,
    CPU_STEPS,
    LADDER,
    LADDER_LRS,
    LRS,
    REGIME_STEPS,
    SCALES,
    SYNC,
    TWO_BW,
    TWO_BW_EF,
    base_config,
    ladder_lrs,
    ladder_size,
    length,
    optimizer_axis,
    paper_mini_base,
    regime_base,
    study_ladder_adamw_lr2,
    study_ladder_lr,
    study_length,
    study_overhead_ladder,
    study_size,
    study_tokens,
)
from stalepipe.lab.sweeps.grid import Bundle, RunSpec, axis, dedupe, expand


def _max_depth(scale: str) -> int:
    return base_config(scale).model.num_layers


def study_optimizers(scale: str) -> list[list[list[Bundle]]]:
    return [[optimizer_axis(scale), [SYNC, TWO_BW, TWO_BW_EF]]]


MOMENTA = ("0.8", "0.9", "0.95", "0.98")


def _lr_axis(scale: str, name: str) -> list[Bundle]:
    """The optimizer's LR for the scale, a third of it and three times it."""
    lr = float(LRS[scale].get(name, "1e-3"))
    return axis("optim.lr", [f"{lr / 3:.3g}", f"{lr:.3g}", f"{lr * 3:.3g}"])


def study_momentum(scale: str) -> list[list[list[Bundle]]]:
    if scale == "cpu":  # the LR held at each optimizer's (docs/RESULTS.md, Claim 3)
        opt2 = optimizer_axis(scale, ("adamw", "muon"))
        return [[opt2, axis("optim.beta1", MOMENTA), [SYNC, TWO_BW]]]
    # each momentum at three LRs, so the gap is read at each momentum's own best LR
    return [
        [
            optimizer_axis(scale, (name,)),
            axis("optim.beta1", MOMENTA),
            _lr_axis(scale, name),
            [SYNC, TWO_BW],
        ]
        for name in ("adamw", "muon")
    ]


CONTROLLED_MOMENTA = ("0.8", "0.9", "0.95", "0.98", "0.99")
REGIME = CPU_SCALES[1:]  # studies that need the pretraining-like scale or beyond


def study_momentum_controlled(scale: str) -> list[list[list[Bundle]]]:
    """Momentum without the confounds of study 2 (issue 34): AdamW at beta2 = 0.999 (so every
    beta1 here stays below sqrt(beta2)) and Muon, beta1 / mu in 0.8-0.99, each at the scale's
    LR, a third of it and three times it, under sync and 2bw: the gap is read at one fixed LR
    (the middle one) and with each arm at its own best LR (tuned on sync and on 2bw apart)."""
    adamw = [("adamw", {"optim.name": "adamw", "optim.beta2": "0.999"})]
    muon = [("muon", {"optim.name": "muon"})]
    return [
        [opt, axis("optim.beta1", CONTROLLED_MOMENTA), _lr_axis(scale, name), [SYNC, TWO_BW]]
        for name, opt in (("adamw", adamw), ("muon", muon))
    ]


def study_mitigations(scale: str) -> list[list[list[Bundle]]]:
    steps = base_config(scale).train.num_steps
    variants: list[Bundle] = [
        SYNC,
        TWO_BW,
        TWO_BW_EF,
        (
            "2bw+taylor",
            {"delay.policy": "2bw", "delay.taylor": "0.1", "delay.taylor_adaptive": "true"},
        ),
        ("2bw+syncstart", {"delay.policy": "2bw", "delay.sync_start": str(max(steps // 10, 1))}),
        ("2bw+synccool", {"delay.policy": "2bw", "delay.sync_cooldown": "0.2"}),
        (
            "2bw+ef+synccool",
            {"delay.policy": "2bw", "delay.ef": "true", "delay.sync_cooldown": "0.2"},
        ),
    ]
    if scale != "cpu":  # the correctors beyond the paper (docs/delay.md; untuned lambda 0.1)
        variants += [
            ("2bw+taylor-const", {"delay.policy": "2bw", "delay.taylor": "0.1"}),
            (
                "2bw+dcasgd-ema",
                {"delay.policy": "2bw", "delay.taylor": "0.1", "delay.taylor_curvature": "ema"},
            ),
            ("2bw+wpred", {"delay.policy": "2bw", "delay.weight_pred": "true"}),
            ("2bw+adamom", {"delay.policy": "2bw", "delay.adaptive_momentum": "true"}),
            # adaptive momentum where it was designed: per-stage delays (tau 3, 2, 1, 0 at
            # P = 4); at P = 1 under 2bw (tau = P) it sets every momentum to the 0.99 cap
            ("pipedream_P4", {"delay.policy": "pipedream", "pipeline.num_stages": "4"}),
            (
                "pipedream_P4+adamom",
                {
                    "delay.policy": "pipedream",
                    "pipeline.num_stages": "4",
                    "delay.adaptive_momentum": "true",
                },
            ),
            # PipeMare's LR (identity at tau = 1, so not under 2bw): stage s starts at
            # lr / tau_s and reaches lr over the first tenth of the run (the LR warmup here)
            (
                "pipedream_P4+pipemare",
                {
                    "delay.policy": "pipedream",
                    "pipeline.num_stages": "4",
                    "delay.lr_correction_steps": str(max(steps // 10, 1)),
                },
            ),
        ]
    return [[optimizer_axis(scale, ("adamw", "muon")), variants]]


def _depths(scale: str) -> list[int]:
    return [p for p in (2, 4, 8, 16) if p <= _max_depth(scale)]


def study_depth(scale: str) -> list[list[list[Bundle]]]:
    policies = [("pipedream", {"delay.policy": "pipedream"}), TWO_BW]
    opt = optimizer_axis(scale, ("adamw",) if scale == "cpu" else ("adamw", "muon"))
    return [[opt, [SYNC]], [opt, policies, axis("pipeline.num_stages", _depths(scale))]]


def study_hparams(scale: str) -> list[list[list[Bundle]]]:
    bs = base_config(scale).train.batch_size
    grids = []
    for name in ("adamw",) if scale == "cpu" else ("adamw", "muon"):
        opt = optimizer_axis(scale, (name,))
        grids += [
            [opt, axis("train.batch_size", [bs // 2, bs, bs * 2]), [SYNC, TWO_BW]],
            [opt, _lr_axis(scale, name), [SYNC, TWO_BW]],
            [opt, _wd_axis(scale, name), [SYNC, TWO_BW]],
        ]
    return grids


def _wd_axis(scale: str, name: str) -> list[Bundle]:
    """No weight decay, the optimizer's default and three times it (AdamW 0.1, Muon 0.01)."""
    from stalepipe.training.optim import resolve_config  # here, not at the top: it imports torch

    wd = resolve_config(replace(base_config(scale).optim, name=name)).weight_decay
    return axis("optim.weight_decay", ["0", f"{wd:g}", f"{wd * 3:g}"])


def study_delay(scale: str) -> list[list[list[Bundle]]]:
    # N = 1 is 2bw's run: fixed:1 is the same trajectory bit for bit (tests/delay), so the
    # study shares study 1's 2bw arm instead of training it again under another name
    delays = [(f"fixed{n}", {"delay.policy": f"fixed:{n}"}) for n in (2, 4, 8)]
    return [[optimizer_axis(scale, ("adamw", "muon")), [SYNC, TWO_BW, *delays]]]


def study_ladder(scale: str) -> list[list[list[Bundle]]]:
    """Phase 2: sync / 2bw / 2bw+EF at each width's best phase-1 LR (`LADDER_LRS`), for the
    widths whose LR is chosen (phase 1 finishes the narrow ones first); the run names are phase
    1's, so its sync runs are reused."""
    grids = [
        [
            [(name, {"optim.name": name})],
            axis("optim.lr", [LADDER_LRS[name, w]]),
            [ladder_size(w, ffn, params)],
            [SYNC, TWO_BW, TWO_BW_EF],
        ]
        for name in ("adamw", "muon")
        for w, ffn, params in LADDER
        if (name, w) in LADDER_LRS
    ]
    if not grids:
        raise UserError(
            f"no ladder width has its LR yet: run `stalepipe sweep ladder-lr --scale {scale}`, "
            f"then record each best LR in studies/scales.py LADDER_LRS (docs/RESULTS.md, "
            f"'Size ladder')"
        )
    return grids


# The second corpus (issue 34): the 617 pages of Django 5.2's documentation (technical prose with
# code; the `django-docs` corpus, docs/experiments.md "Corpora") at a byte-level BPE of 2048
# trained on the train split, 15% of the pages held out (301,816 validation tokens).
CORPUS2: Bundle = (
    "django-bpe2048",
    {
        "data.corpus": "django-docs",
        "data.tokenizer": "bpe",
        "data.bpe_vocab_size": "2048",
        "data.val_fraction": "0.15",
        "model.vocab_size": "2048",
    },
)


def study_corpus2(scale: str) -> list[list[list[Bundle]]]:
    """The headline claims on the second corpus: AdamW and Muon, sync / 2bw / 2bw+EF, at the
    scale's model and LRs (tuned on Shakespeare bytes: untuned here)."""
    return [[optimizer_axis(scale, ("adamw", "muon")), [CORPUS2], [SYNC, TWO_BW, TWO_BW_EF]]]


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


@dataclass(frozen=True)
class Study:
    """A named study: its grids, what it answers, which scales it supports, and the claim
    functions (`claims.py`) its runs test, which `stalepipe report` checks."""

    name: str
    grids: Callable[[str], list[list[list[Bundle]]]]
    about: str
    scales: tuple[str, ...] = SCALES
    claims: tuple[ClaimCheck, ...] = ()

    def specs(self, scale: str, seeds: int) -> list[RunSpec]:
        if scale not in self.scales:
            raise UserError(
                f"study {self.name} runs at --scale {', '.join(self.scales)}, not {scale!r}"
            )
        specs = dedupe(s for g in self.grids(scale) for s in expand(g, seeds))
        # seed-major order: an interrupted sweep has every configuration at the first seeds
        return sorted(specs, key=lambda s: s.seed)

    def base(self, scale: str) -> ExperimentConfig:
        return base_config(scale)


STUDIES: dict[str, Study] = {
    s.name: s
    for s in [
        Study(
            "optimizers",
            study_optimizers,
            "6 optimizers (7 with NAdamW beyond cpu) x sync / 2bw / 2bw+EF",
            claims=(c.claim_adamw_gap_exceeds_muon, c.claim_ef_recovers_gap),
        ),
        Study(
            "momentum",
            study_momentum,
            "AdamW & Muon beta1 in 0.8-0.98 under sync and 2bw (x 3 LRs beyond cpu)",
            claims=(c.claim_momentum_shrinks_gap,),
        ),
        Study(
            "mitigations",
            study_mitigations,
            "EF, Taylor, sync start/cooldown, EF+cooldown; the correctors beyond cpu",
            claims=(c.claim_ef_recovers_gap,),
        ),
        Study(
            "depth",
            study_depth,
            "pipedream vs 2bw for P in 2-16 (AdamW, + Muon beyond cpu)",
            claims=(c.claim_pipedream_gap_grows_with_depth,),
        ),
        Study(
            "hparams",
            study_hparams,
            "batch size, LR, weight decay (one at a time; AdamW, + Muon beyond cpu)",
        ),
        Study(
            "delay",
            study_delay,
            "sync, 2bw (N = 1) and fixed:N for N in 2, 4, 8",
            claims=(c.claim_gap_grows_with_delay,),
        ),
        Study("tokens", study_tokens, "the gap as the training length grows (x1/4 .. x2)"),
        Study(
            "momentum-controlled",
            study_momentum_controlled,
            "beta1 0.8-0.99 x 3 LRs",
            scales=REGIME,
        ),
        Study("length", study_length, "AdamW & Muon sync / 2bw / 2bw+EF at 1x, 2x, 4x the tokens"),
        Study("size", study_size, "0.43M, 1.7M, 3.6M params x 3 arms", scales=REGIME),
        Study("ladder-lr", study_ladder_lr, "size ladder, phase 1: sync LR grid", scales=REGIME),
        Study("ladder", study_ladder, "size ladder: 5 widths x 3 arms", scales=REGIME),
        Study(
            "ladder-adamw-lr2",
            study_ladder_adamw_lr2,
            "size ladder: AdamW sync / 2bw at each width's second-best LR",
            scales=REGIME,
        ),
        Study(
            "overhead-ladder",
            study_overhead_ladder,
            "Muon's token overhead at 4 widths, one token budget, 1-1.5x lengths",
            scales=REGIME,
        ),
        Study(
            "corpus2",
            study_corpus2,
            "AdamW & Muon sync / 2bw / 2bw+EF on Django's docs at a 2048 BPE",
            scales=REGIME,
            claims=(c.claim_adamw_gap_exceeds_muon, c.claim_ef_recovers_gap),
        ),
        Study(
            "paper-mini",
            study_paper_mini,
            "CPU check of the paper's 4 qualitative claims",
            scales=("cpu",),
            claims=(
                c.claim_adamw_gap_exceeds_muon,
                c.claim_ef_recovers_gap,
                c.claim_momentum_shrinks_gap,
                c.claim_pipedream_gap_grows_with_depth,
            ),
        ),
    ]
}


def declared_claims() -> list[ClaimCheck]:
    """Every claim function some study declares, each once, in the order of first declaration
    (the report's claims table follows it)."""
    return list(dict.fromkeys(c for s in STUDIES.values() for c in s.claims))


def get_study(name: str) -> Study:
    """The study `name`; an unknown name raises ConfigError suggesting the closest one (`toy`
    is not a study here: `stalepipe sweep toy` runs the `stalepipe toy` command)."""
    if name not in STUDIES:
        raise unknown_choice("study", name, STUDIES)
    return STUDIES[name]
