"""Failure records: which rank of a run failed first, and why, in the run's rendezvous store.

The run's rendezvous store (hosted by the launcher, by torchrun's agent, or else by rank 0)
holds one `Failure` per failed rank and the run's first one: a rank that raises records its
one line (`FailureRecords.report`), and the spawning launcher records a rank that died without
one (killed). Waits that cannot name a peer by themselves (collectives, the checkpoint parts
rank 0 waits for) read them: a dead peer is named within a fraction of a second instead of
after `pipeline.timeout_s`, and the launcher names the rank that stopped first.

No module state: a process's `FailureRecords` is a value, the one `group.init_from_env` joined
(`Membership.records`), handed to whoever reads or writes them (`comm.Comm`, the checkpoint
parts' wait), or a new connection to a launcher's store (`launcher_records`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

FAILURE_KEY = "stalepipe/first_failure"
# torchrun's contract with env:// rendezvous: the launcher (torchrun's agent, or ours) hosts the
# store and every rank, rank 0 included, joins it as a client.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


@dataclass(frozen=True)
class Failure:
    """One rank's failure as the run's store records it.

    kind: "peer" (it stopped because `peer` failed; None: a collective, peer unknown),
    "error" (it failed by itself: bad input, divergence, a bug), "exit" (the launcher saw it
    die without a record: killed, or crashed in C). `line` is what the rank printed."""

    rank: int
    kind: str
    line: str
    peer: int | None = None
    code: int | None = None  # its exit status, when known

    @property
    def root(self) -> int | None:
        """The rank this failure blames: the peer of a peer failure, else the rank itself."""
        return self.peer if self.kind == "peer" else self.rank


def _failure_key(rank: int) -> str:
    return f"stalepipe/failure/{rank}"


@dataclass(frozen=True)
class FailureRecords:
    """The failure records of a run in its rendezvous store (`store`; None: this process has
    none to read or write, e.g. a single process, then every read finds nothing)."""

    store: Any = None

    def report(self, failure: Failure) -> None:
        """Record `failure` as its rank's, and as the run's first unless one is recorded
        already. Never raises: a dead store only means that nobody reads it."""
        if self.store is None:
            return
        text = json.dumps(asdict(failure))
        with contextlib.suppress(Exception):
            self.store.set(_failure_key(failure.rank), text)
            self.store.compare_set(FAILURE_KEY, "", text)

    def first(self) -> Failure | None:
        """The run's first recorded failure (None: none, or no store)."""
        return None if self.store is None else _read(self.store, FAILURE_KEY)

    def of_rank(self, rank: int) -> Failure | None:
        """What `rank` recorded when it failed (None: nothing, or no store)."""
        return None if self.store is None else _read(self.store, _failure_key(rank))

    def wait_other(self, wait_s: float, rank: int) -> Failure | None:
        """The first failure recorded by a rank other than `rank`, waiting up to `wait_s` for
        one (a peer that failed this moment records it a few milliseconds later)."""
        if self.store is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            f = self.first()
            if f is not None and f.rank != rank:
                return f
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


class WorkerFailed(Exception):
    """A worker's failure it already printed into its rank log (`train.pipelined.run_worker`
    with `wrapped`): `error` is what it raised, `records` the run's failure records it
    had joined, where the process that ends on it records it (`launch.train.run_rank`)."""

    def __init__(self, error: BaseException, records: FailureRecords) -> None:
        super().__init__(str(error))
        self.error: BaseException = error
        self.records: FailureRecords = records


def launcher_records() -> FailureRecords:
    """A new connection to the run's store when a launcher hosts it (`AGENT_STORE_ENV`: ours,
    or torchrun's agent): for a process that has not joined the run's store (a worker that
    failed before, or after it left the process group); else no records."""
    if os.environ.get(AGENT_STORE_ENV) != str(True):
        return FailureRecords()
    with contextlib.suppress(Exception):
        return FailureRecords(
            dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=datetime.timedelta(seconds=10),
            )
        )
    return FailureRecords()


def _read(store: Any, key: str) -> Failure | None:
    try:
        if not store.check([key]):
            return None
        raw = store.get(key).decode(errors="replace")
        return Failure(**json.loads(raw)) if raw else None
    except Exception:
        return None
