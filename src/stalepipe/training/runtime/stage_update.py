"""The per-step exchanges of a pipeline process: its update (posted at STEP, applied when first
needed, reported in order) and its vote on a step to checkpoint or stop at.

At its last STEP of step k a process finishes step k's gradient (data-parallel all-reduce)
and starts one all-gather over the pipeline of [per-parameter gradient norms | raw
MoE router sums | loss], each stage of the process at its own offset (`_Layout`). The update
is *applied* when first needed: before an action that reads version k+1, before the next
STEP, at a sync point (an eval or checkpoint reads W_{k+1}), or at the end. This
keeps the no-flush schedules free of bubbles even though gradient clipping needs every stage's
norm. The update itself is `delay.DelayedOptimizer.step` -- the emulator's own version
bookkeeping, Taylor and error-feedback code, so both engines share one implementation.

Votes (`StepVotes`): agreeing on a step to checkpoint (and maybe stop) at, without slowing the
pipeline.

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

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from stalepipe.training.delay import DelayedOptimizer
from stalepipe.training.models.moe import raw_stats_width, summarize_router_stats
from stalepipe.training.optim.lr_schedule import apply_lr
from stalepipe.training.runtime.comm import Comm
from stalepipe.training.schedules.schedule import Action


@dataclass
class UpdateReport:
    """What the update of one step reports (identical on every rank of the replica)."""

    step: int
    loss: float
    grad_norm: float  # NaN without clipping
    lr: float
    router: dict[str, float] = field(default_factory=dict)  # MoE metrics at log steps


@dataclass
class _Posted:
    """A step whose gradient is complete and exchanged but whose update is not applied yet."""

    step: int
    work: Any
    gathered: list[torch.Tensor]
    grads: dict[str, torch.Tensor]


class _Layout:
    """Where each stage's entries sit in the exchanged vectors: stage s is in the vector of
    the pipeline rank that runs it, after that rank's lower stages (chunks)."""

    def __init__(self, comm: Comm, param_counts: list[int], stats_widths: list[int]) -> None:
        topo = comm.topo
        R, S = topo.num_ranks, topo.num_stages
        per_rank = [topo.stages_of(r) for r in range(R)]  # replica 0's ranks are 0..R-1
        self.rank_of = [topo.pipe_rank(topo.rank(s)) for s in range(S)]
        self.norm_at: list[int] = []
        self.stats_at: list[int] = []
        for s in range(S):
            earlier = [e for e in per_rank[self.rank_of[s]] if e < s]
            self.norm_at.append(sum(param_counts[e] for e in earlier))
            self.stats_at.append(sum(stats_widths[e] for e in earlier))
        self.norm_width = max(sum(param_counts[s] for s in ss) for ss in per_rank)
        self.stats_width = max(sum(stats_widths[s] for s in ss) for ss in per_rank)


