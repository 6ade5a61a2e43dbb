"""Model shapes the simulator and the cluster model know by name: the training presets of
`presets.PRESETS` and what-if shapes too large to train here (`SIM_MODELS`)."""

from __future__ import annotations

import dataclasses

from stalepipe.config import ConfigError, ModelConfig
from stalepipe.presets import PRESETS

# Shapes for what-if simulations only (too large to train here); training presets live in
# presets.PRESETS and are accepted too.
SIM_MODELS: dict[str, ModelConfig] = {
    # ~10.9B parameters: a LLaMA-3-8B-style block (GQA 32/8 heads, SwiGLU 14336) at 48 layers,
    # GPT-2 vocabulary padded to 50304, untied head, 4096-token context.
    "llama-10b": ModelConfig(
        vocab_size=50304,
        dim=4096,
        num_layers=48,
        num_heads=32,
        num_kv_heads=8,
        ffn_dim=14336,
        max_seq_len=4096,
        rope_theta=500000.0,
        tie_embeddings=False,
    ),
}

# Llama 3 / 3.1 8B (Meta's model card): llama-10b's block at 32 layers, a 128256-token
# vocabulary, 8192-token context; for checking the cluster model against published figures.
SIM_MODELS["llama3-8b"] = dataclasses.replace(
    SIM_MODELS["llama-10b"], vocab_size=128256, num_layers=32, max_seq_len=8192
)

# Llama 3 70B and 405B (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3: layers, model
# dimension, FFN dimension, attention / key-value heads; vocabulary 128,000 in the table,
# 128,256 in the released checkpoints, used here as torchtitan does)
SIM_MODELS["llama3-70b"] = dataclasses.replace(
    SIM_MODELS["llama3-8b"], dim=8192, num_layers=80, num_heads=64, ffn_dim=28672
)
SIM_MODELS["llama3-405b"] = dataclasses.replace(
    SIM_MODELS["llama3-8b"], dim=16384, num_layers=126, num_heads=128, ffn_dim=53248
)


# DeepSeek-V3's shape (DeepSeek-AI 2024, arXiv 2412.19437, Section 4.2: 61 layers, hidden 7168,
# 128 heads, the first 3 layers dense (FFN 18432), then 1 shared and 256 routed experts of
# width 2048 with 8 active, vocabulary 129K; 671B parameters, 37B active) with two stated
# departures: multi-head latent attention is costed as plain multi-head attention of the same
# heads (205M parameters a layer against MLA's ~187M: +10 % on attention, ~1 % of the total),
# and the multi-token-prediction module is left out. Counts: 672.2B, 38.7B active.
SIM_MODELS["deepseek-v3"] = ModelConfig(
    vocab_size=129280,
    dim=7168,
    num_layers=61,
    num_heads=128,
    num_kv_heads=128,
    ffn_dim=18432,
    max_seq_len=4096,
    rope_theta=10000.0,
    tie_embeddings=False,
    num_experts=256,
    top_k=8,
    expert_ffn_dim=2048,
    num_shared_experts=1,
    num_dense_layers=3,
)


def model_config(name: str) -> ModelConfig:
    """A model shape by name: SIM_MODELS or a training preset of presets.PRESETS."""
    if name in SIM_MODELS:
        return SIM_MODELS[name]
    if name in PRESETS:
        return PRESETS[name]().model
    names = ", ".join([*SIM_MODELS, *PRESETS])
    raise ConfigError(f"unknown --model {name!r}; choose from {names}")


__all__ = ["SIM_MODELS", "model_config"]
