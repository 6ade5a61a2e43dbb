"""Point-to-point and control communication of the pipeline runtime, with timeouts everywhere.

Ranks: `rank` is the torch.distributed rank, `replica * R + r` (R processes per pipeline, D
data-parallel replicas); a schedule's lists are indexed by the rank within one replica's
pipeline, r = `rank % R` (`schedules.schedule`). Without chunks R is the number of stages P and
r is the stage; with C chunks per process (interleaved 1F1B) R = P / C and rank r runs stages
r, r + R, ... (`Topology`). Rank 0 runs stage 0 of replica 0 (it logs and writes checkpoints).

Channels. Every message between two stages travels on a *channel*: activations forward
(`act`), gradients backward (`grad`), evaluation activations (`eval`), the tied embedding's head
gradient (last stage -> first, `tied_grad`) and its new weights (first -> last, `tied_w`), and
the evaluation loss (last -> first, `eval_loss`). A message is addressed by its link, (sending
stage, receiving stage); both ends of a link's channel issue their operations in the same order
(the schedule's (step, microbatch) order), so messages need no headers.
- gloo (CPU): one process group, a distinct tag per (channel, sending stage) (`tag`);
  isend/irecv are asynchronous.
- NCCL (GPU): one two-rank process group per (channel, link), so operations of different
  channels or chunks run on different communicators and can never wait on each other (the
  deadlock that batched send/recv avoids in single-communicator runtimes); several operations
  posted at once on one channel go out as one `batch_isend_irecv`.

Timeouts. Every wait has a deadline (`pipeline.timeout_s`); a dead peer (gloo notices a closed
connection at once, when an operation is posted or while it is waited for) or a silent one
(deadline) raises `PeerError` naming the peer rank, and the runtime then exits non-zero.
On NCCL `Work.wait` does not block the host (it only orders the current CUDA stream after the
work), so the deadline is kept by polling the work, NCCL's own watchdog timeout is set later
than it (the watchdog aborts the process without a word), and barriers go through the run's
store (`dist.barrier` on NCCL ignores its timeout and would trip the watchdog while rank 0
prepares data or writes a checkpoint): `peers.waits`. Failure records (`peers.failures`)
name the rank that stopped first; joining the group and the errors' wording are `peers.group`.

Receives. Each stage's `Inbox` posts the receives of its action list a few ahead
(`LOOKAHEAD`), in the order the schedule consumes them, so a message never waits for its
receive to be posted.
"""

from __future__ import annotations

import datetime
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from stalepipe.training.peers.failures import FailureRecords
from stalepipe.training.peers.group import (
    RECORD_WAIT_S,
    PeerError,
    barrier_on_store,
    peer_error,
    reason_line,
)
from stalepipe.training.peers.topology import Topology
from stalepipe.training.peers.waits import backend_timeout_s, poll_work
from stalepipe.training.schedules.schedule import Action

CHANNELS = ("act", "grad", "eval", "tied_grad", "tied_w", "eval_loss")
Link = tuple[int, int]  # (sending stage, receiving stage) of a channel's messages


def tag(channel: str, src_stage: int) -> int:
    """gloo's tag of `channel` from `src_stage`: one stream per (channel, sending stage), since
    with chunks two stages of one rank send to the same peer rank on the same channel."""
    return 1 + CHANNELS.index(channel) + len(CHANNELS) * src_stage


class Pending:
    """Outstanding receives (or sends) of one channel operation; `wait()` enforces the deadline
    and turns any failure into a `PeerError` that names the peer."""

    def __init__(self, works: list, tensors: list[torch.Tensor], peer: int, what: str, comm: Comm):
        self.works, self.tensors, self.peer, self.what, self.comm = works, tensors, peer, what, comm
        self.seq = -1  # a send's number in its Comm's order of sends (`Comm.retire_sends`)

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            try:
                ok = self.comm.wait_one(w)
            except Exception as e:  # gloo/NCCL raise RuntimeError or DistBackendError
                raise self.comm.peer_error(self.peer, self.what, e) from None
            if ok is False:
                raise self.comm.peer_error(self.peer, self.what, "timed out")
        self.works = []
        return self.tensors

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)


class _Handover:
    """A receive from a stage of this process: the tensors its send left (the schedule runs
    the send first; waiting for it here would wait forever)."""

    def __init__(self, queue: deque[list[torch.Tensor]], what: str) -> None:
        self.queue, self.what = queue, what

    def wait(self) -> list[torch.Tensor]:
        assert self.queue, f"{self.what}: received before this process sent it (schedule order)"
        return self.queue.popleft()

    def done(self) -> bool:
        return bool(self.queue)