class StageUpdates:
    """Posts, applies and reports this process's updates (all of its stages'), in step order.

    Args:
        comm, delayed, owned: this rank's communication, delay engine and owned parameters
            (every stage of the process, first stage first).
        param_counts: number of owned parameters of every stage (the norm exchange's layout).
        router_layers: every stage's MoE (block, experts) layout ([] per stage when dense).
        grad_clip: max global gradient norm (0: no clipping).
        lr_multiplier, logs: the run's LR schedule and its log steps (router stats there).
        per_expert: whether router metrics are reported per expert.
        after_update: called with k after update k is applied (the tied owner's send).
    """

    def __init__(
        self,
        comm: Comm,
        delayed: DelayedOptimizer,
        owned: dict[str, torch.nn.Parameter],
        *,
        param_counts: list[int],
        router_layers: list[list[tuple[int, int]]],
        grad_clip: float,
        lr_multiplier: Callable[[int], float],
        logs: Callable[[int], bool],
        per_expert: bool,
    ) -> None:
        self.comm, self.delayed, self.owned = comm, delayed, owned
        self.param_counts, self.router_layers = param_counts, router_layers
        self.grad_clip, self.lr_multiplier, self.logs = grad_clip, lr_multiplier, logs
        self.per_expert = per_expert
        self.num_stages = len(param_counts)
        self._stats_widths = [raw_stats_width(layers) for layers in router_layers]
        self._at = _Layout(comm, param_counts, self._stats_widths)
        self._norm_width, self._stats_width = self._at.norm_width, self._at.stats_width
        self._own = list(comm.topo.stages_of(comm.rank))
        self._names = dict(zip(self._own, _split(owned, param_counts, self._own), strict=True))
        self._posted: deque[_Posted] = deque()
        self._logged: deque[tuple[int, float, Any, list[torch.Tensor]]] = deque()
        self.reports: deque[UpdateReport] = deque()  # applied, not yet taken by the engine
        self.exchanged = -1  # the newest step whose exchange completed (every process posted it)

    @property
    def pending(self) -> bool:
        return bool(self._posted)

    def post(
        self, step: int, grads: dict[str, torch.Tensor], loss: torch.Tensor, modules: list
    ) -> None:
        """Start the exchange update `step` needs (one update in flight at a time); `modules`
        are this process's stages, first stage first."""
        while self._posted:
            self.apply_next()
        if self.comm.dp_group is not None:
            self._all_reduce(grads, loss)
        device = loss.device
        # [per-parameter norms in the model's order (what clip_grad_norm_ stacks) |
        #  raw router sums | loss]
        vec = torch.zeros(self._norm_width + self._stats_width + 1, device=device)
        for s in self._own if self.grad_clip > 0 else ():
            # each stage's norms from its offset, in its parameters' order (a parameter
            # without a gradient is skipped, as clip_grad_norm_ skips it)
            names = [n for n in self._names[s] if n in grads]
            if names:
                norms = torch._foreach_norm([grads[n] for n in names], 2.0)
                lo = self._at.norm_at[s]
                vec[lo : lo + len(names)] = torch.stack([n.float() for n in norms])
        if self._stats_width and self.logs(step):
            for s, module in zip(self._own, modules, strict=True):
                _, raw = module.raw_router_stats(reset=True)
                lo = self._norm_width + self._at.stats_at[s]
                vec[lo : lo + raw.numel()] = raw.to(vec)
        vec[-1] = loss
        work, gathered = self.comm.all_gather(vec, f"the gradient-norm exchange of step {step}")
        self._posted.append(_Posted(step, work, gathered, grads))

    def _all_reduce(self, grads: dict[str, torch.Tensor], loss: torch.Tensor) -> None:
        names = [n for n in self.owned if n in grads]
        flat = torch.cat([grads[n].reshape(-1) for n in names] + [loss.reshape(1)])
        self.comm.all_reduce_mean(flat)
        off = 0
        for n in names:
            k = grads[n].numel()
            grads[n] = flat[off : off + k].view_as(grads[n]).clone()
            off += k
        loss.copy_(flat[-1])

    @torch.no_grad()
    def apply_next(self, live_in_use: bool = False) -> int:
        """Apply the oldest posted update (waits for the norm exchange if clipping); returns
        its step. `live_in_use`: stashed graphs still hold the live weights."""
        post = self._posted.popleft()
        k = post.step
        assert k == self.delayed.step_count, (k, self.delayed.step_count)
        grad_norm = math.nan
        for n, p in self.owned.items():
            p.grad = post.grads.get(n)
        if self.grad_clip > 0:
            self.comm.wait_work(post.work, f"the gradient-norm exchange of step {k}", None)
            at, g = self._at, post.gathered
            norms = torch.cat(  # the model's order: stage by stage
                [
                    g[at.rank_of[s]][at.norm_at[s] : at.norm_at[s] + c]
                    for s, c in enumerate(self.param_counts)
                ]
            )
            total = torch.linalg.vector_norm(norms, 2.0)
            grad_norm = total.item()
            params = [p for n, p in self.owned.items() if n in post.grads]
            torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, total)
        apply_lr(self.delayed.optimizer, self.lr_multiplier(k))
        lr = self.delayed.optimizer.param_groups[0]["lr"]
        # Graphs still waiting for their backward hold the live tensors: the update must go
        # to new storage so that it cannot reach them.
        self.delayed.step(live_in_use=live_in_use)
        self.delayed.zero_grad(set_to_none=True)
        if self.grad_clip > 0:
            self._report(k, post.gathered, grad_norm, lr)
        else:  # the loss exchange is waited for only when old enough not to stall the pipeline
            self._logged.append((k, lr, post.work, post.gathered))
            self.drain(all_=False)
        return k

    def drain(self, all_: bool) -> None:
        """Report steps whose exchange was not needed for the update (no clipping): all of
        them, or those old enough that waiting does not stall the pipeline."""
        while self._logged and (all_ or len(self._logged) > self.num_stages + 1):
            k, lr, work, gathered = self._logged.popleft()
            self.comm.wait_work(work, f"the loss exchange of step {k}", None)
            self._report(k, gathered, math.nan, lr)

    def _report(self, k: int, gathered: list[torch.Tensor], grad_norm: float, lr: float) -> None:
        self.exchanged = max(self.exchanged, k)
        router: dict[str, float] = {}
        if self._stats_width and self.logs(k):
            at, lo = self._at, self._norm_width
            raws = [
                gathered[at.rank_of[s]][lo + at.stats_at[s] : lo + at.stats_at[s] + w]
                for s, w in enumerate(self._stats_widths)
            ]
            layers = [layer for stage in self.router_layers for layer in stage]
            router = summarize_router_stats(layers, torch.cat(raws), per_expert=self.per_expert)
        # The step's loss: the last stage's, plus the other stages' auxiliary losses.
        # One copy to the host (not one per stage), then the same sum in the same order.
        loss = sum(torch.stack([g[-1] for g in gathered[::-1]]).tolist())
        self.reports.append(UpdateReport(k, loss, grad_norm, lr, router))


def _split(owned: dict[str, Any], param_counts: list[int], stages: list[int]) -> list[list[str]]:
    """The names of `owned` (stage by stage, first stage first) per stage in `stages`."""
    names, out, i = list(owned), [], 0
    for s in stages:
        out.append(names[i : i + param_counts[s]])
        i += param_counts[s]
    assert i == len(names), (i, len(names))
    return out


# ---- votes: agreeing on a step to checkpoint or stop at ----------------------------------

BITS = 8  # request bits voted on (peers.interrupts' STOP, CHECKPOINT, ...)


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
