"""The LLaMA-style decoder and its parameter/FLOP counter.

Parameter names are flat and global (`tok_emb.weight`, `layers.3.attn.wq.weight`, `norm.weight`,
`lm_head.weight`) so that a pipeline stage built by `models.partition` keeps them unchanged and a
checkpoint does not depend on how the model was split.

Mixture-of-Experts models (model.num_experts > 0) swap the MLP of their MoE blocks for
`moe.MoE`; in training mode the loss then includes the weighted router auxiliary losses, and
`router_stats()` returns what the training loop logs. Counters report total and active
parameters; FLOPs count only the active (routed top-k) experts.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from stalepipe.config import ModelConfig
from stalepipe.training.models.layers import Block, RMSNorm, Rotary
from stalepipe.training.models.moe import MoE, router_stats, take_aux_loss


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, V), or the mean cross-entropy when targets are given.

    For MoE models in training mode the loss is cross-entropy + the weighted router auxiliary
    losses (load balancing, z-loss); in eval mode it is the cross-entropy alone, so validation
    losses of dense and MoE models compare directly.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(
            Block(cfg, MoE(cfg) if cfg.is_moe_layer(i) else None) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        init_weights(self, cfg, seed=0)  # build_model(cfg, seed) chooses the seed

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(idx)

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx)  # (B, T, D)
        for block in self.layers:
            x = block(x, self.rope)
        out = self.head(x, targets)
        aux = take_aux_loss(self.layers)  # None for dense models and in eval mode
        if aux is not None and targets is not None:
            out = out + aux
        return out

    def router_stats(self, *, per_expert: bool = True, reset: bool = True) -> dict[str, float]:
        """MoE router metrics since the last call (see `moe.router_stats`); {} when dense."""
        return router_stats(enumerate(self.layers), per_expert=per_expert, reset=reset)


def compile_blocks(module: nn.Module) -> None:
    """`train.compile`: torch.compile every transformer block of `module` (a `Transformer` or
    a pipeline stage of one), in place; the embedding and the head stay eager.

    Per block, not the whole model, so that every engine runs the same compiled graphs (the
    emulator's whole model in fast mode, its stages in exact mode, the runtime's stages): within
    the setting they stay bitwise equal, as eager engines are. Compiled numbers are not eager's
    (inductor fuses and reorders elementwise work), so the setting is part of a run's config
    and a report never pairs runs of different settings (docs/benchmarks.md, 'Study step
    speed')."""
    for m in module.modules():
        if isinstance(m, Block):
            m.compile()


def param_seed(seed: int, name: str) -> int:
    """The seed of the initial values of the parameter called `name` (its global name)."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63


@torch.no_grad()
def init_weights(module: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Initialise the parameters of `module` (a `Transformer` or a part of one that keeps the
    global names, e.g. a pipeline stage): Normal(0, init_std) for matrices, output projections
    scaled by 1/sqrt(2L) (GPT-2), norm gains 1; then the RoPE tables.

    Each matrix draws from its own generator, seeded by (seed, global name) on the CPU, so a
    process can initialise its pipeline stage alone and get exactly the values the whole
    model has (`models.build_stage`), on any device. Parameters on the meta device are skipped.
    """
    for name, p in module.named_parameters():
        if p.is_meta:
            continue
        if p.ndim < 2:
            p.fill_(1.0)  # norm gains
            continue
        if cfg.tie_embeddings and name == "lm_head.weight":
            name = "tok_emb.weight"  # a stage's view of the tied matrix
        out_proj = name.endswith(("wo.weight", "w2.weight"))
        std = cfg.init_std / (math.sqrt(2 * cfg.num_layers) if out_proj else 1.0)
        g = torch.Generator().manual_seed(param_seed(seed, name))
        p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=g))
    for m in module.modules():
        if isinstance(m, Rotary):
            m.reset_buffers()


def build_model(
    cfg: ModelConfig,
    seed: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """A freshly initialised model; the same (cfg, seed) always gives the same weights, on any
    device and in any process (`init_weights`). Built on the meta device first, so no memory is
    spent on throw-away initial values."""
    with torch.device("meta"):
        model = Transformer(cfg)
    materialize(model, cfg, seed, device)
    return model.to(dtype=dtype)


def materialize(module: nn.Module, cfg: ModelConfig, seed: int, device: str | torch.device) -> None:
    """Give `module` (built on the meta device: a model or a stage of one) real storage on
    `device` and its initial values (`init_weights`)."""
    module.to_empty(device=device)
    if cfg.tie_embeddings and hasattr(module, "tok_emb") and hasattr(module, "lm_head"):
        module.lm_head.weight = module.tok_emb.weight  # to_empty makes two matrices of one
    init_weights(module, cfg, seed)
