"""The transport of a tied embedding between pipeline processes (the rule is `delay.tied`).

The first stage owns the matrix and updates it; the last stage reads the versions
`delay.tied.head_reads` names, which the owner sends as it makes them (the `tied_w` channel),
and sends its head gradient back for the owner to add to its own (`tied_grad`,
`delay.tied.combine_grads`). When one process holds both ends (a V's rank 0) nothing travels:
the head reads the owner's stored versions. `runtime.stage.StageExecutor` holds one
`TiedWeights` per process and calls it at a forward of the last stage (`head_leaves`), at STEP
(`exchange_grad`), after each update (`updated`) and at the end (`finish`, `settle`); `train.pipelined` calls `resume_head`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stalepipe.training.delay import DelayedOptimizer, tied
from stalepipe.training.delay.tied import TIED_HEAD, TIED_OWNER
from stalepipe.training.models import PipelineStage
from stalepipe.training.runtime.comm import Comm, Pending
from stalepipe.training.runtime.stage_io import Chunk


class TiedWeights:
    """This process's end of a tied embedding (`role`: `delay.tied.tied_role`).

    Args:
        comm: this rank's communication.
        tied_model: whether the model ties its embedding and head.
        chunks: this process's stages (`Chunk`s by stage).
        delayed: the process's `DelayedOptimizer` (versions, step, weight prediction).
        evaluates: step k -> whether an evaluation reads W_{k+1} (the head reads it too).
        older: versions older than the start step the last stage still reads (a checkpoint).
    """

    def __init__(
        self,
        comm: Comm,
        tied_model: bool,
        chunks: dict[int, Chunk],
        delayed: DelayedOptimizer,
        evaluates: Callable[[int], bool],
        older: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.comm, self.delayed, self.delay = comm, delayed, delayed.delay
        P = self.delay.num_stages
        self.role = tied.tied_role(tied_model, P, chunks)
        self.versions: dict[int, torch.Tensor] = {}  # the head's copies (role "head")
        self._to_receive: list[int] = []
        self._recv: Pending | None = None
        self._expect = -1
        self._predicted: tuple[tuple[int, float], torch.Tensor] | None = None
        self._to_head, self._to_owner = (0, P - 1), (P - 1, 0)  # the two links
        start = delayed.step_count
        self.reads: set[int] = set()
        if self.role in ("owner", "head"):
            self.reads = tied.head_reads(self.delay, start, delayed.prediction_scale, evaluates)
        if self.role in ("owner", "both"):
            self._owner = chunks[0].owned[TIED_OWNER]
            self._index = list(chunks[0].owned).index(TIED_OWNER)
        if self.role == "head":
            live = chunks[P - 1].params[TIED_HEAD]
            self._like = live
            self.versions = dict(older or {})
            self.versions[start] = live.detach().clone()
            self._to_receive = sorted(v for v in self.reads if v > start)

    # ---- what the last stage computes at -------------------------------------------------------

    def head_leaves(self, version: int, step: int | None) -> dict[str, torch.Tensor]:
        """{head name: a fresh leaf over the head's matrix at `version`} for the last stage's
        forward of `step` (None: an evaluation); {} when this process holds no tied head."""
        w = self._head_weight(version, step)
        return {} if w is None else {TIED_HEAD: w.detach().requires_grad_()}

    def _head_weight(self, version: int, step: int | None) -> torch.Tensor | None:
        """Predicted with the last stage's tau under weight prediction (`delay.tied.
        read_version`)."""
        last = self.delay.num_stages - 1
        scale = 0.0 if step is None else self.delayed.prediction_scale(last, step)
        if self.role == "both":
            return tied.read_version(self._owner_at, version, scale)
        if self.role != "head":
            return None
        if not scale:
            return self.at(version)
        key = (version, scale)  # every microbatch of a step reads the same: cache the last
        if self._predicted is None or self._predicted[0] != key:
            self._predicted = (key, tied.read_version(self.at, version, scale))
        return self._predicted[1]

    def _owner_at(self, version: int) -> torch.Tensor:
        return self.delayed.weights_at(0, version)[self._index]

    def at(self, version: int) -> torch.Tensor:
        """The head's copy at `version` (received from the owner when not yet here)."""
        while version not in self.versions:
            self._receive_next()
        return self.versions[version]

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

    def newest(self) -> torch.Tensor | None:
        """The last stage's copy of the newest version (tests compare it with stage 0's)."""
        return self.versions[max(self.versions)] if self.versions else None

    # ---- the gradient ----------------------------------------------------------------------------

    def exchange_grad(self, grads: dict[str, torch.Tensor], step: int) -> None:
        """At STEP: the head's gradient joins the owner's (first stage's, then last stage's);
        across processes the head sends it and the owner receives it."""
        what = f"the head gradient of step {step}"
        if self.role == "both":
            tied.combine_grads(grads)
        elif self.role == "head":
            self.comm.send([grads.pop(TIED_HEAD)], self._to_owner, "tied_grad", what)
        elif self.role == "owner":
            buf = torch.empty_like(grads[TIED_OWNER])
            (head,) = self.comm.recv([buf], self._to_owner, "tied_grad", what).wait()
            tied.combine_grads(grads, head)

    # ---- versions as updates are applied ---------------------------------------------------------

    def owner_must_send(self, version: int) -> bool:
        """Whether the owner sends `version` once it is made (the last stage reads it)."""
        return self.role == "owner" and version in self.reads

    def updated(self) -> None:
        """After an update: the owner sends the new version if the head reads it; the head
        forgets versions no later step reads."""
        k = self.delayed.step_count
        if self.owner_must_send(k):
            what = f"tied embedding version {k}"
            self.comm.send([self._owner.detach().clone()], self._to_head, "tied_w", what)
        if self.role == "head":
            self._drop()

    def _drop(self) -> None:
        k, scale = self.delayed.step_count, self.delayed.prediction_scale
        floor = tied.head_floor(self.delay, k, max(self.versions), scale)
        for v in [v for v in self.versions if v < floor]:
            del self.versions[v]  # stashed graphs keep their own leaves

    def finish(self) -> None:
        """At the run's end the head takes the final version too: both copies end equal."""
        if self.role == "head":
            self.at(self.delay.total_steps)
            self._drop()

    def settle(self, stop: int) -> None:
        """Before a run ends early after update `stop`: the head takes every version up to
        W_{stop+1} that the owner has sent, so that no send stays undelivered."""
        if self.role != "head":
            return
        version = stop + 1
        while (self._recv is not None and self._expect <= version) or (
            self._recv is None and self._to_receive and self._to_receive[0] <= version
        ):
            self._receive_next()


def resume_head(
    tied_model: bool,
    modules: dict[int, PipelineStage],
    model_state: dict[str, torch.Tensor],
    per_param: dict[str, dict[int, torch.Tensor]],
) -> dict[int, torch.Tensor] | None:
    """Resuming the process of a tied head (its stages' `modules`, last stage last): copy the
    checkpoint's head (`model_state`) into the head's parameter and return the older versions
    the head still reads (the owner's stored ones in `per_param`); None on other processes."""
    last = modules[max(modules)]
    if tied.tied_role(tied_model, last.spec.num_stages, modules) != "head":
        return None
    head = last.get_parameter(TIED_HEAD)
    with torch.no_grad():
        head.copy_(model_state[TIED_HEAD])
    return {v: t.to(head.device) for v, t in per_param.get(TIED_OWNER, {}).items()}
