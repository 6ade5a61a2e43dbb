"""What a `ModelConfig` implies without building the model (torch-free): its parameter counts,
its FLOPs per token, and which blocks each pipeline stage holds.

The model (`training.models`) and the lab (the simulator, the verdict, the analysis of runs) both
read these; here, neither imports torch to count a model.
"""

from __future__ import annotations

from collections.abc import Sequence

from stalepipe.config.base import ConfigError
from stalepipe.config.sections import ModelConfig


def mlp_params(cfg: ModelConfig, layer: int, *, active: bool = False) -> int:
    """Parameters of block `layer`'s MLP; `active`: only those one token uses (router, its top-k
    routed experts, the shared experts)."""
    if not cfg.is_moe_layer(layer):
        return 3 * cfg.dim * cfg.ffn_dim
    routed = cfg.top_k if active else cfg.num_experts
    expert = 3 * cfg.dim * cfg.expert_hidden_dim
    return cfg.num_experts * cfg.dim + (routed + cfg.num_shared_experts) * expert


def block_params(cfg: ModelConfig, layer: int | None = None, *, active: bool = False) -> int:
    """Parameters of block `layer` (default: the last one, an MoE block in MoE models)."""
    layer = cfg.num_layers - 1 if layer is None else layer
    attn = cfg.dim * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    return attn + mlp_params(cfg, layer, active=active) + 2 * cfg.dim


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Analytic parameter counts: total, embedding, head (0 if tied), blocks, non-embedding, and
    active (what one token uses: total minus the routed experts it is not sent to)."""
    emb = cfg.vocab_size * cfg.dim
    head = 0 if cfg.tie_embeddings else emb
    blocks = sum(block_params(cfg, i) for i in range(cfg.num_layers))
    active_blocks = sum(block_params(cfg, i, active=True) for i in range(cfg.num_layers))
    total = emb + head + blocks + cfg.dim
    return {
        "total": total,
        "embedding": emb,
        "head": head,
        "blocks": blocks,
        "non_embedding": total - emb - head,
        "active": total - blocks + active_blocks,
    }


def block_flops(cfg: ModelConfig, seq_len: int, layer: int | None = None) -> int:
    """Forward FLOPs per token of block `layer` (default: the last): 2 per matmul MAC of the
    active parameters (router and top-k experts for MoE), plus causal attention scores."""
    matmuls = 2 * (block_params(cfg, layer, active=True) - 2 * cfg.dim)
    # QK^T and AV: 2 * 2 * T * D per token for full attention; causal masking halves the work.
    attention = 2 * seq_len * cfg.num_heads * cfg.head_dim
    return matmuls + attention


def head_flops(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of the output head."""
    return 2 * cfg.dim * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    """Forward / backward / total training FLOPs per token (backward = 2x forward)."""
    fwd = sum(block_flops(cfg, seq_len, i) for i in range(cfg.num_layers)) + head_flops(cfg)
    return {"forward": fwd, "backward": 2 * fwd, "total": 3 * fwd}


def split_layers(
    cfg: ModelConfig, num_stages: int, seq_len: int | None = None, split: str = "balanced"
) -> list[range]:
    """Contiguous block ranges, one per stage (`pipeline.partition`): `balanced` minimises the
    most expensive stage's FLOPs (the head counted on the last stage; exact DP over split
    points, O(P * L^2), L <= ~100); `uniform` gives every stage the same number of blocks (the
    first stages one more when they do not divide); "3,2,2,1" is the blocks of each stage.
    Every stage gets at least one block."""
    L = cfg.num_layers
    if not 1 <= num_stages <= L:
        raise ConfigError(
            f"pipeline.num_stages must be in [1, model.num_layers={L}], got {num_stages}"
        )
    if split != "balanced":
        counts = _counts(split, L, num_stages)
        starts = [sum(counts[:s]) for s in range(num_stages + 1)]
        return [range(starts[s], starts[s + 1]) for s in range(num_stages)]
    seq = seq_len or cfg.max_seq_len
    costs = [block_flops(cfg, seq, i) for i in range(L)]  # blocks differ with dense first layers
    return balance_blocks(costs, num_stages, last_extra=head_flops(cfg))


