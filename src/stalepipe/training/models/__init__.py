"""LLaMA-style models and their pipeline partition."""

from stalepipe.config.shapes import count_params, describe, flops_per_token, split_layers
from stalepipe.training.models.partition import (
    PipelineStage,
    StageSpec,
    build_stage,
    partition,
    stage_specs,
)
from stalepipe.training.models.transformer import Transformer, build_model, compile_blocks

__all__ = [
    "PipelineStage",
    "StageSpec",
    "Transformer",
    "build_model",
    "build_stage",
    "compile_blocks",
    "count_params",
    "describe",
    "flops_per_token",
    "partition",
    "split_layers",
    "stage_specs",
]
