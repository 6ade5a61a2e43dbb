"""From per-rank op lists to a `PipelineSchedule`: the step every generator ends with.

A generator (`schedules.generators`, `schedules.vshape`) decides only the order of work on each
rank, as ops `(kind, stage, step, microbatch)`; `build_schedule` attaches the weight version
every op reads from the run's `DelaySchedule` (docs/design.md, 'The delay contract'), so no
generator can get a version wrong by itself, and `validate` checks the rest.
"""

from __future__ import annotations

import functools

from stalepipe.config import ConfigError
from stalepipe.training.delay.policies import DelaySchedule
from stalepipe.training.schedules.schedule import Action, PipelineSchedule

Op = tuple[str, int, int, int]  # an action before its version is filled in: a schedule Key


def check_sizes(delay: DelaySchedule, num_microbatches: int, num_chunks: int = 1) -> int:
    """The number of ranks of a schedule of `delay.num_stages` stages in `num_chunks` chunks;
    refuses fewer than one microbatch."""
    if num_microbatches < 1:
        raise ConfigError(f"--microbatches must be >= 1, got {num_microbatches}")
    assert delay.num_stages % num_chunks == 0, (delay.num_stages, num_chunks)
    return delay.num_stages // num_chunks


def build_schedule(
    name: str,
    delay: DelaySchedule,
    num_chunks: int,
    num_microbatches: int,
    orders: list[list[Op]],
    placement: str = "interleaved",
) -> PipelineSchedule:
    """The schedule whose rank r runs `orders[r]`, each op with the version `delay` gives it."""
    ver = functools.cache(delay.version)
    ranks = tuple(
        tuple(
            Action.step_of(s, k) if kd == "STEP" else Action(kd, s, k, j, reads=ver(s, k))
            for kd, s, k, j in ops
        )
        for ops in orders
    )
    return PipelineSchedule(
        name=name,
        num_ranks=len(orders),
        num_chunks=num_chunks,
        num_microbatches=num_microbatches,
        num_steps=delay.total_steps,
        delay=delay,
        ranks=ranks,
        placement=placement,
    )