def balance_blocks(
    costs: Sequence[float], num_stages: int, *, first_extra: float = 0, last_extra: float = 0
) -> list[range]:
    """Contiguous runs of blocks (costs `costs`, in order), one per stage, each at least one
    block, minimising the most expensive stage's cost, `first_extra` and `last_extra` counted
    on the first and last stage (an embedding, an output head); exact DP over split points,
    O(P * L^2). Ties go to the split with the smallest sum of squared stage costs (blocks
    spread evenly when a large head fixes the maximum)."""
    L = len(costs)
    if not 1 <= num_stages <= L:
        raise ConfigError(f"{num_stages} stages need 1 <= stages <= {L} blocks")
    prefix: list[float] = [0]  # prefix[i]: cost of blocks 0..i-1 (ints stay exact ints)
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(lo: int, hi: int, last: bool) -> float:
        extra = (last_extra if last else 0) + (first_extra if lo == 0 else 0)
        return prefix[hi] - prefix[lo] + extra

    # best[p][i]: the lexicographically smallest (max stage cost, sum of squared stage costs)
    # over splits of the first i blocks into p stages
    inf = (float("inf"), float("inf"))
    best = [[inf] * (L + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (L + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0, 0)
    for p in range(1, num_stages + 1):
        last = p == num_stages
        for i in range(p, L + 1):
            for j in range(p - 1, i):
                c = cost(j, i, last)
                cand = (max(best[p - 1][j][0], c), best[p - 1][j][1] + c * c)
                if cand < best[p][i]:
                    best[p][i], cut[p][i] = cand, j
    bounds = [L]
    for p in range(num_stages, 0, -1):
        bounds.append(cut[p][bounds[-1]])
    bounds.reverse()
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def _counts(split: str, L: int, P: int) -> list[int]:
    """Blocks per stage of a `uniform` or explicit ("3,2,2,1") split."""
    if split == "uniform":
        return [L // P + (s < L % P) for s in range(P)]
    counts = [int(c) for c in split.split(",")]
    if len(counts) != P or sum(counts) != L or min(counts) < 1:
        raise ConfigError(
            f"pipeline.partition {split} needs {P} counts >= 1 adding up to model.num_layers={L}"
        )
    return counts


def describe(m: ModelConfig, seq_len: int, num_stages: int, split: str = "balanced") -> list[str]:
    """What `stalepipe info` prints of a model: shape, MoE layout, parameter counts, training
    FLOPs per token and the blocks of each pipeline stage."""
    flops = flops_per_token(m, seq_len)
    lines = [
        f"model: {m.num_layers} layers, dim {m.dim}, {m.num_heads} heads / {m.num_kv_heads} kv "
        f"heads, ffn {m.ffn_dim}, vocab {m.vocab_size}, tied={m.tie_embeddings}"
    ]
    if m.num_experts:
        lines.append(
            f"MoE: {m.num_experts} experts of width {m.expert_hidden_dim}, top-{m.top_k}, "
            f"{m.num_shared_experts} shared, first {m.num_dense_layers} layers dense"
        )
    lines.append("parameters: " + ", ".join(f"{k} {v:,}" for k, v in count_params(m).items()))
    lines.append(
        f"training FLOPs per token at seq {seq_len}: {flops['total']:,} "
        f"(forward {flops['forward']:,})"
    )
    splits = split_layers(m, num_stages, split=split)
    lines.append(
        f"{num_stages}-stage split ({split}; blocks per stage): "
        + ", ".join(f"s{s}: {r.start}-{r.stop - 1}" for s, r in enumerate(splits))
    )
    return lines
