"""Joining the process group of a multi-process run, and the errors and barriers that name
the rank a wait blames.

`init_from_env` joins the group torchrun (or `launch.train`) describes in the environment and
keeps the rendezvous store for the failure records (`peers.failures`); `PeerError` is the one
error a wait on a peer raises, worded by `peer_error`; `barrier_on_store` is the barrier that
works before a `runtime.comm.Comm` exists and on NCCL (`peers.waits`).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stalepipe.training.peers.failures import AGENT_STORE_ENV, FailureRecords
from stalepipe.training.peers.topology import Topology
from stalepipe.training.peers.waits import backend_timeout_s, restart_prefix, store_barrier

RECORD_WAIT_S = 1.0  # how long a failed collective waits for a peer's record to name it


class PeerError(RuntimeError):
    """A peer rank died, hung past the timeout, or the communication with it failed. `peer` is
    the rank it names (None when a collective failed and no peer recorded why)."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


def resolve_backend(backend: str, device: str) -> str:
    """'auto' -> NCCL for CUDA devices, gloo otherwise."""
    if backend != "auto":
        return backend
    return "nccl" if device.startswith("cuda") else "gloo"


def leave_process_group() -> None:
    """Destroy the process group while the interpreter is whole. The run's store goes with
    the objects that hold it (`Membership.records`, `Comm.records`): keep none of them past
    the run (a store left to interpreter shutdown can abort the process: "terminate called
    without an active exception")."""
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class Membership:
    """This process's place in the process group it joined (`init_from_env`), and the run's
    failure records in the rendezvous store it joined through (none when it did not keep it,
    or joined before)."""

    rank: int
    world_size: int
    local_rank: int
    records: FailureRecords = FailureRecords()


def init_from_env(backend: str, timeout_s: float, *, failure_records: bool = True) -> Membership:
    """Join the process group torchrun (or `launch.train.launch_train`) describes in the
    environment (env:// rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE).
    `failure_records`: keep the rendezvous store, for the failure records (`peers.failures`)
    and the waits on it; without, the group joins through env:// itself."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    records = FailureRecords()
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=backend_timeout_s(backend, timeout_s))
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", local_rank)
        if failure_records:
            # What env:// does, keeping the store: the failure records live in it.
            hosted = os.environ.get(AGENT_STORE_ENV) == str(True)
            kwargs["store"] = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                world,
                is_master=rank == 0 and not hosted,
                timeout=timeout,
                multi_tenant=rank == 0 and not hosted,
            )
            records = FailureRecords(kwargs["store"])
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return Membership(rank, world, local_rank, records)


def barrier_on_store(
    topo: Topology, rank: int, key: str, what: str, timeout_s: float, records: FailureRecords
) -> None:
    """`store_barrier` over the run's store (`records.store`) for every rank of `topo` (before
    or without a `Comm`: the start-up, while rank 0 prepares data), ended early by a peer's
    failure record. A rank that does not arrive within `timeout_s` is a `PeerError` naming it,
    or the rank a failure record blames."""
    store = records.store
    assert store is not None, "the runtime joins the run's store (init_from_env)"
    missing = store_barrier(
        store,
        f"{restart_prefix()}{key}",
        rank,
        topo.world_size,
        timeout_s,
        stop=lambda: records.wait_other(0.0, rank) is not None,
    )
    if not missing:
        return
    f = records.wait_other(RECORD_WAIT_S, rank)
    if f is not None and f.root not in (None, rank):
        raise peer_error(topo, rank, f.root, what, timeout_s, f.line)
    late = ", ".join(topo.describe(r) for r in missing)
    raise PeerError(
        f"{topo.describe(rank)}: {late} did not arrive at {what} within {timeout_s:g}s",
        missing[0],
    )


def reason_line(cause: object) -> str:
    """The first line of `cause` (at most 200 characters), or its type's name."""
    text = str(cause).strip()
    return text.splitlines()[0][:200] if text else type(cause).__name__


def peer_error(
    topo: Topology,
    rank: int,
    peer: int,
    what: str,
    timeout_s: float,
    cause: object,
    via: int | None = None,
) -> PeerError:
    """The one `PeerError` wording: `rank` stopped because `peer` failed or stopped
    responding while it waited for `what` (from `via`, when another rank than `peer`)."""
    src = f" from {topo.describe(via)}" if via is not None and via != peer else ""
    return PeerError(
        f"{topo.describe(rank)}: {topo.describe(peer)} failed or stopped responding while "
        f"waiting for {what}{src} (timeout {timeout_s:g}s): {reason_line(cause)}",
        peer,
    )
