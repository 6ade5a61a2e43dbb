"""Failure records: which rank of a run failed first, and why, in the run's rendezvous store.

Failure records. The run's rendezvous store (`run_store`: hosted by the launcher, by torchrun's
agent, or else by rank 0) holds one `Failure` per failed rank and the run's first one: a rank
that raises records its one line (`report_failure`), and the spawning launcher records a rank
that died without one (killed). Waits that cannot name a peer by themselves (collectives, the
checkpoint parts rank 0 waits for) read them: a dead peer is named within a fraction of a second
instead of after `pipeline.timeout_s`, and the launcher names the rank that stopped first.
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

_store: Any = None  # the store `comm.init_from_env` joined (or `run_store` connected to)


def set_run_store(store: Any) -> None:
    """The store this process joined (`comm.init_from_env`), or None when it leaves."""
    global _store
    _store = store


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


def run_store() -> Any:
    """The run's rendezvous store, where failures are recorded: the one `init_from_env`
    joined; before that, a new client when a launcher hosts it (`AGENT_STORE_ENV`); else None."""
    global _store
    if _store is None and os.environ.get(AGENT_STORE_ENV) == str(True):
        with contextlib.suppress(Exception):
            _store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=datetime.timedelta(seconds=10),
            )
    return _store


def _failure_key(rank: int) -> str:
    return f"stalepipe/failure/{rank}"


def report_failure(store: Any, failure: Failure) -> None:
    """Record `failure` as its rank's, and as the run's first unless one is recorded already.
    Never raises: a dead store only means that nobody reads it."""
    if store is None:
        return
    text = json.dumps(asdict(failure))
    with contextlib.suppress(Exception):
        store.set(_failure_key(failure.rank), text)
        store.compare_set(FAILURE_KEY, "", text)


def _read(store: Any, key: str) -> Failure | None:
    try:
        if not store.check([key]):
            return None
        raw = store.get(key).decode(errors="replace")
        return Failure(**json.loads(raw)) if raw else None
    except Exception:
        return None


def first_failure(store: Any) -> Failure | None:
    """The run's first recorded failure (None: none, or no store)."""
    return None if store is None else _read(store, FAILURE_KEY)


def rank_failure(store: Any, rank: int) -> Failure | None:
    """What `rank` recorded when it failed (None: nothing, or no store)."""
    return None if store is None else _read(store, _failure_key(rank))


def wait_failure(store: Any, wait_s: float, rank: int) -> Failure | None:
    """The first failure recorded by a rank other than `rank`, waiting up to `wait_s` for one
    (a peer that failed this moment records it a few milliseconds later)."""
    if store is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        f = first_failure(store)
        if f is not None and f.rank != rank:
            return f
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
