"""Agreeing on a step to checkpoint (and maybe stop) at, without slowing the pipeline.

A signal or the checkpoint clock reaches each process of the runtime at its own moment, but
every stage must checkpoint after the same update S, and S must be a sync point on every
stage before any of them posts update S. Each process takes part in one vote per step:

    at its STEP k:      start an asynchronous all-reduce (MAX per request bit) of its requests
    at its STEP k + L:  wait for vote k (usually long finished) and agree on S = k + 2L

with L = max(1, A), A the schedule's lookahead: the most steps any action before a STEP k runs
ahead of k (`lookahead`; 0 for GPipe/1F1B/ZB-H1, 1 for 2BW, up to P-1 for PipeDream).

Why it cannot deadlock: a process waiting at its STEP k + L has run every F and B of the steps
up to k + L (all of a step's F/B come before its STEP), so it has posted every message that
any other process needs to reach its STEP k (those actions belong to steps <= k + A).
Why S is in time: a process decides at its STEP k + L, before its STEP S; everything it ran
before deciding belongs to steps <= k + L + A <= S. After deciding it skips the actions of
steps after S, and the actions left (every action of the steps <= S, in schedule order) form
a deadlock-free schedule of their own.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from stalepipe.runtime.comm import Comm
from stalepipe.schedules.schedule import Action

BITS = 8  # request bits voted on (train.engine's STOP, CHECKPOINT, ...)


def lookahead(actions: list[Action]) -> int:
    """How many steps ahead of step k an action before STEP k runs, at most, in one rank's
    list."""
    ahead, newest = 0, -1
    for a in actions:
        if a.kind == "STEP":
            ahead = max(ahead, newest - a.step)
        newest = max(newest, a.step)
    return ahead


class StepVotes:
    """One vote per step over every process of the run (see the module docstring).

    Build it on every process at the same point (it creates a process group collectively)."""

    def __init__(self, comm: Comm, lag: int) -> None:
        self.comm, self.lag = comm, max(1, lag)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.group = dist.new_group(list(range(world))) if world > 1 else None
        self.device = comm.device if comm.backend == "nccl" else torch.device("cpu")
        self._open: deque[tuple[int, torch.Tensor, object]] = deque()

    def start(self, step: int, bits: int) -> None:
        """Cast this process's requests for vote `step` (at its STEP `step`)."""
        t = torch.tensor([(bits >> i) & 1 for i in range(BITS)], dtype=torch.int32)
        t = t.to(self.device)
        work = None
        if self.group is not None:
            group = self.group
            work = self.comm.post(
                f"the vote of step {step} (signals, checkpoint clock)",
                lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True),
            )
        self._open.append((step, t, work))

    def decide(self, step: int) -> tuple[int, int] | None:
        """At STEP `step`: the outcome of vote `step - lag` as (S, bits), S the step to act on
        after; None when no vote is due."""
        if not self._open or self._open[0][0] != step - self.lag:
            return None
        k, t, work = self._open.popleft()
        self.comm.wait_work(work, f"the vote of step {k} (signals, checkpoint clock)", None)
        bits = sum(int(b) << i for i, b in enumerate(t.tolist()))
        return k + 2 * self.lag, bits

    def close(self) -> None:
        """Wait for every vote still open (all processes cast the same ones)."""
        while self._open:
            k, _, work = self._open.popleft()
            self.comm.wait_work(work, f"the vote of step {k}", None)
