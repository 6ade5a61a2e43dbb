"""The plan of a run's steps: what happens at each step besides the update (logs,
evaluations, checkpoints) and what its processes agreed to act on (`Agreed`).

Both engines and the training loop read it (`train.engine`), and the pipeline runtime's
executor reads it during a step (`runtime.stage`) without calling back into train/: a pure
value, built from the train config, replaced (never changed) by each agreement.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from stalepipe.config import TrainConfig


@dataclass(frozen=True)
class Agreed:
    """What every process of a run agreed to do right after update `step`: checkpoint, and
    end the run there if `stop`. The votes that reach it are the peers' (`peers.interrupts`:
    a signal asks to stop, the checkpoint clock to checkpoint)."""

    step: int
    stop: bool = False


@dataclass(frozen=True)
class StepPlan:
    """What happens at each step of a run: the log, eval and checkpoint cadence (the last step
    always logs, evaluates and checkpoints), a pure function of the train config, so every
    process of a run knows it without asking. (The LR at a step is the optimizer's:
    `optim.lr_schedule.lr_multiplier(step, plan.train)`.)

    The one thing a run adds while it goes is what its processes agreed on: a process's pending
    requests (`peers.interrupts`) are voted on, and once every process has the same answer the
    engine takes the plan `with_agreed(agreed)` in place of the old one, before any process has
    reached that step's update (see the engines). An agreed step then checkpoints, and a stop
    ends the run there. A plan never changes: an agreement is a new plan."""

    train: TrainConfig
    agreed: tuple[Agreed, ...] = ()  # in the order agreed

    @property
    def total_steps(self) -> int:
        return self.train.num_steps

    def _every(self, n: int, step: int) -> bool:
        done = step + 1
        return bool(n and done % n == 0) or done == self.train.num_steps

    def logs(self, step: int) -> bool:
        return self._every(self.train.log_every, step)

    def evaluates(self, step: int) -> bool:
        return self._every(self.train.eval_every, step)

    def checkpoints(self, step: int) -> bool:
        return self._every(self.train.ckpt_every, step) or self.agreed_at(step) is not None

    def is_sync_point(self, step: int) -> bool:
        """Whether the engine must pause right after update `step` (an eval or a checkpoint
        reads the weights there): asynchronous engines apply such an update at once."""
        return self.evaluates(step) or self.checkpoints(step)

    def with_agreed(self, agreed: Agreed | None) -> StepPlan:
        """This plan with what every process agreed to do right after update `agreed.step`.
        The last step checkpoints and ends anyway: an agreement for it (or beyond), or none,
        changes nothing (the same plan)."""
        if agreed is None or agreed.step >= self.total_steps - 1:
            return self
        return replace(self, agreed=(*self.agreed, agreed))

    def agreed_at(self, step: int) -> Agreed | None:
        """What was agreed for right after update `step` (None: nothing); two agreements on
        one step are one, stopping if either does."""
        here = [a for a in self.agreed if a.step == step]
        return Agreed(step, any(a.stop for a in here)) if here else None

    def stops(self, step: int) -> bool:
        """Whether the run ends (early) right after update `step`'s checkpoint."""
        return any(a.stop for a in self.agreed if a.step == step)

    @property
    def stop_step(self) -> int | None:
        """The step the run stops after (agreed), None while none is."""
        return min((a.step for a in self.agreed if a.stop), default=None)
