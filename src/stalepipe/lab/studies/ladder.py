"""The size ladder (issue 41; docs/RESULTS.md, "Size ladder", written before its runs), one
study in two phases, each registered: `ladder-lr` (phase 1, sync's LR grid per width) and
`ladder` (phase 2, sync / 2bw / 2bw+EF at each width's best phase-1 LR). One module, because
the phases are one registered design: the widths, the token rule and the LR rule are phase 1's,
and phase 2 reads the LRs phase 1 chose (`LADDER_LRS`), under phase 1's run names."""

from __future__ import annotations

from stalepipe.errors import UserError
from stalepipe.lab.studies.scales import REGIME, SYNC, TWO_BW, TWO_BW_EF
from stalepipe.lab.studies.study import Study
from stalepipe.lab.sweeps.grid import Bundle, axis

# The size ladder (issue 41; docs/RESULTS.md, "Size ladder", written before its runs): five
# widths of the cpu-regime model (4 blocks, 4 heads, 2 KV heads; SwiGLU width 8/3 x width
# rounded up to a multiple of 32), 17.2x in non-embedding parameters (the third number, a test
# counts them). Each trains LADDER_TOKENS_PER_PARAM tokens per non-embedding parameter in the
# scale's 16 x 128-token batches (the widest reads its 4.78M training tokens 1.8 times), with
# 10% warmup, cosine to 10%, 20 periodic evaluations and, at the end, the whole 273,774-token
# validation split of Shakespeare at val_fraction 0.08 (`train.final_eval_full`).
LADDER = (
    (32, 96, 49_440),
    (48, 128, 101_808),
    (64, 192, 197_184),
    (96, 256, 406_368),
    (136, 384, 849_864),
)
LADDER_TOKENS_PER_PARAM = 10
# Phase 1 (`ladder-lr`, sync, seed 0): AdamW at 3e-3 x 96 / width (muP's 1/width from the scale's
# tuned LR) and Muon at 0.01 (its update is normalised per matrix), each x1/2, x1, x2; a best LR
# on an edge of its grid adds the next point out (x2 further), at most twice.
LADDER_CENTRE = {"adamw": 3e-3 * 96, "muon": 0.01}
# The edge rule's points, added as phase 1's results asked for them (docs/RESULTS.md): at
# widths 32-64, AdamW's best at 32 was its lowest LR and Muon's at 32 and 48 its highest.
LADDER_EDGE_LRS: dict[tuple[str, int], tuple[str, ...]] = {
    ("adamw", 32): ("0.00225",),
    ("muon", 32): ("0.04", "0.08"),  # 0.04 was best again: the rule's second (last) point
    ("muon", 48): ("0.04",),
    ("adamw", 96): ("0.012",),  # 0.006 best of 0.0015 / 0.003 / 0.006
    ("adamw", 136): ("0.00053",),  # 0.00106 best of 0.00106 / 0.00212 / 0.00424
}
# Phase 2 (`ladder`): each (optimizer, width)'s best phase-1 LR (lowest whole-split val loss,
# interior to its grid), recorded here once read; phase 2 runs once every width has one.
LADDER_LRS: dict[tuple[str, int], str] = {
    ("adamw", 32): "0.0045",
    ("adamw", 48): "0.006",
    ("adamw", 64): "0.0045",
    ("adamw", 96): "0.006",
    ("adamw", 136): "0.00106",
    ("muon", 32): "0.04",
    ("muon", 48): "0.02",
    ("muon", 64): "0.01",
    ("muon", 96): "0.01",
    ("muon", 136): "0.01",  # 0.005 within 0.0007 of it: the rule takes the lowest loss
}


def ladder_size(width: int, ffn: int, params: int) -> Bundle:
    """The overrides of one rung: model shape, length by the tokens-per-parameter rule, the
    schedule scaled with it, the larger validation split, scored whole at the end."""
    tokens_per_step = 16 * 128
    steps = round(LADDER_TOKENS_PER_PARAM * params / tokens_per_step)
    return (
        f"d{width}",
        {
            "model.dim": str(width),
            "model.ffn_dim": str(ffn),
            "model.num_heads": "4",
            "model.num_kv_heads": "2",
            "train.num_steps": str(steps),
            "train.warmup_steps": str(steps // 10),
            "train.eval_every": str(steps // 20),
            "train.final_eval_full": "true",
            "data.val_fraction": "0.08",
            "data.data_dir": "data_cache/shakespeare-byte-val0.08",  # not the 0.05 split's
        },
    )


def ladder_lrs(name: str, width: int) -> list[str]:
    """Phase 1's three LRs of `name` at `width` (LADDER_CENTRE)."""
    centre = LADDER_CENTRE[name] / (width if name == "adamw" else 1)
    return [f"{centre * f:.3g}" for f in (0.5, 1, 2)] + list(LADDER_EDGE_LRS.get((name, width), ()))


def study_ladder_lr(scale: str) -> list[list[list[Bundle]]]:
    """Phase 1 of the size ladder: sync's LR grid per width and optimizer (seed 0)."""
    return [
        [[(name, {"optim.name": name})], axis("optim.lr", ladder_lrs(name, w)), [rung], [SYNC]]
        for name in ("adamw", "muon")
        for w, ffn, params in LADDER
        for rung in [ladder_size(w, ffn, params)]
    ]


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


STUDY = (
    Study(
        name="ladder-lr",
        grids=study_ladder_lr,
        about="size ladder, phase 1: sync LR grid",
        order=110,
        scales=REGIME,
    ),
    Study(
        name="ladder",
        grids=study_ladder,
        about="size ladder: 5 widths x 3 arms",
        order=120,
        scales=REGIME,
    ),
)
