"""Tiny models and batches shared by the delay tests (2-4 layers, dim 32, vocab 64, seq 16)."""

from __future__ import annotations

import pytest
import torch

from stalepipe.config import ModelConfig

VOCAB = 64


def tiny_model_cfg(num_layers: int = 4, tie: bool = True) -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB,
        dim=32,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        ffn_dim=64,
        max_seq_len=16,
        tie_embeddings=tie,
    )


def make_batches(k: int, num_microbatches: int = 2, mb_size: int = 2, seq: int = 16):
    """Batch of step k: a pure function of k (as the real loader)."""
    g = torch.Generator().manual_seed(1000 + k)
    x = torch.randint(0, VOCAB, (num_microbatches * mb_size, seq + 1), generator=g)
    xs, ys = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    return list(zip(xs.chunk(num_microbatches), ys.chunk(num_microbatches), strict=True))


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
