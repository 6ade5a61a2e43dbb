"""Presets: named experiment configurations, as plain Python functions.

`PRESETS` maps a name (`--preset NAME`) to a function returning an `ExperimentConfig`; model-only
presets (`smollm_135m()`, `smollm_360m()`) return the published shapes for reuse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from stalepipe.config import (
    DataConfig,
    ExperimentConfig,
    ModelConfig,
    PipelineConfig,
    TrainConfig,
    unknown_choice,
)

# The GPT-2 tokenizer's 50257 ids, padded to a multiple of 64 for the matmuls.
GPT2_VOCAB_SIZE = 50304


def _smollm(**shape: int) -> ModelConfig:
    """A SmolLM shape (HuggingFaceTB): the family shares its vocab, context, RoPE and tied head."""
    return ModelConfig(
        vocab_size=49152,
        max_seq_len=2048,
        rope_theta=10000.0,
        tie_embeddings=True,
        init_std=0.02,
        **shape,
    )


def smollm_135m() -> ModelConfig:
    """SmolLM-135M (HuggingFaceTB): 30 layers, 576 dim, 9 heads, 3 kv heads, ffn 1536, tied."""
    return _smollm(dim=576, num_layers=30, num_heads=9, num_kv_heads=3, ffn_dim=1536)


def smollm_360m() -> ModelConfig:
    """SmolLM-360M: 32 layers, 960 dim, 15 heads, 5 kv heads, ffn 2560, tied."""
    return _smollm(dim=960, num_layers=32, num_heads=15, num_kv_heads=5, ffn_dim=2560)


def byte_model(**shape: Any) -> ModelConfig:
    """A model over the byte tokenizer's 256 ids; `shape` gives the other ModelConfig fields."""
    return ModelConfig(vocab_size=256, **shape)


def cpu_byte_run(
    name: str, model: ModelConfig, *, seq_len: int, steps: int, **train: Any
) -> ExperimentConfig:
    """A CPU run on byte-level Shakespeare: 16 sequences of `seq_len` per step, 10% linear
    warmup; `train` gives the other TrainConfig fields."""
    return ExperimentConfig(
        name=name,
        model=model,
        data=DataConfig(seq_len=seq_len),
        train=TrainConfig(num_steps=steps, batch_size=16, warmup_steps=steps // 10, **train),
    )


def cpu_tiny() -> ExperimentConfig:
    """~0.33M parameters, byte tokenizer: for tests and the CPU demo (a step takes ~10 ms)."""
    model = byte_model(
        dim=96, num_layers=3, num_heads=4, num_kv_heads=2, ffn_dim=256, max_seq_len=128
    )
    return cpu_byte_run("cpu-tiny", model, seq_len=64, steps=300, eval_every=50)


def cpu_small() -> ExperimentConfig:
    """~3M parameters, byte tokenizer: the largest model that trains usefully on 2 CPU cores."""
    model = byte_model(
        dim=256, num_layers=4, num_heads=8, num_kv_heads=4, ffn_dim=688, max_seq_len=256
    )
    return cpu_byte_run("cpu-small", model, seq_len=128, steps=500, eval_every=100)


def _gpu_run(
    name: str,
    model: ModelConfig,
    *,
    seq_len: int,
    pipeline: PipelineConfig | None = None,
    **train: Any,
) -> ExperimentConfig:
    """A GPU run on GPT-2 tokens: WSD schedule, bfloat16 autocast, a checkpoint every 1000
    steps; `train` gives the other TrainConfig fields."""
    return ExperimentConfig(
        name=name,
        model=model,
        data=DataConfig(tokenizer="gpt2", seq_len=seq_len),
        pipeline=pipeline or PipelineConfig(),
        train=TrainConfig(
            lr_schedule="wsd", ckpt_every=1000, device="cuda", dtype="bfloat16", **train
        ),
    )


def _smollm_run(model: ModelConfig, name: str) -> ExperimentConfig:
    return _gpu_run(
        name,
        dataclasses.replace(model, vocab_size=GPT2_VOCAB_SIZE),
        seq_len=1024,
        num_steps=10000,
        batch_size=256,
        num_microbatches=8,
        warmup_steps=500,
        eval_every=500,
    )


def smollm_135m_run() -> ExperimentConfig:
    """SmolLM-135M on GPT-2 tokens (vocab padded to 50304), WSD schedule, for GPUs."""
    return _smollm_run(smollm_135m(), "smollm-135m")


def smollm_360m_run() -> ExperimentConfig:
    """SmolLM-360M on GPT-2 tokens (vocab padded to 50304), WSD schedule, for GPUs."""
    return _smollm_run(smollm_360m(), "smollm-360m")


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
    return _gpu_run(
        "moe-10b",
        ModelConfig(
            vocab_size=GPT2_VOCAB_SIZE,
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
        seq_len=4096,
        pipeline=PipelineConfig(num_stages=8, engine="distributed"),
        num_steps=95000,
        batch_size=512,
        num_microbatches=32,
        warmup_steps=2000,
        eval_every=1000,
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
        raise unknown_choice("preset", name, PRESETS)
    return PRESETS[name]()
