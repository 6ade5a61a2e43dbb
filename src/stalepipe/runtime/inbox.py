"""What a stage receives from its neighbours: activations from stage s-1 (for F) and gradients
from stage s+1 (for B / BI), posted a few receives ahead in the order the schedule consumes
them, so a message never waits for its receive to be posted."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch

from stalepipe.runtime.comm import Comm
from stalepipe.schedules.schedule import Action

LOOKAHEAD = 4  # receives posted ahead per channel


class _Channel:
    def __init__(self, link: tuple[int, int], name: str, what: str) -> None:
        self.link, self.name, self.what = link, name, what
        self.keys: deque[tuple[int, int]] = deque()  # (step, microbatch) still to post
        self.posted: deque = deque()  # (key, Pending)


class Inbox:
    """The receives of one stage's action list (see the module docstring)."""

    def __init__(
        self,
        comm: Comm,
        stage: int,
        num_stages: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.comm, self.shape, self.dtype, self.device = comm, shape, dtype, device
        self.first, self.last = stage == 0, stage == num_stages - 1
        self._act = _Channel((stage - 1, stage), "act", "activation")
        self._grad = _Channel((stage + 1, stage), "grad", "gradient")

    def expect(self, actions: Iterable[Action]) -> None:
        """Register what `actions` will receive, in order."""
        for a in actions:
            if a.kind == "F" and not self.first:
                self._act.keys.append((a.step, a.microbatch))
            if a.kind in ("B", "BI") and not self.last:
                self._grad.keys.append((a.step, a.microbatch))

    def prefetch(self) -> None:
        """Post receives until LOOKAHEAD are outstanding on each channel."""
        for ch in (self._act, self._grad):
            while ch.keys and len(ch.posted) < LOOKAHEAD:
                step, mb = key = ch.keys.popleft()
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                what = f"the {ch.what} of step {step} microbatch {mb}"
                ch.posted.append((key, self.comm.recv([buf], ch.link, ch.name, what)))

    def activation(self, step: int, microbatch: int) -> torch.Tensor:
        return self._take(self._act, (step, microbatch))

    def gradient(self, step: int, microbatch: int) -> torch.Tensor:
        return self._take(self._grad, (step, microbatch))

    def _take(self, ch: _Channel, key: tuple[int, int]) -> torch.Tensor:
        got, pending = ch.posted.popleft()
        assert got == key, (got, key)
        return pending.wait()[0]

    def forget_after(self, step: int) -> None:
        """Post nothing for steps after `step` (the run ends there)."""
        for ch in (self._act, self._grad):
            ch.keys = deque(k for k in ch.keys if k[0] <= step)