class Comm:
    """The runtime's communication: channels to the neighbouring stages of this replica, the
    per-step control all-gather over the replica's pipeline, and the data-parallel all-reduce
    over the replicas of this stage. All ranks construct it collectively (same order).
    `records`: the run's failure records (`Membership.records`), which name the rank a failed
    wait blames; none: the peer the wait had, or none."""

    def __init__(
        self,
        topo: Topology,
        rank: int,
        backend: str,
        timeout_s: float,
        device,
        records: FailureRecords | None = None,
    ):
        self.topo, self.rank, self.backend = topo, rank, backend
        self.records = FailureRecords() if records is None else records
        self.device = torch.device(device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._pg_timeout = datetime.timedelta(seconds=backend_timeout_s(backend, timeout_s))
        self._barriers = 0  # store barriers so far (the same count on every rank)
        self.pipe_rank, self.replica = topo.pipe_rank(rank), topo.replica_of(rank)
        # The rank of each stage of this replica, looked up once (every message asks).
        self._peers = [topo.rank(s, self.replica) for s in range(topo.num_stages)]
        self.pipe_size = topo.num_ranks  # ranks in this replica's pipeline (the all-gather's)
        self.pipe_group = None
        self.dp_group = None
        self._groups: dict[tuple[str, int, int], Any] = {}
        try:  # a rank that died during start-up: the same PeerError as later
            self._make_groups()
        except Exception as e:
            raise self.peer_error(None, "the start-up (creating the process groups)", e) from None
        self._sends: deque[Pending] = deque()
        self.sends_posted = self.peak_sends = 0  # sends posted so far; the most held at once
        self._local: dict[tuple[str, Link], deque[list[torch.Tensor]]] = {}  # hand-overs

    def _make_groups(self) -> None:
        topo, R, D = self.topo, self.topo.num_ranks, self.topo.num_replicas
        # Control group (per-step all-gather of grad norms and losses), data-parallel groups.
        # new_group is collective over the whole world: every rank creates every group.
        for d in range(D):
            ranks = [topo.rank(r, d) for r in range(R)]
            g = dist.new_group(ranks, timeout=self._pg_timeout) if R > 1 or D > 1 else None
            if d == self.replica:
                self.pipe_group = g
        if D > 1:
            for r in range(R):
                g = dist.new_group([topo.rank(r, d) for d in range(D)], timeout=self._pg_timeout)
                if r == topo.pipe_rank(self.rank):
                    self.dp_group = g
        # NCCL: one communicator per (channel, sending stage, receiving stage): a rank pair
        # with several chunks carries several streams, and NCCL matches operations by order.
        if self.backend == "nccl":
            for d in range(D):
                for a, b, chans in self._pairs(topo.num_stages):
                    for ch in chans:
                        ra, rb = topo.rank(a, d), topo.rank(b, d)
                        if ra == rb:  # two stages of one process: handed over locally
                            continue
                        g = dist.new_group([ra, rb], timeout=self._pg_timeout)
                        if d == self.replica and self.rank in (ra, rb):
                            self._groups[(ch, a, b)] = g

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
        """The rank that runs `stage` of this rank's replica."""
        return self._peers[stage]

    def peer_error(self, peer: int | None, what: str, cause: object) -> PeerError:
        """The `PeerError` of this rank when waiting for `what` from `peer` (None: a
        collective) failed with `cause`. It names the rank the run's first failure record
        blames when there is one (waiting up to RECORD_WAIT_S unless `cause` is a timeout): a
        neighbour that stopped because of another rank, or a collective, would name the wrong
        rank or none; else `peer`."""
        timeout_s = self.timeout.total_seconds()
        # A dead peer's record comes within milliseconds; a silent one's may never come.
        silent = "timed out" in str(cause).lower()
        f = self.records.wait_other(0.0 if silent else RECORD_WAIT_S, self.rank)
        if f is not None and f.root not in (None, self.rank):
            return peer_error(self.topo, self.rank, f.root, what, timeout_s, f.line, via=peer)
        if peer is not None:
            return peer_error(self.topo, self.rank, peer, what, timeout_s, cause)
        return PeerError(
            f"{self.topo.describe(self.rank)}: a peer failed or stopped responding during {what} "
            f"(timeout {timeout_s:g}s): {reason_line(cause)}"
        )

    def _p2p(self, op: str, tensors: list[torch.Tensor], link: Link, channel: str, what: str):
        src, dst = link
        peer = self.peer_rank(dst if op == "send" else src)
        fn = dist.isend if op == "send" else dist.irecv
        try:  # posting fails at once when gloo already saw the peer's connection close
            if self.backend == "nccl":
                group = self._groups[(channel, src, dst)]
                return dist.batch_isend_irecv([dist.P2POp(fn, t, peer, group) for t in tensors])
            return [fn(t, peer, tag=tag(channel, src)) for t in tensors]
        except Exception as e:  # RuntimeError or DistBackendError, as in Pending.wait
            raise self.peer_error(peer, what, e) from None

    def send(self, tensors: list[torch.Tensor], link: Link, channel: str, what: str) -> Pending:
        """Asynchronous send from stage `link[0]` (this rank's) to stage `link[1]` on
        `channel`; the tensors are kept alive until the send completed. The returned `Pending`
        may be waited on (it is also waited by `flush_sends`). Between two stages of this
        process (rank R-1 of a V) the tensors are handed over without a message."""
        tensors = [t.detach().contiguous() for t in tensors]
        what = f"the send of {what}"
        peer = self.peer_rank(link[1])
        if peer == self.rank:
            self._local.setdefault((channel, link), deque()).append(tensors)
            return Pending([], tensors, peer, what, self)
        pending = Pending(
            self._p2p("send", tensors, link, channel, what), tensors, peer, what, self
        )
        pending.seq, self.sends_posted = self.sends_posted, self.sends_posted + 1
        self._sends.append(pending)
        self.peak_sends = max(self.peak_sends, len(self._sends))
        while self._sends and self._sends[0].done():
            self._sends.popleft().wait()
        return pending

    def retire_sends(self, upto: int) -> None:
        """Release the sends numbered below `upto`, which the caller knows were received (so
        waiting returns at once): gloo completes a send, and frees its tensors, only when waited."""
        while self._sends and self._sends[0].seq < upto:
            self._sends.popleft().wait()

    def recv(self, tensors: list[torch.Tensor], link: Link, channel: str, what: str) -> Pending:
        """Post asynchronous receives into `tensors` of what stage `link[0]` sends stage
        `link[1]` (this rank's) on `channel`; `.wait()` returns them."""
        peer = self.peer_rank(link[0])
        if peer == self.rank:  # what this process's stage link[0] sends (`send`)
            return _Handover(self._local.setdefault((channel, link), deque()), what)
        works = self._p2p("recv", tensors, link, channel, what)
        return Pending(works, tensors, peer, what, self)

    def flush_sends(self) -> None:
        """Wait until every send went out (before a checkpoint or the exit)."""
        while self._sends:
            self._sends.popleft().wait()

    def all_gather(
        self, t: torch.Tensor, what: str = "the per-step exchange of gradient norms and losses"
    ) -> tuple[Any, list[torch.Tensor]]:
        """Start an all-gather of `t` over this replica's pipeline; wait with `wait_work`."""
        R = self.pipe_size
        if self.pipe_group is None or R == 1:
            return None, [t]
        out = [torch.empty_like(t) for _ in range(R)]
        return self.post(what, lambda: dist.all_gather(out, t, self.pipe_group, async_op=True)), out

    def post(self, what: str, start: Callable[[], Any]) -> Any:
        """Post a collective: `start()` calls it with async_op=True and returns its work (wait
        with `wait_work`). A failure already while posting (gloo saw a peer's connection
        close) is the same `PeerError` that waiting would raise."""
        try:
            return start()
        except Exception as e:  # RuntimeError or DistBackendError
            raise self.peer_error(None, what, e) from None

    def all_reduce_mean(self, t: torch.Tensor) -> None:
        """Average `t` in place over the data-parallel replicas of this stage."""
        if self.dp_group is None:
            return
        what = "the data-parallel gradient all-reduce"
        work = self.post(what, lambda: dist.all_reduce(t, group=self.dp_group, async_op=True))
        self.wait_work(work, what, None)
        t.div_(self.topo.num_replicas)

    def wait_work(self, work: Any, what: str, peer: int | None) -> None:
        """Wait for a collective's `work` (None: nothing to wait for); a failure or the
        deadline raises `PeerError` naming `peer`, or the rank a failure record names."""
        if work is None:
            return
        try:
            ok = self.wait_one(work)
        except Exception as e:
            raise self.peer_error(peer, what, e) from None
        if ok is False:
            raise self.peer_error(peer, what, "timed out")

    def wait_one(self, work: Any) -> bool:
        """Wait for `work` until the deadline; False when it passed first (module docstring:
        on NCCL by polling, since its `wait` returns at once)."""
        if self.backend == "nccl":
            return poll_work(work, self.timeout.total_seconds())
        return work.wait(self.timeout)

    def barrier(
        self, what: str, timeout_s: float | None = None, *, via_store: bool = False
    ) -> None:
        """A barrier that names the ranks that did not arrive: gloo's monitored barrier, or on
        NCCL (and with `via_store`, e.g. while point-to-point operations may be in flight) the
        run's store (`store_barrier`), which a peer's failure record ends early."""
        if dist.get_world_size() == 1:
            return
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else self.timeout
        if (self.backend != "gloo" or via_store) and self.records.store is not None:
            self._barriers += 1
            key = f"barrier/{self._barriers}"
            t = timeout.total_seconds()
            barrier_on_store(self.topo, self.rank, key, what, t, self.records)
            return
        try:
            if self.backend == "gloo":
                dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
            else:
                dist.barrier(device_ids=[self.device.index or 0])
        except Exception as e:
            raise self.peer_error(None, what, e) from None


# ---- receives posted ahead ------------------------------------------------------------

LOOKAHEAD = 4  # receives posted ahead per channel


class _Channel:
    def __init__(self, link: tuple[int, int], name: str, what: str) -> None:
        self.link, self.name, self.what = link, name, what
        self.keys: deque[tuple[int, int]] = deque()  # (step, microbatch) still to post
        self.posted: deque = deque()  # (key, Pending)


class Inbox:
    """The receives of one stage's action list, posted LOOKAHEAD ahead per channel: activations
    from stage s-1 (for F), gradients from stage s+1 (for B / BI)."""

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
