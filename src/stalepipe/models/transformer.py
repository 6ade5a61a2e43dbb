"""The LLaMA-style decoder and its parameter/FLOP counter.

Parameter names are flat and global (`tok_emb.weight`, `layers.3.attn.wq.weight`, `norm.weight`,
`lm_head.weight`) so that a pipeline stage built by `models.partition` keeps them unchanged and a
checkpoint does not depend on how the model was split.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from stalepipe.config import ModelConfig
from stalepipe.models.layers import Block, RMSNorm, Rotary


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, V), or the mean cross-entropy when targets are given."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) for matrices; output projections scaled by 1/sqrt(2L) (GPT-2)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.ndim < 2:
                continue  # norm gains stay at 1
            scale = (
                1.0 / math.sqrt(2 * self.cfg.num_layers)
                if name.endswith(("wo.weight", "w2.weight"))
                else 1.0
            )
            nn.init.normal_(p, mean=0.0, std=std * scale)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(idx)

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx)  # (B, T, D)
        for block in self.layers:
            x = block(x, self.rope)
        return self.head(x, targets)


def build_model(
    cfg: ModelConfig,
    seed: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """A freshly initialised model; the same (cfg, seed) always gives the same weights."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Transformer(cfg)
    finally:
        torch.random.set_rng_state(gen_state)
    return model.to(device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------------------------


def block_params(cfg: ModelConfig) -> int:
    """Parameters of one transformer block."""
    attn = cfg.dim * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    return attn + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Analytic parameter counts: total, embedding, head (0 if tied), blocks, non-embedding."""
    emb = cfg.vocab_size * cfg.dim
    head = 0 if cfg.tie_embeddings else emb
    blocks = cfg.num_layers * block_params(cfg)
    total = emb + head + blocks + cfg.dim
    return {
        "total": total,
        "embedding": emb,
        "head": head,
        "blocks": blocks,
        "non_embedding": total - emb - head,
    }


def block_flops(cfg: ModelConfig, seq_len: int) -> int:
    """Forward FLOPs per token of one block: 2 per matmul MAC, plus causal attention scores."""
    matmuls = 2 * (block_params(cfg) - 2 * cfg.dim)
    # QK^T and AV: 2 * 2 * T * D per token for full attention; causal masking halves the work.
    attention = 2 * seq_len * cfg.num_heads * cfg.head_dim
    return matmuls + attention


def head_flops(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of the output head."""
    return 2 * cfg.dim * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    """Forward / backward / total training FLOPs per token (backward = 2x forward)."""
    fwd = cfg.num_layers * block_flops(cfg, seq_len) + head_flops(cfg)
    return {"forward": fwd, "backward": 2 * fwd, "total": 3 * fwd}
