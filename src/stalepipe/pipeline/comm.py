"""Point-to-point and control communication of the pipeline runtime, with timeouts everywhere.

Ranks: `rank = replica * P + stage` (P stages, D data-parallel replicas), so without data
parallelism rank == stage and rank 0 is stage 0 of replica 0 (it logs and writes checkpoints).

Channels. Every message between two stages travels on a *channel*: activations forward
(`act`), gradients backward (`grad`), evaluation activations (`eval`), the tied embedding's head
gradient (last stage -> first, `tied_grad`) and its new weights (first -> last, `tied_w`), and
the evaluation loss (last -> first, `eval_loss`). Both ends of a channel issue their operations
in the same order (the schedule's (step, microbatch) order), so messages need no headers.
- gloo (CPU): one process group, a distinct tag per channel; isend/irecv are asynchronous.
- NCCL (GPU): one two-rank process group per channel and direction, so operations of different
  channels run on different communicators and can never wait on each other (the deadlock that
  batched send/recv avoids in single-communicator runtimes); several operations posted at once
  on one channel go out as one `batch_isend_irecv`.

Timeouts. Every wait has a deadline (`pipeline.timeout_s`); a dead peer (gloo notices a closed
connection at once) or a silent one (deadline) raises `PeerError` naming the peer rank, and the
runtime then exits non-zero. The first failure is also written to the rendezvous store so that
other ranks can name the root cause.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

CHANNELS = ("act", "grad", "eval", "tied_grad", "tied_w", "eval_loss")
_TAGS = {name: i + 1 for i, name in enumerate(CHANNELS)}
FAILURE_KEY = "stalepipe/first_failure"


class PeerError(RuntimeError):
    """A peer rank died, hung past the timeout, or the communication with it failed."""


@dataclass(frozen=True)
class Topology:
    """Where each rank sits: P pipeline stages times D data-parallel replicas."""

    num_stages: int
    data_parallel: int = 1

    @property
    def world_size(self) -> int:
        return self.num_stages * self.data_parallel

    def rank(self, stage: int, replica: int = 0) -> int:
        assert 0 <= stage < self.num_stages and 0 <= replica < self.data_parallel
        return replica * self.num_stages + stage

    def stage_of(self, rank: int) -> int:
        return rank % self.num_stages

    def replica_of(self, rank: int) -> int:
        return rank // self.num_stages

    def describe(self, rank: int) -> str:
        s, d = self.stage_of(rank), self.replica_of(rank)
        return f"rank {rank} (stage {s}" + (f", replica {d})" if self.data_parallel > 1 else ")")


def under_torchrun() -> bool:
    """True when torchrun (or another env:// launcher, `train.launch.launch_train` included)
    started this process: RANK and WORLD_SIZE are set. The one test for it in stalepipe."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def resolve_backend(backend: str, device: str) -> str:
    """'auto' -> NCCL for CUDA devices, gloo otherwise."""
    if backend != "auto":
        return backend
    return "nccl" if device.startswith("cuda") else "gloo"


def init_from_env(backend: str, timeout_s: float) -> tuple[int, int, int]:
    """Join the process group torchrun (or `train.launch.launch_train`) describes in the environment
    (env:// rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE). Returns
    (rank, world_size, local_rank)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kwargs,
        )
    return rank, world, local_rank


class Pending:
    """Outstanding receives (or sends) of one channel operation; `wait()` enforces the deadline
    and turns any failure into a `PeerError` that names the peer."""

    def __init__(self, works: list, tensors: list[torch.Tensor], peer: int, what: str, comm: Comm):
        self.works, self.tensors, self.peer, self.what, self.comm = works, tensors, peer, what, comm

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            try:
                ok = w.wait(self.comm.timeout)
            except Exception as e:  # gloo/NCCL raise RuntimeError or DistBackendError
                raise self.comm.peer_error(self.peer, self.what, e) from None
            if ok is False:
                raise self.comm.peer_error(self.peer, self.what, "timed out")
        self.works = []
        return self.tensors

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)


class Comm:
    """The runtime's communication: channels to the neighbouring stages of this replica, the
    per-step control all-gather over the replica's pipeline, and the data-parallel all-reduce
    over the replicas of this stage. All ranks construct it collectively (same order)."""

    def __init__(self, topo: Topology, rank: int, backend: str, timeout_s: float, device):
        self.topo, self.rank, self.backend = topo, rank, backend
        self.device = torch.device(device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.stage, self.replica = topo.stage_of(rank), topo.replica_of(rank)
        P, D = topo.num_stages, topo.data_parallel
        # Control group (per-step all-gather of grad norms and losses), data-parallel groups.
        # new_group is collective over the whole world: every rank creates every group.
        self.pipe_group = None
        self.dp_group = None
        for d in range(D):
            ranks = [topo.rank(s, d) for s in range(P)]
            g = dist.new_group(ranks, timeout=self.timeout) if P > 1 or D > 1 else None
            if d == self.replica:
                self.pipe_group = g
        if D > 1:
            for s in range(P):
                g = dist.new_group([topo.rank(s, d) for d in range(D)], timeout=self.timeout)
                if s == self.stage:
                    self.dp_group = g
        # NCCL: one communicator per (channel, direction, pair).
        self._groups: dict[tuple[str, int, int], Any] = {}
        if backend == "nccl":
            for d in range(D):
                for a, b, chans in self._pairs(P):
                    for ch in chans:
                        ra, rb = topo.rank(a, d), topo.rank(b, d)
                        g = dist.new_group([ra, rb], timeout=self.timeout)
                        if self.rank in (ra, rb):
                            self._groups[(ch, ra, rb)] = g
        self._sends: deque[Pending] = deque()

    @staticmethod
    def _pairs(P: int) -> list[tuple[int, int, tuple[str, ...]]]:
        """(sender stage, receiver stage, channels) for every directed link."""
        out = []
        for s in range(P - 1):
            out.append((s, s + 1, ("act", "eval")))
            out.append((s + 1, s, ("grad",)))
        if P > 1:
            out.append((P - 1, 0, ("tied_grad", "eval_loss")))
            out.append((0, P - 1, ("tied_w",)))
        return out

    # ---------------------------------------------------------------------------------------

    def peer_rank(self, stage: int) -> int:
        return self.topo.rank(stage, self.replica)

    def peer_error(self, peer: int, what: str, cause: object) -> PeerError:
        reason = str(cause).strip().splitlines()[0][:200] if str(cause) else type(cause).__name__
        msg = (
            f"{self.topo.describe(self.rank)}: {self.topo.describe(peer)} failed or stopped "
            f"responding while waiting for {what} (timeout {self.timeout.total_seconds():g}s): "
            f"{reason}"
        )
        return PeerError(msg)

    def _p2p(self, op: str, tensors: list[torch.Tensor], peer: int, channel: str) -> list:
        if self.backend == "nccl":
            src, dst = (self.rank, peer) if op == "send" else (peer, self.rank)
            group = self._groups[(channel, src, dst)]
            fn = dist.isend if op == "send" else dist.irecv
            ops = [dist.P2POp(fn, t, peer, group) for t in tensors]
            return dist.batch_isend_irecv(ops)
        tag = _TAGS[channel]
        fn = dist.isend if op == "send" else dist.irecv
        return [fn(t, peer, tag=tag) for t in tensors]

    def send(self, tensors: list[torch.Tensor], peer: int, channel: str, what: str) -> Pending:
        """Asynchronous send; the tensors are kept alive until the send completed. The
        returned `Pending` may be waited on (it is also waited by `flush_sends`)."""
        tensors = [t.detach().contiguous() for t in tensors]
        works = self._p2p("send", tensors, peer, channel)
        pending = Pending(works, tensors, peer, f"the send of {what}", self)
        self._sends.append(pending)
        while self._sends and self._sends[0].done():
            self._sends.popleft().wait()
        return pending

    def recv(self, tensors: list[torch.Tensor], peer: int, channel: str, what: str) -> Pending:
        """Post asynchronous receives into `tensors`; `.wait()` returns them."""
        return Pending(self._p2p("recv", tensors, peer, channel), tensors, peer, what, self)

    def flush_sends(self) -> None:
        """Wait until every send went out (before a checkpoint or the exit)."""
        while self._sends:
            self._sends.popleft().wait()

    def all_gather(self, t: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
        """Start an all-gather of `t` over this replica's pipeline; wait with `wait_work`."""
        P = self.topo.num_stages
        if self.pipe_group is None or P == 1:
            return None, [t]
        out = [torch.empty_like(t) for _ in range(P)]
        work = dist.all_gather(out, t, group=self.pipe_group, async_op=True)
        return work, out

    def all_reduce_mean(self, t: torch.Tensor) -> None:
        """Average `t` in place over the data-parallel replicas of this stage."""
        if self.dp_group is None:
            return
        work = dist.all_reduce(t, group=self.dp_group, async_op=True)
        self.wait_work(work, "the data-parallel gradient all-reduce", None)
        t.div_(self.topo.data_parallel)

    def wait_work(self, work: Any, what: str, peer: int | None) -> None:
        if work is None:
            return
        try:
            ok = work.wait(self.timeout)
        except Exception as e:
            raise self._group_error(what, e, peer) from None
        if ok is False:
            raise self._group_error(what, "timed out", peer)

    def _group_error(self, what: str, cause: object, peer: int | None) -> PeerError:
        if peer is not None:
            return self.peer_error(peer, what, cause)
        reason = str(cause).strip().splitlines()[0][:200] if str(cause) else type(cause).__name__
        return PeerError(
            f"{self.topo.describe(self.rank)}: a peer failed or stopped responding during {what} "
            f"(timeout {self.timeout.total_seconds():g}s): {reason}"
        )

    def barrier(self, what: str, timeout_s: float | None = None) -> None:
        """A barrier that names the ranks that did not arrive (gloo's monitored barrier)."""
        if dist.get_world_size() == 1:
            return
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else self.timeout
        try:
            if self.backend == "gloo":
                dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
            else:
                dist.barrier(device_ids=[self.device.index or 0])
        except Exception as e:
            raise self._group_error(what, e, None) from None

    # ---- failure reporting -------------------------------------------------------------------


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def report_failure(store: Any, message: str) -> None:
    if store is None:
        return
    with contextlib.suppress(Exception):
        store.compare_set(FAILURE_KEY, "", message)


def first_failure(store: Any) -> str | None:
    if store is None:
        return None
    try:
        if store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode(errors="replace") or None
    except Exception:
        return None
    return None
