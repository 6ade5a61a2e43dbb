"""What a stage executor is given: its place and inputs (`StageIO`), facts about the whole
model (`ModelLayout`); and what it builds of each stage it runs (`Chunk`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from stalepipe.training.models.partition import Reparametrized
from stalepipe.training.runtime.comm import Comm, Inbox

Batches = tuple[list[torch.Tensor], list[torch.Tensor]]


@dataclass(frozen=True)
class StageIO:
    """This stage's place in the pipeline and how it reads its inputs.

    module: the stage (`models.PipelineStage`) on its device; its parameters are the live W.
    get_batch: step -> (x, y) microbatch lists of this replica (first/last stage only).
    act_shape, act_dtype: what crosses a stage boundary (one microbatch's activation).
    autocast: context manager factory for the forward (bf16 on GPU).
    seed: base seed of the per-(stage, step, microbatch) dropout masks.
    """

    module: nn.Module
    stage: int
    comm: Comm
    get_batch: Callable[[int], Batches] | None
    act_shape: tuple[int, ...]
    act_dtype: torch.dtype
    seed: int
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


@dataclass(frozen=True)
class ModelLayout:
    """Facts about the whole model every stage needs: the owned-parameter count of every stage
    (the norm exchange), every stage's MoE (block, experts) layout, whether the embedding is
    tied across the first and last stage, and the gradient clipping norm (0: off)."""

    param_counts: list[int]
    router_layers: list[list[tuple[int, int]]]
    tied: bool
    grad_clip: float
    per_expert: bool = True


class Chunk:
    """One stage a runtime process runs (`runtime.stage.StageExecutor` holds one per stage):
    its module, its forward at given weights, its owned parameters and its receives."""

    def __init__(self, io: StageIO, names: list[str], num_stages: int) -> None:
        self.io, self.stage, self.module = io, io.stage, io.module
        self.first, self.last = self.stage == 0, self.stage == num_stages - 1
        self.run_at = Reparametrized(self.module)
        params = dict(self.module.named_parameters())
        self.owned = {n: params[n] for n in names}
        self.params = params
        device = next(self.module.parameters()).device
        self.inbox = Inbox(io.comm, io.stage, num_stages, io.act_shape, io.act_dtype, device)
