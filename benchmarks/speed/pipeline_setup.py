"""What pipeline_throughput.py and torch_pipelining.py share: P, the benchmark's model, one
process's stage of it with its AdamW, and a step's random batch."""

from __future__ import annotations

import torch

from stalepipe.config import ModelConfig, OptimConfig
from stalepipe.training.models import build_model, partition
from stalepipe.training.optim import build_optimizer, resolve_config
from stalepipe.training.optim.lr_schedule import set_peak_lr
from stalepipe.training.peers.group import init_from_env

P = 2


def setup_stage(model_cfg: ModelConfig):
    """Join the process group (gloo, one thread): this rank, its stage of P, the stage's owned
    parameters and an AdamW over them at its peak LR."""
    rank = init_from_env("gloo", 120).rank
    torch.set_num_threads(1)
    full = build_model(model_cfg, seed=0)
    stage = partition(full, P)[rank]
    owned = stage.owned_parameters()
    opt = build_optimizer(resolve_config(OptimConfig(name="adamw")), list(owned.items()))
    set_peak_lr(opt)
    return rank, stage, owned, opt


def bench_model(dim: int, layers: int, seq: int) -> ModelConfig:
    """The benchmark's model: byte vocabulary, 8 heads (4 kv), a SwiGLU of 8/3 dim, untied."""
    return ModelConfig(
        vocab_size=256,
        dim=dim,
        num_layers=layers,
        num_heads=8,
        num_kv_heads=4,
        ffn_dim=int(dim * 8 / 3) // 8 * 8,
        max_seq_len=seq,
        tie_embeddings=False,
    )


def random_batch(step: int, m: int, mb: int, T: int, V: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(V, (m * mb, T), generator=g)
    y = torch.randint(V, (m * mb, T), generator=g)
    return x, y
