"""The engine interface the one training loop (`train.loop.run_loop`) drives, and its plan.

Two engines implement it: `train.emulated.EmulatorEngine` (one process, the delay emulator;
data parallel under torchrun) and `train.pipelined.PipelineEngine` (one stage of the pipeline
runtime per process). The loop never asks which one it has.

    engine.start_step                      # 0, or the step a resumed checkpoint holds
    for result in engine.steps(plan, requests):  # one StepResult per update, in order, applied
        plan = plan.with_agreed(step, result.agreed)  # what every process agreed on (signals)
        ...                                # at plan.is_sync_point(step) the engine is paused
        engine.evaluate()                  #   right after that update: evaluate and
        engine.checkpoint(step + 1)        #   checkpoint see W_{step+1} and nothing newer

Every process of a run drives the same loop over its own engine (evaluation and checkpoints
are collective); only the main process writes metrics and shows progress.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch

from stalepipe.config import TrainConfig
from stalepipe.optim.lr_schedule import lr_multiplier

# Requests a process makes to the whole run (bits of an int, OR-ed across processes).
STOP = 1  # a signal asked the run to stop: checkpoint, then end (train.interrupts)
CHECKPOINT = 2  # the checkpoint clock (train.ckpt_every_s) ran out


def no_requests() -> int:
    """The requests of a process nobody signals (no signal handlers, no checkpoint clock)."""
    return 0


@dataclass(frozen=True)
class StepPlan:
    """What happens at each step of a run: the LR multiplier and the log, eval and checkpoint
    cadence (the last step always logs, evaluates and checkpoints), a pure function of the
    train config, so every process of a run knows it without asking.

    The one thing a run adds while it goes is what its processes agreed on: a process's pending
    requests (STOP, CHECKPOINT bits; `train.interrupts.Interrupts.requests`) are voted on, and
    once every process has the same answer the engine takes the plan `with_agreed(step, bits)`
    in place of the old one, before any process has reached that step's update (see the
    engines). An agreed step then checkpoints, and a STOP ends the run there. A plan never
    changes: an agreement is a new plan."""

    train: TrainConfig
    agreed: tuple[tuple[int, int], ...] = ()  # (step, request bits), in the order agreed

    @property
    def total_steps(self) -> int:
        return self.train.num_steps

    def lr_multiplier(self, step: int) -> float:
        return lr_multiplier(step, self.train)

    def _every(self, n: int, step: int) -> bool:
        done = step + 1
        return bool(n and done % n == 0) or done == self.train.num_steps

    def logs(self, step: int) -> bool:
        return self._every(self.train.log_every, step)

    def evaluates(self, step: int) -> bool:
        return self._every(self.train.eval_every, step)

    def checkpoints(self, step: int) -> bool:
        return self._every(self.train.ckpt_every, step) or bool(self.agreed_bits(step))

    def is_sync_point(self, step: int) -> bool:
        """Whether the engine must pause right after update `step` (an eval or a checkpoint
        reads the weights there): asynchronous engines apply such an update at once."""
        return self.evaluates(step) or self.checkpoints(step)

    def with_agreed(self, step: int, bits: int) -> StepPlan:
        """This plan with the requests every process agreed to act on right after update
        `step`. The last step checkpoints and ends anyway: a request for it (or beyond), or
        none, changes nothing (the same plan)."""
        if not bits or step >= self.total_steps - 1:
            return self
        return replace(self, agreed=(*self.agreed, (step, bits)))

    def agreed_bits(self, step: int) -> int:
        """The requests agreed for right after update `step` (0: none)."""
        bits = 0
        for k, b in self.agreed:
            if k == step:
                bits |= b
        return bits

    def stops(self, step: int) -> bool:
        """Whether the run ends (early) right after update `step`'s checkpoint."""
        return bool(self.agreed_bits(step) & STOP)

    @property
    def stop_step(self) -> int | None:
        """The step the run stops after (agreed), None while none is."""
        return min((k for k, b in self.agreed if b & STOP), default=None)


@dataclass
class StepResult:
    """What one applied update reports (the same on every process of the run)."""

    step: int
    loss: float  # mean training loss at the point the gradient was taken (the stale one)
    grad_norm: float  # before clipping; NaN without clipping
    tau: list[int]  # staleness per stage of this step's gradient
    lr: float  # the LR of the first parameter group at this update
    router: dict[str, float] = field(default_factory=dict)  # MoE metrics at log steps
    agreed: int = 0  # the requests every process agreed to act on right after it (STOP, ...)


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
