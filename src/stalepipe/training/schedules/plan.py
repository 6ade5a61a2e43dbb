"""The plan of a run's steps: what happens at each step besides the update (the LR
multiplier, logs, evaluations, checkpoints) and the requests its processes agreed to act on.

Both engines and the training loop read it (`train.engine`), and the pipeline runtime's
executor reads it during a step (`runtime.stage`) without calling back into train/: a pure
value, built from the train config, replaced (never changed) by each agreement.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from stalepipe.config import TrainConfig
from stalepipe.training.optim.lr_schedule import lr_multiplier

# Requests a process makes to the whole run (bits of an int, OR-ed across processes).
STOP = 1  # a signal asked the run to stop: checkpoint, then end (peers.interrupts)
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
    requests (STOP, CHECKPOINT bits; `peers.interrupts.Interrupts.requests`) are voted on, and
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
