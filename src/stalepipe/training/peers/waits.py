"""Host-side waits with a deadline, for backends whose own waits keep none (NCCL).

On NCCL `Work.wait` only orders the current CUDA stream after the operation and returns, and
`dist.barrier` ignores its timeout; NCCL's watchdog ends an operation that outlives its group's
timeout by aborting the process, without a message. The runtime (`runtime.comm`) and the
data-parallel emulator (`train.distributed`) therefore wait on the host: `poll_work` for an
operation, `store_barrier` for everyone (outside any collective, through the run's store), and
set the groups' own timeout later than both (`backend_timeout_s`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

POLL_MAX_S = 1e-3  # the longest pause between two polls of an NCCL work (latency it may add)
STORE_POLL_S = 0.05  # between two looks at the store in a barrier


def backend_timeout_s(backend: str, timeout_s: float) -> float:
    """The process groups' own timeout for `pipeline.timeout_s`: the same on gloo (its waits
    raise); on NCCL twice it plus a minute, so the host-side deadlines (`poll_work`,
    `store_barrier`) name the peer first and the watchdog, which aborts the process without a
    message, only ends a collective nobody polls."""
    return timeout_s * 2 + 60 if backend == "nccl" else timeout_s


def poll_work(work: Any, timeout_s: float) -> bool:
    """Wait on the host for `work` (a `dist.Work`) to complete, up to `timeout_s`: True when it
    did (its `wait()` then raised its error, if any, and ordered the current stream after it),
    False when the deadline passed first. Polls `is_completed()` with pauses that grow to
    `POLL_MAX_S`, so a wait adds at most about a millisecond of latency."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0
    while not work.is_completed():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2 or 1e-5, POLL_MAX_S)
    work.wait()
    return True


def store_barrier(
    store: Any,
    key: str,
    rank: int,
    world: int,
    timeout_s: float,
    stop: Callable[[], bool] = lambda: False,
) -> list[int]:
    """Arrive at the barrier `key` of `world` ranks in `store` and wait for the others, outside
    any collective. Returns [] once all arrived, else the ranks that had not when `timeout_s`
    passed or `stop()` (polled every `STORE_POLL_S`, e.g. "a peer recorded a failure") said to
    give up."""
    store.set(f"{key}/{rank}", "1")
    keys = [f"{key}/{r}" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if time.monotonic() >= deadline or stop():
            return [r for r, k in enumerate(keys) if not store.check([k])]
        time.sleep(STORE_POLL_S)
    return []


def restart_prefix() -> str:
    """Store keys of this attempt: torchrun's restarts share its agent's store."""
    return f"stalepipe/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
