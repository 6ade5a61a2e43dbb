"""The scales a study runs at: each scale's base config and each optimizer's LR there.

    cpu         the `paper-mini` model (4 blocks, so pipeline depths 2 and 4 exist),
                Shakespeare bytes, 200 steps: 20-40 s per run on one core
    cpu-regime  issue 17's scale, chosen by measurement (`benchmarks/studies/regime_probe.py`,
                docs/RESULTS.md "Regime"): every run leaves the unigram plateau early and the
                seed spread is small against AdamW's gap (`regime_base`)
    135m    SmolLM-135M on GPT-2 tokens (`smollm-135m` preset), GPUs
    360m    SmolLM-360M (`smollm-360m` preset), GPUs

Learning rates: at each scale every optimizer runs at its own LR (`LRS`): tuned on the sync
baseline at the CPU scales (docs/RESULTS.md says how), the optimizers' published defaults for
the GPU scales (docs/optimizers.md), which you should retune for your data before a large sweep.
"""

from __future__ import annotations

import dataclasses

from stalepipe.config import OPTIMIZERS, DataConfig, ExperimentConfig, ModelConfig, TrainConfig
from stalepipe.errors import UserError
from stalepipe.lab.sweeps.grid import Bundle, axis
from stalepipe.presets import get_preset

SCALES = ("cpu", "cpu-regime", "135m", "360m")
# The three arms most studies cross: the synchronous baseline, a one-step delay, and with EF.
SYNC: Bundle = ("sync", {"delay.policy": "sync"})
TWO_BW: Bundle = ("2bw", {"delay.policy": "2bw"})
TWO_BW_EF: Bundle = ("2bw+ef", {"delay.policy": "2bw", "delay.ef": "true"})
CPU_SCALES = ("cpu", "cpu-regime")
# The `cpu` studies' results (docs/RESULTS.md) predate NAdamW: that scale leaves it out.
CPU_LEFT_OUT = ("nadamw",)
CPU_STEPS = 200


def paper_mini_base() -> ExperimentConfig:
    """The CPU study model: ~0.2M parameters, 4 blocks of width 64 (so P = 2, 4 exist),
    byte-level Shakespeare, 16 x 64 tokens per step, 10% warmup + cosine to 10%."""
    return ExperimentConfig(
        name="paper-mini",
        model=ModelConfig(
            vocab_size=256,
            dim=64,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            ffn_dim=176,
            max_seq_len=64,
        ),
        data=DataConfig(seq_len=64),
        train=TrainConfig(
            num_steps=CPU_STEPS,
            batch_size=16,
            warmup_steps=CPU_STEPS // 10,
            eval_every=CPU_STEPS // 4,
            num_eval_batches=16,
            log_every=10,
            progress=False,
            threads=1,
        ),
    )


# The `cpu-regime` scale (issue 17), chosen with benchmarks/studies/regime_probe.py: see
# docs/RESULTS.md "Regime" for the probes that ruled out cheaper candidates.
REGIME_STEPS = 1200


def regime_base() -> ExperimentConfig:
    """The `cpu-regime` study model: `paper_mini_base` at width 96 (~0.4M parameters; P = 2, 4
    exist), 16 x 128 tokens per step for REGIME_STEPS steps, 10% warmup + cosine to 10%, 20
    evaluations of 8 batches (the token overhead reads the eval curve)."""
    base = paper_mini_base()
    return dataclasses.replace(
        base,
        name="cpu-regime",
        model=dataclasses.replace(base.model, dim=96, ffn_dim=256, max_seq_len=128),
        data=dataclasses.replace(base.data, seq_len=128),
        train=dataclasses.replace(
            base.train,
            num_steps=REGIME_STEPS,
            warmup_steps=REGIME_STEPS // 10,
            eval_every=REGIME_STEPS // 20,
            num_eval_batches=8,
        ),
    )


# Per-optimizer peak LR by scale (matrix LR for muon; its AdamW part uses adam_lr = its default).
LRS: dict[str, dict[str, str]] = {
    "cpu": {
        "adamw": "3e-3",
        "muon": "0.05",
        "soap": "1e-2",
        "adan": "3e-2",
        "lion": "3e-3",
        "mars": "3e-2",
    },
    # tuned on sync, seed 0 (docs/RESULTS.md "Regime"), each interior to its grid
    "cpu-regime": {
        "adamw": "3e-3",
        "muon": "0.01",
        "soap": "1e-2",
        "adan": "3e-2",
        "lion": "3e-4",
        "nadamw": "1e-2",
        "mars": "3e-3",
    },
    "135m": {},  # optimizers' defaults (docs/optimizers.md)
    "360m": {},
}


def base_config(scale: str) -> ExperimentConfig:
    """The base config every run of a study at `scale` starts from."""
    if scale == "cpu":
        return paper_mini_base()
    if scale == "cpu-regime":
        return regime_base()
    if scale == "135m":
        return get_preset("smollm-135m")
    if scale == "360m":
        return get_preset("smollm-360m")
    raise UserError(f"--scale must be one of {', '.join(SCALES)}, got {scale!r}")


