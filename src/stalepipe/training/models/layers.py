"""Building blocks of a LLaMA-style decoder, top to bottom: norm, RoPE, attention, MLP, block.

Shape legend:
    B  batch (sequences in a microbatch)     T  sequence length
    D  model width (dim)                     H  query heads, Hkv key/value heads
    Dh head width (D / H)                    F  SwiGLU hidden width (ffn_dim)
The MLP of a block is a dense SwiGLU or, in Mixture-of-Experts layers, `moe.MoE` (see there).
No biases. Dropout (`model.dropout`, default 0 as in LLM pretraining; nanoGPT's small
Shakespeare models use 0.2) acts on the attention probabilities and on both residual branches,
in training mode only. Its masks come from the default generator, which both engines seed per
(stage, step, microbatch), so delayed training stays exactly reproducible with it on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stalepipe.config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019), computed in float32 for stability."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding tables (Su et al. 2021), half-split (GPT-NeoX/LLaMA-HF) layout.

    The cos/sin tables are non-persistent buffers: derived from the config, never checkpointed.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Compute the tables (again: after `to_empty` from the meta device)."""
        if self.cos.is_meta:
            return
        Dh = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, Dh, 2, dtype=torch.float64) / Dh))
        t = torch.arange(self.max_seq_len, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # (T_max, Dh/2)
        self.cos.copy_(freqs.cos().float())
        self.sin.copy_(freqs.sin().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape (B, heads, T, Dh)."""
        T = x.shape[-2]
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)  # (T, Dh/2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    """Causal grouped-query attention through `scaled_dot_product_attention`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        k = (
            self.wk(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        )  # (B, Hkv, T, Dh)
        v = self.wv(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q), rope(k)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )  # (B, H, T, Dh)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) (Shazeer 2020)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    `mlp` defaults to a dense SwiGLU of width ffn_dim; the Transformer passes an `moe.MoE`
    (same call signature) for Mixture-of-Experts layers.
    """

    def __init__(self, cfg: ModelConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = mlp if mlp is not None else SwiGLU(cfg.dim, cfg.ffn_dim)
        self.drop = nn.Dropout(cfg.dropout)  # on each residual branch (identity when 0)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), rope))
        return x + self.drop(self.mlp(self.mlp_norm(x)))
