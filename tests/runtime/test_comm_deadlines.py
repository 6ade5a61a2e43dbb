"""The pieces of NCCL failure handling that run without NCCL (issue 18): polled waits with a
deadline, barriers through the store, NCCL's watchdog set later than both, and rank 0's long
work waited for outside collectives. A GPU run must still confirm them on NCCL
(docs/runtime.md, "Failures on NCCL")."""

from __future__ import annotations

import datetime
import pickle
import threading
import time

import pytest
import torch.distributed as dist

from stalepipe.errors import UserError
from stalepipe.training.peers.failures import FailureRecords
from stalepipe.training.peers.group import PeerError
from stalepipe.training.peers.topology import Topology
from stalepipe.training.peers.waits import backend_timeout_s, poll_work, store_barrier
from stalepipe.training.runtime import comm as comm_mod
from stalepipe.training.runtime.comm import Comm
from stalepipe.training.train.distributed import DistContext, on_main_outside_collectives


class FakeWork:
    """A `dist.Work` that completes after `polls` looks (never, with None)."""

    def __init__(self, polls: int | None, error: Exception | None = None) -> None:
        self.polls, self.error, self.looks, self.waited = polls, error, 0, False

    def is_completed(self) -> bool:
        self.looks += 1
        return self.polls is not None and self.looks > self.polls

    def wait(self, timeout=None) -> bool:
        self.waited = True
        if self.error is not None:
            raise self.error
        return True


def test_poll_work_waits_until_the_work_completes_then_waits_on_it():
    w = FakeWork(polls=50)
    assert poll_work(w, timeout_s=5.0) is True
    assert w.looks == 51 and w.waited  # wait(): the stream order and the work's error


def test_poll_work_gives_up_at_the_deadline():
    w = FakeWork(polls=None)
    t = time.monotonic()
    assert poll_work(w, timeout_s=0.2) is False
    assert 0.2 <= time.monotonic() - t < 1.0 and not w.waited


def test_poll_work_raises_the_works_error():
    with pytest.raises(RuntimeError, match="NCCL error"):
        poll_work(FakeWork(polls=0, error=RuntimeError("NCCL error: remote process exited")), 1.0)


def _nccl_comm(timeout_s: float) -> Comm:
    """A Comm's waiting half on 'nccl', without process groups."""
    c = object.__new__(Comm)
    c.topo, c.rank, c.backend = Topology(2), 1, "nccl"
    c.timeout = datetime.timedelta(seconds=timeout_s)
    c.records = FailureRecords()  # no run store: nothing to name the peer but the wait
    return c


def test_a_silent_peer_on_nccl_is_a_peer_error_within_the_timeout():
    c = _nccl_comm(0.2)
    pending = comm_mod.Pending([FakeWork(polls=None)], [], 0, "the activation of step 3", c)
    t = time.monotonic()
    with pytest.raises(PeerError) as e:
        pending.wait()
    assert time.monotonic() - t < 1.0 and e.value.peer == 0
    assert str(e.value) == (
        "rank 1 (stage 1): rank 0 (stage 0) failed or stopped responding while waiting for the "
        "activation of step 3 (timeout 0.2s): timed out"
    )
    with pytest.raises(PeerError, match="the vote of step 2"):
        c.wait_work(FakeWork(polls=None), "the vote of step 2", None)


def test_the_watchdog_fires_after_our_deadlines_on_nccl_only():
    assert backend_timeout_s("gloo", 120) == 120
    assert backend_timeout_s("nccl", 120) > 2 * 120


def _ranks(world: int, fn) -> list:
    out: list = [None] * world
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, fn(r))) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_store_barrier_lets_everyone_through_once_all_arrived():
    store = dist.HashStore()
    assert _ranks(3, lambda r: store_barrier(store, "b/1", r, 3, timeout_s=10)) == [[], [], []]


def test_store_barrier_names_the_ranks_that_did_not_arrive():
    store = dist.HashStore()
    t = time.monotonic()
    missing = _ranks(2, lambda r: store_barrier(store, "b/2", r, 3, timeout_s=0.3))
    assert missing == [[2], [2]] and time.monotonic() - t < 2.0


def test_store_barrier_ends_early_when_told_a_peer_failed():
    store = dist.HashStore()
    t = time.monotonic()
    missing = store_barrier(store, "b/3", 0, 2, timeout_s=60, stop=lambda: True)
    assert missing == [1] and time.monotonic() - t < 1.0


# ---- rank 0's long work, waited for on the store -------------------------------------------


@pytest.fixture
def store():
    return dist.HashStore()


def _as_rank(store, rank: int, fn, **kw):
    ctx = DistContext(rank=rank, world_size=2, store=store)  # each "process" counts from 0
    return on_main_outside_collectives(fn, ctx, "the save", **kw)


def test_rank0_works_while_the_others_wait_on_the_store(store):
    assert _as_rank(store, 0, lambda: "path") == "path"
    assert _as_rank(store, 1, lambda: pytest.fail("rank 1 must not run it")) == "path"


def test_rank0s_user_error_is_raised_on_every_rank(store):
    def full_disk():
        raise UserError("no space left for the checkpoint; free some or set --out_dir")

    for rank in (0, 1):
        with pytest.raises(UserError, match="no space left"):
            _as_rank(store, rank, full_disk)


def test_a_rank0_that_never_finishes_is_a_peer_error(store):
    with pytest.raises(PeerError, match=r"rank 0 did not finish the save within 0.2s"):
        _as_rank(store, 1, lambda: None, timeout_s=0.2)
    store.set("stalepipe/0/main/1", pickle.dumps(("failed", "RuntimeError: boom")))
    with pytest.raises(PeerError, match="rank 0 failed during the save: RuntimeError: boom"):
        _as_rank(store, 1, lambda: None, timeout_s=5)
