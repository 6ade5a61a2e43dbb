"""Split a Transformer into P pipeline stages without renaming a single parameter.

Stage 0 owns the embedding, stage P-1 the final norm and output head; transformer blocks are
assigned in contiguous runs that balance per-stage forward FLOPs (the head counts towards the
last stage; MoE blocks count their active experts only). With tied embeddings the shared matrix
(`TIED_OWNER` on stage 0, `TIED_HEAD` on stage P-1) is *owned* by stage 0 and *read* by stage
P-1 too; how the two ends read versions and combine gradients is `delay.tied`'s one rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from stalepipe.config import ModelConfig
from stalepipe.config.shapes import split_layers
from stalepipe.training.models.moe import (
    raw_router_stats,
    router_layers,
    router_stats,
    take_aux_loss,
)
from stalepipe.training.models.transformer import Transformer, materialize

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
