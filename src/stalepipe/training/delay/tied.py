"""Tied embeddings across pipeline stages: the one rule both engines follow.

A tied model shares one matrix between its input embedding (`TIED_OWNER`, on the first stage)
and its output head (`TIED_HEAD`, on the last stage). The rule (docs/design.md, 'The delay
contract'):

- *one matrix*: the first stage owns it (it is among that stage's parameters, checkpoints and
  optimizer state) and updates it; the last stage only reads it (`models.PipelineStage.
  owned_parameters` leaves the head out of the last stage's parameters);
- *the stale version each end reads follows the delay schedule*: the first stage computes step
  k at its own version, the last stage at ITS version `schedule.version(P - 1, k)` of the same
  matrix (weight prediction with the last stage's tau: `read_version`), so the two ends never
  silently diverge; the versions the last stage reads are known to both sides without asking
  (`head_reads`, `head_floor`);
- *the gradient is the first stage's plus the last stage's*, in that order (`add_head_grad`,
  `combine_grads`): one sum, so one update, applied once by the owner.

Who calls it:
- `delay.emulator.DelayEmulator` (single process): `find_shared` discovers shared parameters
  of any stage modules by identity (`SharedUse`; `readers` tells `DelayedOptimizer` to keep the
  versions readers read); the exact and fast modes give each reading stage its own leaf at
  `read_version` and add its gradient with `add_head_grad`.
- `runtime.tied.TiedWeights` (multi-process, one per process): a thin transport over this
  module -- `tied_role` says which end a process holds, `head_reads` / `head_floor` which
  versions the last stage receives and keeps, `read_version` what it computes at, and
  `combine_grads` sums the gradients on the owner; it only moves tensors on the `tied_w` and
  `tied_grad` channels (`runtime.comm`). `runtime.stage.StageExecutor` calls the transport;
  `runtime.tied.resume_head` restores the head's copies from a checkpoint.
- checkpoints save the owner's matrix once: `aliases` names the head as the owner's tensor
  when a checkpoint is read whole (`rundir.checkpoint.load_checkpoint`) and when the head's
  process resumes (`train.pipelined`, which also reads the owner's keys).

Nothing else in the package decides anything about tying: the model builds the tie
(`models.transformer`) and names its two ends (`models.partition`); parameter counts
(`sim.timing`) and the HF export count the matrix once; the rest sees one tensor that may be
listed twice (optimizer groups, `models.partition`, the slow `delay.reference`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from stalepipe.training.delay.correctors import predict_weights
from stalepipe.training.delay.policies import DelaySchedule
from stalepipe.training.models.partition import TIED_HEAD, TIED_OWNER

__all__ = [
    "TIED_HEAD",
    "TIED_OWNER",
    "SharedUse",
    "add_head_grad",
    "aliases",
    "combine_grads",
    "find_shared",
    "find_shared_in",
    "head_floor",
    "head_reads",
    "read_version",
    "readers",
    "tied_role",
    "untied",
]

Scale = Callable[[int, int], float]  # (reading stage, step) -> weight prediction's c * tau


# ---- which stages -----------------------------------------------------------------------------


def tied_role(tied: bool, num_stages: int, stages: Iterable[int]) -> str | None:
    """Which end of a tied matrix a process running `stages` holds: "owner" (the first stage),
    "head" (the last stage), "both" (one process holds both, a V's rank 0), or None (untied,
    one stage, or neither end)."""
    if not tied or num_stages < 2:
        return None
    stages = set(stages)
    first, last = 0 in stages, num_stages - 1 in stages
    return "both" if first and last else "owner" if first else "head" if last else None


def aliases(tied: bool) -> dict[str, str]:
    """Model state_dict keys whose tensor is another key's: {head: owner} when tied."""
    return {TIED_HEAD: TIED_OWNER} if tied else {}


@dataclass
class SharedUse:
    """`module.<attr>` in stage `stage` reads parameter `param`, owned by stage `owner`."""

    param: nn.Parameter
    owner: int
    owner_index: int  # position of `param` in the owner's parameter list
    stage: int
    module: nn.Module
    attr: str


def find_shared(
    stages: Sequence[nn.Module],
) -> tuple[list[dict[str, nn.Parameter]], list[SharedUse]]:
    """Per stage, the parameters it owns (the first stage listing a parameter owns it), and
    every place a later stage reads a parameter owned by another (a tied head)."""
    return find_shared_in([stage.named_modules() for stage in stages])


