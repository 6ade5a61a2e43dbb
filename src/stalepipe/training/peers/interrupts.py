"""Signals and the checkpoint clock, as requests the training loop acts on at a step boundary.

SIGTERM (what SLURM and Kubernetes send before they preempt a job), SIGUSR1 (SLURM's
`--signal=USR1@<seconds>`) and SIGINT (Ctrl-C) do not kill a run: they set a flag. The
engine agrees with every other process of the run on a step (the vote's bits become an
`Agreed`, `agreement`; the plan becomes `StepPlan.with_agreed`, a new value the loop reads from
each `StepResult`), the
loop writes a checkpoint there and the run ends with `errors.Preempted` (exit status 75);
`--resume` then continues it bit for bit. A second Ctrl-C stops at once (KeyboardInterrupt),
keeping only the checkpoints already written.

The clock: once `train.ckpt_every_s` seconds have passed since the last checkpoint (or the
start), a CHECKPOINT request is made the same way, so a kill -9 loses at most that much work.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from stalepipe.training.schedules.plan import Agreed

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

# Requests a process makes to the whole run: bits of an int, OR-ed across processes by the
# engines' votes (`runtime.stage_update`, `train.distributed.or_across_ranks`).
STOP = 1  # a signal asked the run to stop: checkpoint, then end
CHECKPOINT = 2  # the checkpoint clock (train.ckpt_every_s) ran out


def no_requests() -> int:
    """The requests of a process nobody signals (no signal handlers, no checkpoint clock)."""
    return 0


def agreement(step: int, bits: int) -> Agreed | None:
    """What a vote's outcome (`bits`, the requests of every process OR-ed) asks the run to do
    right after update `step`: any request checkpoints there, STOP ends the run there too."""
    return Agreed(step, stop=bool(bits & STOP)) if bits else None


class Interrupts:
    """A context manager: installs the handlers on enter (main thread only; elsewhere the
    signals keep their handlers) and restores the previous ones on exit."""

    def __init__(self, every_s: float = 0.0, *, verbose: bool = True) -> None:
        self.every_s, self.verbose = every_s, verbose
        self.signal: str | None = None  # the first signal received
        self._last = time.monotonic()
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        if self.signal is None:
            self.signal = name
            if self.verbose:  # os.write: safe inside a handler, unlike print
                os.write(
                    2,
                    f"\nstalepipe: got {name}: writing a checkpoint at the next step every "
                    f"process agrees on, then stopping{_again(signum)}\n".encode(),
                )

    def requests(self) -> int:
        """This process's pending requests: STOP after a signal, CHECKPOINT when the clock ran
        out (the bits above)."""
        bits = STOP if self.signal is not None else 0
        if self.every_s and time.monotonic() - self._last >= self.every_s:
            bits |= CHECKPOINT
        return bits

    def checkpointed(self) -> None:
        """A checkpoint was written: restart the clock."""
        self._last = time.monotonic()


def _again(signum: int) -> str:
    """What a second signal does, said only where it is a keystroke away (Ctrl-C)."""
    return " (Ctrl-C again stops at once)" if signum == signal.SIGINT else ""