def study_optimizer_names(scale: str) -> tuple[str, ...]:
    """The optimizers a study of every optimizer runs at `scale`: the registry's, in its order
    (an optimizer registered later joins at its `LRS` entry, or 1e-3), less `CPU_LEFT_OUT` at
    `cpu`."""
    left_out = CPU_LEFT_OUT if scale == "cpu" else ()
    return tuple(n for n in OPTIMIZERS if n not in left_out)


def optimizer_axis(scale: str, names: tuple[str, ...] | None = None) -> list[Bundle]:
    """Optimizers (default: all the scale studies), each at its own LR for the scale."""
    if names is None:
        names = study_optimizer_names(scale)
    out = []
    for name in names:
        o = {"optim.name": name}
        if name in LRS[scale]:
            o["optim.lr"] = LRS[scale][name]
        out.append((name, o))
    return out


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


def ladder_lrs(name: str, width: int) -> list[str]:
    """Phase 1's three LRs of `name` at `width` (LADDER_CENTRE)."""
    centre = LADDER_CENTRE[name] / (width if name == "adamw" else 1)
    return [f"{centre * f:.3g}" for f in (0.5, 1, 2)] + list(LADDER_EDGE_LRS.get((name, width), ()))


# --------------------------------------------------------------------------------------------
# The studies that vary length or size (registered in `experiments.studies`): `tokens`,
# `length`, `size`, the size ladder's phase 1 (`ladder-lr`) and the overhead ladder. The
# ladder's phase 2 stays beside the registry (`studies.study_ladder`): it reads phase 1's LRs.
# --------------------------------------------------------------------------------------------


def length(n: int, evals: int = 4) -> Bundle:
    """A training length of n steps (warmup 10%, `evals` evaluations)."""
    return (
        f"steps{n}",
        {
            "train.num_steps": str(n),
            "train.warmup_steps": str(max(n // 10, 1)),
            "train.eval_every": str(max(n // evals, 1)),
        },
    )


def study_tokens(scale: str) -> list[list[list[Bundle]]]:
    tc = base_config(scale).train
    steps, evals = tc.num_steps, tc.num_steps // (tc.eval_every or tc.num_steps)
    lengths = [steps // 4, steps // 2, steps, steps * 2]
    grid_steps = [length(n, evals) for n in lengths]
    return [[optimizer_axis(scale, ("adamw", "muon")), grid_steps, [SYNC, TWO_BW]]]


def study_length(scale: str) -> list[list[list[Bundle]]]:
    """AdamW and Muon, sync / 2bw / 2bw+EF at 1x, 2x and 4x the scale's tokens (the schedule
    stretched: warmup a tenth, the same number of evaluations); 1x is study 1's run."""
    tc = base_config(scale).train
    steps, evals = tc.num_steps, tc.num_steps // (tc.eval_every or tc.num_steps)
    lengths = [length(n, evals) for n in (steps, steps * 2, steps * 4)]
    return [[optimizer_axis(scale, ("adamw", "muon")), lengths, [SYNC, TWO_BW, TWO_BW_EF]]]


# Model sizes of the size study: (width, SwiGLU width, heads), 4 layers each; 0.43M, 1.67M and
# 3.62M parameters at the byte vocabulary. Every size trains on the scale's tokens (the same
# budget, so larger models are further from convergence); AdamW's LR scales as 1/width from the
# scale's tuned value (the muP rule for hidden matrices), Muon's is kept (its update is
# normalised per matrix).
SIZES = ((96, 256, 4), (192, 512, 4), (288, 768, 6))


def _size(width: int, ffn: int, heads: int) -> Bundle:
    return (
        f"d{width}",
        {"model.dim": str(width), "model.ffn_dim": str(ffn), "model.num_heads": str(heads)},
    )


def study_size(scale: str) -> list[list[list[Bundle]]]:
    base_width = base_config(scale).model.dim
    grids = []
    for name in ("adamw", "muon"):
        for width, ffn, heads in SIZES:
            lr = float(LRS[scale].get(name, "1e-3"))
            lr = lr * base_width / width if name == "adamw" else lr
            opt = [(name, {"optim.name": name, "optim.lr": f"{lr:.3g}"})]
            grids.append([opt, [_size(width, ffn, heads)], [SYNC, TWO_BW, TWO_BW_EF]])
    return grids


def study_ladder_lr(scale: str) -> list[list[list[Bundle]]]:
    """Phase 1 of the size ladder: sync's LR grid per width and optimizer (seed 0)."""
    return [
        [[(name, {"optim.name": name})], axis("optim.lr", ladder_lrs(name, w)), [rung], [SYNC]]
        for name in ("adamw", "muon")
        for w, ffn, params in LADDER
        for rung in [ladder_size(w, ffn, params)]
    ]


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
