"""Where each process of the pipeline runtime sits: which stages it runs, in which replica.

The one map from stages to processes, used by the communication (`runtime.comm`), the
update exchange (`runtime.stage_update`) and the launcher; `pipeline.schedule.stage_rank`
gives the placement.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from stalepipe.training.schedules.schedule import PLACEMENTS, stage_rank


@dataclass(frozen=True)
class Topology:
    """Where each rank sits: P pipeline stages, `num_chunks` of them per process, placed as
    `pipeline.schedule.stage_rank` says ("interleaved": pipeline rank r holds stages r, r + R,
    ...; "v": r and 2R-1-r), times D data-parallel replicas. R = P / num_chunks processes per
    replica; without chunks a rank's stage is its pipeline rank."""

    num_stages: int
    num_replicas: int = 1
    num_chunks: int = 1
    placement: str = "interleaved"

    def __post_init__(self) -> None:
        assert self.num_stages % self.num_chunks == 0, (self.num_stages, self.num_chunks)
        assert self.placement in PLACEMENTS, self.placement

    @classmethod
    def of(cls, pipeline: Any) -> Topology:
        """The topology of a run's `config.PipelineConfig`."""
        p = pipeline
        return cls(p.num_stages, p.num_replicas, p.num_chunks, p.placement)

    @property
    def num_ranks(self) -> int:
        """Processes per replica's pipeline (R)."""
        return self.num_stages // self.num_chunks

    @property
    def world_size(self) -> int:
        return self.num_ranks * self.num_replicas

    def rank(self, stage: int, replica: int = 0) -> int:
        """The torch.distributed rank that runs `stage` of `replica`."""
        assert 0 <= stage < self.num_stages and 0 <= replica < self.num_replicas
        return replica * self.num_ranks + stage_rank(self.placement, stage, self.num_ranks)

    def pipe_rank(self, rank: int) -> int:
        """`rank`'s place in its replica's pipeline, 0..R-1 (its row of a schedule)."""
        return rank % self.num_ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` runs, first stage first."""
        r, R = self.pipe_rank(rank), self.num_ranks
        return tuple(s for s in range(self.num_stages) if stage_rank(self.placement, s, R) == r)

    def stage_of(self, rank: int) -> int:
        """The first stage `rank` runs (its only one without chunks)."""
        return self.pipe_rank(rank)

    def replica_of(self, rank: int) -> int:
        return rank // self.num_ranks

    def describe(self, rank: int) -> str:
        stages, d = self.stages_of(rank), self.replica_of(rank)
        where = f"stage {stages[0]}" if len(stages) == 1 else f"stages {_listed(stages)}"
        return f"rank {rank} ({where}" + (f", replica {d})" if self.num_replicas > 1 else ")")


def _listed(items) -> str:
    return ", ".join(map(str, items))


def under_torchrun() -> bool:
    """True when torchrun (or another env:// launcher, `launch.train.launch_train` included)
    started this process: RANK and WORLD_SIZE are set. The one test for it in stalepipe (here,
    where the command line reads it without importing torch)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
