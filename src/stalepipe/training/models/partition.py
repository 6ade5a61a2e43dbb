"""Split a Transformer into P pipeline stages without renaming a single parameter.

Stage 0 owns the embedding, stage P-1 the final norm and output head; transformer blocks are
assigned in contiguous runs that balance per-stage forward FLOPs (the head counts towards the
last stage; MoE blocks count their active experts only). With tied embeddings the shared matrix
(`TIED_OWNER` on stage 0, `TIED_HEAD` on stage P-1) is *owned* by stage 0 and *read* by stage
P-1 too; how the two ends read versions and combine gradients is `delay.tied`'s one rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from stalepipe.config import ConfigError, ModelConfig
from stalepipe.training.models.moe import (
    raw_router_stats,
    router_layers,
    router_stats,
    take_aux_loss,
)
from stalepipe.training.models.transformer import (
    Transformer,
    block_flops,
    count_params,
    flops_per_token,
    head_flops,
    materialize,
)

# The tied matrix's two names: the first stage owns the embedding, the last stage's head reads it.
TIED_OWNER = "tok_emb.weight"
TIED_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class StageSpec:
    """Which part of the model stage `stage` of `num_stages` holds."""

    stage: int
    num_stages: int
    layers: range

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


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


def stage_specs(
    cfg: ModelConfig, num_stages: int, seq_len: int | None = None, split: str = "balanced"
) -> list[StageSpec]:
    """The `StageSpec` of every stage (`split`: `pipeline.partition`)."""
    ranges = split_layers(cfg, num_stages, seq_len, split)
    return [StageSpec(s, num_stages, r) for s, r in enumerate(ranges)]


class PipelineStage(nn.Module):
    """A view of part of a `Transformer`: it shares (not copies) the model's modules and keeps
    their global names, e.g. `layers.3.attn.wq.weight`.

    forward(x, targets): stage 0 takes token ids, later stages hidden states (B, T, D); the last
    stage returns the loss when targets are given, logits otherwise; others return hidden states.

    MoE: the router auxiliary losses of a stage's blocks belong to that stage's backward. Use
    `forward_with_aux`, which also returns them, and backpropagate both, scaled like the loss:
    `torch.autograd.backward([out, aux / m], [grad_out, None])` (last stage: `(out + aux) / m`).
    Summed over stages this is exactly the whole model's training loss. Plain `forward` adds the
    aux of the last stage to its loss, and refuses to drop a non-last stage's aux while gradients
    are being recorded in training mode (it would silently change the gradient).
    """

    def __init__(self, model: Transformer, spec: StageSpec) -> None:
        super().__init__()
        self.spec = spec
        self.rope = model.rope
        if spec.is_first:
            self.tok_emb = model.tok_emb
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in spec.layers})
        if spec.is_last:
            self.norm = model.norm
            self.lm_head = model.lm_head
        self._head_fn = model.head if spec.is_last else None
        self.tied = model.cfg.tie_embeddings  # the head uses stage 0's embedding matrix

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        out, aux = self.forward_with_aux(x, targets)
        if aux is None:
            return out
        if self.spec.is_last and targets is not None:
            return out + aux
        if torch.is_grad_enabled() and not self.spec.is_last:
            raise RuntimeError(
                f"stage {self.spec.stage} has MoE blocks whose auxiliary loss would be dropped; "
                "call forward_with_aux and backpropagate the aux term too"
            )
        return out

    def forward_with_aux(
        self, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output as in `forward` without any aux term, this stage's weighted MoE auxiliary
        loss); the aux is None for dense stages and in eval mode (validation loss is CE only)."""
        if self.spec.is_first:
            x = self.tok_emb(x)
        for block in self.layers.values():
            x = block(x, self.rope)
        aux = take_aux_loss(self.layers.values())  # None unless MoE blocks in training mode
        out = self._head_fn(x, targets) if self.spec.is_last else x
        return out, aux

    def router_stats(self, *, per_expert: bool = True, reset: bool = True) -> dict[str, float]:
        """MoE router metrics of this stage's blocks (see `moe.router_stats`), named by global
        block index; {} for a dense stage."""
        indexed = ((int(i), b) for i, b in self.layers.items())
        return router_stats(indexed, per_expert=per_expert, reset=reset)

    def router_layers(self) -> list[tuple[int, int]]:
        """(global block index, number of experts) of this stage's MoE layers."""
        return router_layers((int(i), b) for i, b in self.layers.items())

    def raw_router_stats(self, *, reset: bool = True) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """This stage's part of the router statistics, to send to the rank that logs them (see
        `moe.raw_router_stats`); ([], empty) for a dense stage."""
        return raw_router_stats(((int(i), b) for i, b in self.layers.items()), reset=reset)

    def owned_parameters(self) -> dict[str, nn.Parameter]:
        """Parameters this stage owns; a tied head weight is owned by stage 0, not here."""
        owned = dict(self.named_parameters())
        if self.tied and self.spec.is_last and not self.spec.is_first:
            owned.pop(TIED_HEAD, None)
        return owned


