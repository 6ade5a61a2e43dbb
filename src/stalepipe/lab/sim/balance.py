"""A stage split that balances ranks, not stages, for schedules with several stages per rank.

`config.shapes.split_layers` balances the FLOPs of each stage, which is right when every
stage has a rank of its own. With chunks, a rank's time is the sum of its stages': in the V
placement rank 0 holds both the embedding and the output head, and an interleaved rank R-1
holds the head next to a middle stage, so per-stage balance leaves one rank with far more work
(smollm-360m's head costs about 3.4 blocks). `rank_balanced_layers` starts from the per-stage
split and moves one block at a time across a stage boundary while that lowers the most loaded
rank (then the spread), a local search: never worse than its start, not proven optimal.
"""

from __future__ import annotations

from stalepipe.config import ModelConfig
from stalepipe.config.shapes import block_flops, head_flops, split_layers


def _rank_loads(
    bounds: list[int], prefix: list[int], head: int, stage_ranks: tuple[int, ...]
) -> tuple[int, int]:
    """(most loaded rank's FLOPs, sum of squared rank FLOPs) for the split `bounds`."""
    loads = [0] * (max(stage_ranks) + 1)
    S = len(stage_ranks)
    for s in range(S):
        loads[stage_ranks[s]] += (
            prefix[bounds[s + 1]] - prefix[bounds[s]] + (head if s == S - 1 else 0)
        )
    return max(loads), sum(x * x for x in loads)


def rank_balanced_layers(
    cfg: ModelConfig, seq_len: int, stage_ranks: tuple[int, ...]
) -> list[range]:
    """Contiguous block ranges, one per stage (every stage at least one block), with stage s
    on rank `stage_ranks[s]`, lowering the most loaded rank's FLOPs (module docstring)."""
    S, L = len(stage_ranks), cfg.num_layers
    start = split_layers(cfg, S, seq_len)
    if len(set(stage_ranks)) == S:  # one stage per rank: per-stage balance is per-rank
        return start
    prefix = [0]
    for i in range(L):
        prefix.append(prefix[-1] + block_flops(cfg, seq_len, i))
    head = head_flops(cfg)
    bounds = [r.start for r in start] + [L]
    best = _rank_loads(bounds, prefix, head, stage_ranks)
    improved = True
    while improved:
        improved = False
        for i in range(1, S):  # boundary between stage i-1 and stage i
            for step in (-1, 1):
                b = bounds[i] + step
                if not bounds[i - 1] < b < bounds[i + 1]:
                    continue
                trial = bounds[:i] + [b] + bounds[i + 1 :]
                score = _rank_loads(trial, prefix, head, stage_ranks)
                if score < best:
                    bounds, best, improved = trial, score, True
    return [range(bounds[s], bounds[s + 1]) for s in range(S)]
