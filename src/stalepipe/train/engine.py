"""The engine interface the one training loop (`train.loop.run_loop`) drives, and its plan.

Two engines implement it: `train.emulated.EmulatorEngine` (one process, the delay emulator;
data parallel under torchrun) and `train.pipelined.PipelineEngine` (one stage of the pipeline
runtime per process). The loop never asks which one it has.

    engine.start_step                      # 0, or the step a resumed checkpoint holds
    for result in engine.steps(plan):      # one StepResult per update, in order, once applied
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

from stalepipe.config import TrainConfig
from stalepipe.optim.lr_schedule import lr_multiplier

# Requests a process makes to the whole run (bits of an int, OR-ed across processes).
STOP = 1  # a signal asked the run to stop: checkpoint, then end (train.interrupts)
CHECKPOINT = 2  # the checkpoint clock (train.ckpt_every_s) ran out


@dataclass
class StepPlan:
    """What happens at each step of a run: the LR multiplier and the log, eval and checkpoint
    cadence (the last step always logs, evaluates and checkpoints), a pure function of the
    train config, so every process of a run knows it without asking.

    The one exception is what the processes agree on while the run goes: `requests()` gives
    this process's pending requests (STOP, CHECKPOINT bits), and the engine, once every process
    has the same answer, records it with `agree(step, bits)`, before any process has reached
    that step's update (see the engines). An agreed step then checkpoints, and a STOP ends the
    run there."""

    train: TrainConfig
    requests: Callable[[], int] = lambda: 0
    _agreed: dict[int, int] = field(default_factory=dict)

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
        return self._every(self.train.ckpt_every, step) or step in self._agreed

    def is_sync_point(self, step: int) -> bool:
        """Whether the engine must pause right after update `step` (an eval or a checkpoint
        reads the weights there): asynchronous engines apply such an update at once."""
        return self.evaluates(step) or self.checkpoints(step)

    def agree(self, step: int, bits: int) -> None:
        """Record requests every process agreed to act on right after update `step`. The last
        step checkpoints and ends anyway: a request for it (or beyond) changes nothing."""
        if bits and step < self.total_steps - 1:
            self._agreed[step] = self._agreed.get(step, 0) | bits

    def stops(self, step: int) -> bool:
        """Whether the run ends (early) right after update `step`'s checkpoint."""
        return bool(self._agreed.get(step, 0) & STOP)

    @property
    def stop_step(self) -> int | None:
        """The step the run stops after (agreed), None while none is."""
        return min((k for k, b in self._agreed.items() if b & STOP), default=None)


@dataclass
class StepResult:
    """What one applied update reports (the same on every process of the run)."""

    step: int
    loss: float  # mean training loss at the point the gradient was taken (the stale one)
    grad_norm: float  # before clipping; NaN without clipping
    tau: list[int]  # staleness per stage of this step's gradient
    lr: float  # the LR of the first parameter group at this update
    router: dict[str, float] = field(default_factory=dict)  # MoE metrics at log steps


class Engine(Protocol):
    """A training engine: see the module docstring."""

    start_step: int
    resumed_from: Path | None  # the checkpoint the engine resumed from
    device: torch.device  # this process's device (the loop's meter reads its peak and memory)

    def steps(self, plan: StepPlan) -> Iterator[StepResult]:
        """Run steps start_step .. plan.total_steps - 1, yielding each result once applied."""
        ...

    def evaluate(self) -> float:
        """Validation loss at the newest weights (collective; NaN where not known)."""
        ...

    def nonfinite_weights(self) -> str | None:
        """What is not finite in this process's weights (None: all finite)."""
        ...

    def checkpoint(self, step: int) -> Path | None:
        """Write the checkpoint of `step` updates (collective); its path on the main process."""
        ...
