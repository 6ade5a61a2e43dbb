"""Data parallelism for the delay emulator under `torchrun` (gloo on CPU, NCCL on GPU).

Every rank holds a full replica (weights, kept weight versions, EF buffers, optimizer state):
they stay identical because every rank applies the same all-reduced stale gradient. Rank r of
W reads rows [r*B/W, (r+1)*B/W) of the deterministic global batch k, so the run is the same
whatever W is (up to float summation order), and a checkpoint written with W ranks resumes on
any other number. Only rank 0 writes files.

Rank 0's long work (data preparation, a checkpoint write) is waited for on the run's store,
not inside a collective (`on_main_outside_collectives`): a collective waiting longer than its timeout ends
the process (NCCL's watchdog), and a multi-GB save can take minutes.

Not for the pipeline runtime (`pipeline.engine distributed`), which has its own process groups.
"""

from __future__ import annotations

import itertools
import os
import pickle
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from stalepipe.config import ConfigError, ExperimentConfig
from stalepipe.errors import UserError
from stalepipe.training.peers.group import (
    PeerError,
    init_from_env,
    leave_process_group,
    resolve_backend,
)
from stalepipe.training.peers.topology import under_torchrun
from stalepipe.training.peers.waits import STORE_POLL_S, restart_prefix

T = TypeVar("T")


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in a data-parallel job (rank 0 of 1 when not distributed)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    store: Any = field(default=None, repr=False, compare=False)  # the run's rendezvous store
    # calls of on_main_outside_collectives so far (the same count on every rank)
    main_calls: Iterator[int] = field(default_factory=itertools.count, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


SINGLE_PROCESS = DistContext()


def init_data_parallel(cfg: ExperimentConfig) -> DistContext:
    """Join the torchrun job described by the environment, or return a single-rank context.

    The device becomes `cuda:<LOCAL_RANK>` for CUDA runs; CPU runs use gloo.
    """
    if not under_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return DistContext()
    world = int(os.environ["WORLD_SIZE"])
    tc = cfg.train
    if tc.batch_size % world or tc.num_microbatches % world:
        raise ConfigError(
            f"train.batch_size ({tc.batch_size}) and train.num_microbatches "
            f"({tc.num_microbatches}) must be divisible by the {world} data-parallel ranks; set "
            f"--train.num_microbatches to a multiple of {world} (and --train.batch_size to a "
            f"multiple of that)"
        )
    backend = resolve_backend(cfg.pipeline.backend, tc.device)
    # The store is kept for `on_main_outside_collectives`.
    joined = init_from_env(backend, cfg.pipeline.timeout_s)
    if tc.device.startswith("cuda"):
        torch.cuda.set_device(joined.local_rank)
    return DistContext(
        rank=joined.rank,
        world_size=joined.world_size,
        local_rank=joined.local_rank,
        store=joined.records.store,
    )


def local_device(cfg: ExperimentConfig, ctx: DistContext) -> torch.device:
    """This rank's device: `cuda` becomes `cuda:<local_rank>` under torchrun."""
    if cfg.train.device == "cuda" and ctx.enabled:
        return torch.device("cuda", ctx.local_rank)
    return torch.device(cfg.train.device)


def shard_rows(x: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """This rank's contiguous slice of a global batch's rows."""
    return x.chunk(ctx.world_size)[ctx.rank] if ctx.enabled else x


@torch.no_grad()
def allreduce_grads_(params: Iterable[torch.nn.Parameter], ctx: DistContext) -> None:
    """Average gradients across ranks in one flat buffer (one collective per step)."""
    if not ctx.enabled:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(ctx.world_size)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def mean_across_ranks(value: float, ctx: DistContext, device: torch.device) -> float:
    """The mean of a per-rank scalar (e.g. the loss of each rank's slice)."""
    if not ctx.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / ctx.world_size).item()


def or_across_ranks(bits: int, ctx: DistContext, device: torch.device, width: int = 8) -> int:
    """The bitwise OR of a per-rank integer's low `width` bits (any rank's request becomes
    every rank's): one MAX all-reduce over the bits."""
    if not ctx.enabled:
        return bits
    t = torch.tensor([(bits >> i) & 1 for i in range(width)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return sum(int(b) << i for i, b in enumerate(t.tolist()))


def on_main(fn: Callable[[], T], ctx: DistContext) -> T:
    """Run `fn` on rank 0 only and share its result; a UserError raised there is raised on
    every rank, so no rank waits forever for one that gave up."""
    if not ctx.enabled:
        return fn()
    payload: list[object] = [None]
    if ctx.is_main:
        try:
            payload[0] = ("ok", fn())
        except UserError as e:
            payload[0] = ("error", e)
    dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]  # type: ignore[misc]
    if status == "error":
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]


# Long work rank 0 may do while the others wait (a checkpoint of a 10B model under 2bw+EF is
# hundreds of GB): the wait's deadline, far beyond pipeline.timeout_s.
MAIN_WORK_TIMEOUT_S = 3600.0


def on_main_outside_collectives(
    fn: Callable[[], T], ctx: DistContext, what: str, timeout_s: float = MAIN_WORK_TIMEOUT_S
) -> T:
    """`on_main` for long work: run `fn` on rank 0 only, the other ranks waiting for it on the
    run's store (no collective: see the module docstring) up to `timeout_s`. Returns `fn`'s
    result (picklable) on every rank; a UserError raised on rank 0 is raised on every rank, and
    any other failure there is a `PeerError` naming rank 0 on the others."""
    if not ctx.enabled:
        return fn()
    store = ctx.store
    assert store is not None, "init_data_parallel keeps the run's store"
    key = f"{restart_prefix()}main/{next(ctx.main_calls) + 1}"
    if ctx.is_main:
        try:
            result = fn()
        except UserError as e:
            store.set(key, pickle.dumps(("error", e)))
            raise
        except BaseException as e:
            store.set(key, pickle.dumps(("failed", f"{type(e).__name__}: {e}")))
            raise
        store.set(key, pickle.dumps(("ok", result)))
        return result
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() >= deadline:
            raise PeerError(
                f"rank {ctx.rank}: rank 0 did not finish {what} within {timeout_s:g}s", peer=0
            )
        time.sleep(STORE_POLL_S)
    status, value = pickle.loads(store.get(key))
    if status == "error":
        raise value
    if status == "failed":
        raise PeerError(f"rank {ctx.rank}: rank 0 failed during {what}: {value}", peer=0)
    return value


def shutdown(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        leave_process_group()
