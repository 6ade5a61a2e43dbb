"""What the studies share: the scales a study runs at, each scale's base config, each
optimizer's LR there, the arms most studies cross and the axes several build (LR, length).
A study's own constants (its sizes, lengths, LRs) live in its module (`registry.py` says how).

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
REGIME = CPU_SCALES[1:]  # studies that need the pretraining-like scale or beyond
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


def lr_axis(scale: str, name: str) -> list[Bundle]:
    """The optimizer's LR for the scale, a third of it and three times it."""
    lr = float(LRS[scale].get(name, "1e-3"))
    return axis("optim.lr", [f"{lr / 3:.3g}", f"{lr:.3g}", f"{lr * 3:.3g}"])


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