def find_shared_in(
    stages: Sequence[Iterable[tuple[str, nn.Module]]],
) -> tuple[list[dict[str, nn.Parameter]], list[SharedUse]]:
    """`find_shared` over each stage's (name, module) pairs, in order: the modules a stage
    holds of a larger model, under their names in it (`delay.stages.split_stages`)."""
    owner: dict[int, tuple[int, int]] = {}
    owned: list[dict[str, nn.Parameter]] = []
    shared: list[SharedUse] = []
    for s, stage in enumerate(stages):
        mine: dict[str, nn.Parameter] = {}
        for mod_name, module in stage:
            for attr, p in module._parameters.items():
                if p is None:
                    continue
                if id(p) in owner:
                    o, idx = owner[id(p)]
                    if o != s:
                        shared.append(SharedUse(p, o, idx, s, module, attr))
                    continue
                owner[id(p)] = (s, len(mine))
                mine[f"{mod_name}.{attr}" if mod_name else attr] = p
        owned.append(mine)
    return owned, shared


def readers(shared: Iterable[SharedUse]) -> dict[int, set[int]]:
    """Owning stage -> the other stages that read its weights (`DelayedOptimizer`'s
    `shared_with`: the owner keeps the versions they read too)."""
    out: dict[int, set[int]] = {}
    for use in shared:
        out.setdefault(use.owner, set()).add(use.stage)
    return out


# ---- which version each end reads ------------------------------------------------------------


def read_version(at: Callable[[int], torch.Tensor], version: int, scale: float) -> torch.Tensor:
    """What the reading stage computes at: the matrix `at(version)`, or with weight prediction
    (`scale` = c * tau of the READING stage, non-zero) W_v + scale (W_v - W_{v-1}) as
    `DelayedOptimizer.read_weights` predicts the owner's own weights. A new tensor when
    predicted; read-only otherwise."""
    if not scale:
        return at(version)
    (w,) = predict_weights([at(version)], [at(version - 1)], scale)
    return w


def head_reads(
    delay: DelaySchedule,
    start: int,
    scale: Scale,
    evaluates: Callable[[int], bool] = lambda k: False,
) -> set[int]:
    """Every version of the matrix the last stage reads from step `start` on: those its steps
    read (and the one before each predicted one), those evaluations after step k read (k + 1
    when `evaluates(k)`), and the final one (both copies end equal)."""
    N, last = delay.total_steps, delay.num_stages - 1
    reads = {delay.version(last, k) for k in range(start, N)} | {N}
    reads |= {delay.version(last, k) - 1 for k in range(start, N) if scale(last, k)}
    return reads | {k + 1 for k in range(start, N) if evaluates(k)}


def head_floor(delay: DelaySchedule, step: int, newest: int, scale: Scale) -> int:
    """The oldest version the last stage still reads at `step` (the run's steps done: the
    `newest` version it holds); older ones can be forgotten."""
    N, last = delay.total_steps, delay.num_stages - 1
    floor = newest if step >= N else delay.version(last, step)
    # weight prediction: the version before any read from here on (a sync start's end reads
    # an older one again)
    for j in range(step, min(N, step + delay.max_tau[last] + 2)):
        if scale(last, j):
            floor = min(floor, delay.version(last, j) - 1)
    return floor


@contextlib.contextmanager
def untied(
    uses: Sequence[SharedUse], read: Callable[[SharedUse], torch.Tensor]
) -> Iterator[list[nn.Parameter]]:
    """Within the block each reading stage's slot (`use.module.<use.attr>`) holds a leaf of
    its own at `read(use)`, the weights that stage computes at (`DelayedOptimizer.
    read_shared`); yields the leaves, whose gradients the caller adds to the owner's with
    `add_head_grad` (first stage's, then the reader's). The shared parameter is back after."""
    copies = []
    for u in uses:
        copy = nn.Parameter(read(u), requires_grad=u.param.requires_grad)
        u.module._parameters[u.attr] = copy
        copies.append(copy)
    try:
        yield copies
    finally:
        for u in uses:
            u.module._parameters[u.attr] = u.param


# ---- the one gradient --------------------------------------------------------------------------


def add_head_grad(owner: torch.Tensor | None, head: torch.Tensor | None) -> torch.Tensor | None:
    """The tied matrix's gradient: the first stage's, then the last stage's added to it."""
    if head is None:
        return owner
    return head if owner is None else owner + head


def combine_grads(grads: dict[str, torch.Tensor], head: torch.Tensor | None = None) -> None:
    """Fold the head's gradient (`head`, else `grads[TIED_HEAD]`) into the owner's, in place."""
    if head is None:
        head = grads.pop(TIED_HEAD, None)
    if head is not None:
        summed = add_head_grad(grads.get(TIED_OWNER), head)
        assert summed is not None  # a head's gradient makes a sum
        grads[TIED_OWNER] = summed