class Reparametrized:
    """Calls a stage with given tensors in place of its parameters, by global name, as the
    emulator calls it (`forward_with_aux` when the stage has one: MoE), returning (output,
    auxiliary loss or None).

    What `torch.func.functional_call` does, minus its per-call generality (name parsing,
    tie detection, buffer handling): the slots are resolved once, and a call sets and restores
    one dict entry per parameter. The runtime calls it for every microbatch. A parameter that
    appears under several names (a tied embedding when one stage holds both ends) is swapped
    everywhere under its first name, as `functional_call`'s `tie_weights` does."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.slots: dict[str, list[tuple[nn.Module, str]]] = {}
        first: dict[int, str] = {}
        seen: set[tuple[int, str]] = set()
        for mod_name, mod in module.named_modules(remove_duplicate=False):
            for attr, p in mod._parameters.items():
                if p is None or (id(mod), attr) in seen:
                    continue
                seen.add((id(mod), attr))
                name = first.setdefault(id(p), f"{mod_name}.{attr}" if mod_name else attr)
                self.slots.setdefault(name, []).append((mod, attr))
        self.fn = getattr(module, "forward_with_aux", None)

    def __call__(self, weights: dict[str, torch.Tensor], x: torch.Tensor, targets=None):
        saved = []
        try:
            for name, t in weights.items():
                for mod, attr in self.slots[name]:
                    saved.append((mod, attr, mod._parameters[attr]))
                    mod._parameters[attr] = t
            if self.fn is not None:
                return self.fn(x, targets)
            m = self.module
            return (m(x, targets) if targets is not None else m(x)), None
        finally:
            for mod, attr, p in reversed(saved):
                mod._parameters[attr] = p


def partition(
    model: Transformer, num_stages: int, seq_len: int | None = None, split: str = "balanced"
) -> list[PipelineStage]:
    """Split `model` into `num_stages` stages sharing its modules (`split`:
    `pipeline.partition`). Every parameter is owned by exactly one stage under its original
    name."""
    specs = stage_specs(model.cfg, num_stages, seq_len, split)
    return [PipelineStage(model, spec) for spec in specs]


def build_stage(
    cfg: ModelConfig,
    seed: int,
    num_stages: int,
    stage: int,
    seq_len: int | None = None,
    device: str | torch.device = "cpu",
    split: str = "balanced",
) -> PipelineStage:
    """Stage `stage` of `partition(build_model(cfg, seed), num_stages, seq_len, split)`, bit
    for bit, without building the rest: the pipeline runtime's processes hold only their own
    part of the model, from the start."""
    with torch.device("meta"):
        model = Transformer(cfg)
    part = partition(model, num_stages, seq_len, split)[stage]
    materialize(part, cfg, seed, device)
    return part


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
