"""The engine interface the one training loop (`train.loop.run_loop`) drives, and its plan.

Two engines implement it: `train.emulated.EmulatorEngine` (one process, the delay emulator;
data parallel under torchrun) and `train.pipelined.PipelineEngine` (one stage of the pipeline
runtime per process). The loop never asks which one it has.

    engine.start_step                      # 0, or the step a resumed checkpoint holds
    for result in engine.steps(plan, requests):  # one StepResult per update, in order, applied
        plan = plan.with_agreed(result.agreed)  # what every process agreed on (signals)
        ...                                # at plan.is_sync_point(step) the engine is paused
        engine.evaluate()                  #   right after that update: evaluate and
        engine.checkpoint(step + 1)        #   checkpoint see W_{step+1} and nothing newer

Every process of a run drives the same loop over its own engine (evaluation and checkpoints
are collective); only the main process writes metrics and shows progress.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from stalepipe.training.peers.interrupts import no_requests
from stalepipe.training.schedules.plan import Agreed, StepPlan


@dataclass
class StepResult:
    """What one applied update reports (the same on every process of the run)."""

    step: int
    loss: float  # mean training loss at the point the gradient was taken (the stale one)
    grad_norm: float  # before clipping; NaN without clipping
    tau: list[int]  # staleness per stage of this step's gradient
    lr: float  # the LR of the first parameter group at this update
    router: dict[str, float] = field(default_factory=dict)  # MoE metrics at log steps
    agreed: Agreed | None = None  # what every process agreed to do right after it (signals)
    staleness: dict[str, float] = field(default_factory=dict)  # `log.staleness`, at log steps


class Engine(Protocol):
    """A training engine: see the module docstring."""

    start_step: int
    resumed_from: Path | None  # the checkpoint the engine resumed from
    device: torch.device  # this process's device (the loop's meter reads its peak and memory)

    def steps(
        self, plan: StepPlan, requests: Callable[[], int] = no_requests
    ) -> Iterator[StepResult]:
        """Run steps start_step .. plan.total_steps - 1, yielding each result once applied.
        `requests()`: this process's pending requests, voted on with every other process's;
        each result carries what was agreed for its step (`StepPlan.with_agreed`)."""
        ...

    def evaluate(self) -> float:
        """Validation loss at the newest weights (collective; NaN where not known)."""
        ...

    def evaluate_full(self) -> tuple[float, int]:
        """(loss, tokens) over the whole validation split (`train.final_eval_full`)."""
        ...

    def nonfinite_weights(self) -> str | None:
        """What is not finite in this process's weights (None: all finite)."""
        ...

    def checkpoint(self, step: int) -> Path | None:
        """Write the checkpoint of `step` updates (collective); its path on the main process."""
        ...
