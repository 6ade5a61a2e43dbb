"""A tied embedding across two pipeline processes: one matrix, two readers, never diverging.

The input embedding (`TIED_NAME`, stage 0) and the output head (`TIED_HEAD`, the last stage)
share one matrix. Stage 0 owns and updates it; the last stage reads the versions stage 0 sends
(on the `tied_w` channel), and sends its head gradient back for stage 0 to add to its own
(`tied_grad`): the gradient is first stage's + last stage's, as in the emulator's exact mode.
Which versions the last stage reads follows from the delay schedule alone, so both sides know
without asking.
"""

from __future__ import annotations

import torch

from stalepipe.delay.correctors import predict_weights
from stalepipe.runtime.comm import Comm, Pending

TIED_NAME = "tok_emb.weight"  # owned by stage 0
TIED_HEAD = "lm_head.weight"  # read by the last stage
TIED_NAMES = (TIED_NAME, TIED_HEAD)


class TiedWeights:
    """This stage's side of a tied embedding (`role` "owner", "head", or None when untied or
    when one process holds both ends).

    Args:
        comm: this rank's communication.
        role: "owner" (stage 0), "head" (the last stage) or None.
        versions_read: every version of the matrix the last stage reads from the start step
            on (its steps' reads, the versions evaluations read, the final one).
        start: the step the run starts at (the version both sides hold now).
        live_head: the last stage's copy of the newest version (the model's head parameter).
        older: versions older than `start` the last stage still reads (from a checkpoint).
    """

    def __init__(
        self,
        comm: Comm,
        role: str | None,
        versions_read: set[int],
        start: int,
        live_head: torch.Tensor | None = None,
        older: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.comm, self.role, self.reads = comm, role, versions_read
        self.versions: dict[int, torch.Tensor] = {}
        self._to_receive: list[int] = []
        self._recv: Pending | None = None
        self._expect = -1
        self._predicted: tuple[tuple[int, float], torch.Tensor] | None = None
        if role == "head":
            assert live_head is not None
            self._like = live_head
            self.versions = dict(older or {})
            self.versions[start] = live_head.detach().clone()
            self._to_receive = sorted(v for v in versions_read if v > start)
        last = comm.topo.num_stages - 1
        self._to_head, self._to_owner = (0, last), (last, 0)  # the two links

    # ---- the last stage ----------------------------------------------------------------------

    def at(self, version: int) -> torch.Tensor:
        """The head's matrix at `version` (received from stage 0 when not yet here)."""
        while version not in self.versions:
            self._receive_next()
        return self.versions[version]

    def predicted(self, version: int, scale: float) -> torch.Tensor:
        """Weight prediction of the head's matrix from `version` and `version - 1`
        (`delay.correctors.predict_weights`, as the owner's stage computes it); the last one
        is cached, as every microbatch of a step reads the same."""
        key = (version, scale)
        if self._predicted is None or self._predicted[0] != key:
            (w,) = predict_weights([self.at(version)], [self.at(version - 1)], scale)
            self._predicted = (key, w)
        return self._predicted[1]

    def _receive_next(self) -> None:
        if self._recv is None:
            self._post_next()
        assert self._recv is not None, "no more tied versions expected"
        (t,) = self._recv.wait()
        self.versions[self._expect] = t
        self._recv = None
        self._post_next()

    def _post_next(self) -> None:
        if not self._to_receive:
            return
        self._expect = self._to_receive.pop(0)
        buf = torch.empty_like(self._like)
        what = f"tied embedding version {self._expect}"
        self._recv = self.comm.recv([buf], self._to_head, "tied_w", what)

    def receive_up_to(self, version: int) -> None:
        """The head takes every version up to `version` that the owner has sent: before a run
        ends early, so that no send stays undelivered."""
        if self.role != "head":
            return
        while (self._recv is not None and self._expect <= version) or (
            self._recv is None and self._to_receive and self._to_receive[0] <= version
        ):
            self._receive_next()

    def drop_older_than(self, floor: int) -> None:
        """Forget versions below `floor` (stashed graphs keep their own leaves)."""
        for v in [v for v in self.versions if v < floor]:
            del self.versions[v]

    def newest(self) -> torch.Tensor | None:
        """The last stage's copy of the newest version (tests compare it with stage 0's)."""
        return self.versions[max(self.versions)] if self.versions else None

    # ---- both ends ---------------------------------------------------------------------------

    def exchange_grad(self, grads: dict[str, torch.Tensor], step: int) -> None:
        """At STEP: the head sends its gradient, the owner adds it to its own (first stage's,
        then last stage's)."""
        what = f"the head gradient of step {step}"
        if self.role == "head":
            self.comm.send([grads.pop(TIED_HEAD)], self._to_owner, "tied_grad", what)
        elif self.role == "owner":
            buf = torch.empty_like(grads[TIED_NAME])
            (head,) = self.comm.recv([buf], self._to_owner, "tied_grad", what).wait()
            grads[TIED_NAME] = grads[TIED_NAME] + head

    def owner_must_send(self, version: int) -> bool:
        """Whether the owner sends `version` once it is made (the last stage reads it)."""
        return self.role == "owner" and version in self.reads

    def send(self, version: int, weight: torch.Tensor) -> None:
        """The owner's newest matrix, `version`, to the last stage."""
        what = f"tied embedding version {version}"
        self.comm.send([weight.detach().clone()], self._to_head, "tied_w", what)
