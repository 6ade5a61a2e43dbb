"""Presets: named experiment configurations, as plain Python functions.

`PRESETS` maps a name (`--preset NAME`) to a function returning an `ExperimentConfig`; model-only
presets (`smollm_135m()`, `smollm_360m()`) return the published shapes for reuse.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable

from stalepipe.config import (
    ConfigError,
    DataConfig,
    ExperimentConfig,
    ModelConfig,
    PipelineConfig,
    TrainConfig,
)


def smollm_135m() -> ModelConfig:
    """SmolLM-135M (HuggingFaceTB): 30 layers, 576 dim, 9 heads, 3 kv heads, ffn 1536, tied."""
    return ModelConfig(
        vocab_size=49152,
        dim=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        ffn_dim=1536,
        max_seq_len=2048,
        rope_theta=10000.0,
        tie_embeddings=True,
        init_std=0.02,
    )


def smollm_360m() -> ModelConfig:
    """SmolLM-360M: 32 layers, 960 dim, 15 heads, 5 kv heads, ffn 2560, tied."""
    return ModelConfig(
        vocab_size=49152,
        dim=960,
        num_layers=32,
        num_heads=15,
        num_kv_heads=5,
        ffn_dim=2560,
        max_seq_len=2048,
        rope_theta=10000.0,
        tie_embeddings=True,
        init_std=0.02,
    )


def cpu_tiny() -> ExperimentConfig:
    """~0.33M parameters, byte tokenizer: for tests and the CPU demo (a step takes ~10 ms)."""
    return ExperimentConfig(
        name="cpu-tiny",
        model=ModelConfig(
            vocab_size=256,
            dim=96,
            num_layers=3,
            num_heads=4,
            num_kv_heads=2,
            ffn_dim=256,
            max_seq_len=128,
        ),
        data=DataConfig(seq_len=64),
        train=TrainConfig(steps=300, batch_size=16, warmup_steps=30, eval_every=50),
    )


def cpu_small() -> ExperimentConfig:
    """~3M parameters, byte tokenizer: the largest model that trains usefully on 2 CPU cores."""
    return ExperimentConfig(
        name="cpu-small",
        model=ModelConfig(
            vocab_size=256,
            dim=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            ffn_dim=688,
            max_seq_len=256,
        ),
        data=DataConfig(seq_len=128),
        train=TrainConfig(steps=500, batch_size=16, warmup_steps=50, eval_every=100),
    )


def _smollm_run(model: ModelConfig, name: str) -> ExperimentConfig:
    return ExperimentConfig(
        name=name,
        model=model,
        data=DataConfig(tokenizer="gpt2", seq_len=1024),
        train=TrainConfig(
            steps=10000,
            batch_size=256,
            num_microbatches=8,
            warmup_steps=500,
            lr_schedule="wsd",
            eval_every=500,
            ckpt_every=1000,
            device="cuda",
            dtype="bfloat16",
        ),
    )


def smollm_135m_run() -> ExperimentConfig:
    """SmolLM-135M on GPT-2 tokens (vocab padded to 50304), WSD schedule, for GPUs."""
    return _smollm_run(dataclasses.replace(smollm_135m(), vocab_size=50304), "smollm-135m")


def smollm_360m_run() -> ExperimentConfig:
    """SmolLM-360M on GPT-2 tokens (vocab padded to 50304), WSD schedule, for GPUs."""
    return _smollm_run(dataclasses.replace(smollm_360m(), vocab_size=50304), "smollm-360m")


def cpu_moe() -> ExperimentConfig:
    """~1.0M parameters, 0.33M active: cpu-tiny with 8 experts (top-2) per layer, for CPU."""
    base = cpu_tiny()
    # Each expert is half as wide as cpu-tiny's MLP, so a token's two experts have exactly
    # cpu-tiny's MLP parameters: the two presets differ only by the routers (benchmarks compare).
    model = dataclasses.replace(base.model, num_experts=8, top_k=2, expert_ffn_dim=128)
    return dataclasses.replace(base, name="cpu-moe", model=model)


def moe_10b() -> ExperimentConfig:
    """10.2B parameters, 1.7B active: 24 layers, 64 experts (top-8), OLMoE/Mixtral style, GPUs.

    Our own choice (the paper's 10B MoE configuration is not public): OLMoE-1B-7B's expert shape
    (64 experts of width 1024, top-8, dim 2048, 16 heads; Muennighoff et al. 2024) at 24 instead
    of 16 layers, GQA with 8 kv heads, untied embeddings, no shared expert and no dense layers,
    so the checkpoint exports as Mixtral. 95k steps of 512 x 4096 tokens = 199B tokens.
    """
    return ExperimentConfig(
        name="moe-10b",
        model=ModelConfig(
            vocab_size=50304,
            dim=2048,
            num_layers=24,
            num_heads=16,
            num_kv_heads=8,
            ffn_dim=1024,
            max_seq_len=4096,
            rope_theta=10000.0,
            tie_embeddings=False,
            init_std=0.02,
            num_experts=64,
            top_k=8,
            expert_ffn_dim=1024,
            aux_loss_weight=0.01,
            z_loss_weight=0.001,
        ),
        data=DataConfig(tokenizer="gpt2", seq_len=4096),
        pipeline=PipelineConfig(num_stages=8, engine="distributed"),
        train=TrainConfig(
            steps=95000,
            batch_size=512,
            num_microbatches=32,
            warmup_steps=2000,
            lr_schedule="wsd",
            eval_every=1000,
            ckpt_every=1000,
            device="cuda",
            dtype="bfloat16",
        ),
    )


PRESETS: dict[str, Callable[[], ExperimentConfig]] = {
    "cpu-tiny": cpu_tiny,
    "cpu-small": cpu_small,
    "cpu-moe": cpu_moe,
    "smollm-135m": smollm_135m_run,
    "smollm-360m": smollm_360m_run,
    "moe-10b": moe_10b,
}


def get_preset(name: str) -> ExperimentConfig:
    """The preset `name`; an unknown name raises ConfigError suggesting the closest one."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=1, cutoff=0.4)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)}){hint}")
    return PRESETS[name]()
