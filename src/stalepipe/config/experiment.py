"""`ExperimentConfig`: the sections composed into one run, and the rules that join them."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from stalepipe.config.base import ConfigError, check, multiples_near, option
from stalepipe.config.overrides import from_dict
from stalepipe.config.sections import (
    DataConfig,
    DelayConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
)


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """Everything one run needs. `name` is the run directory under `out_dir`."""

    name: str = option("run", "run name: results go to <out_dir>/<name>")
    out_dir: str = option("runs", "parent directory of run directories")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    delay: DelayConfig = field(default_factory=DelayConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        check(
            bool(self.name) and "/" not in self.name,
            f"name must be a non-empty directory name without '/', got {self.name!r}",
        )
        check(
            self.pipeline.num_stages <= self.model.num_layers,
            f"pipeline.num_stages ({self.pipeline.num_stages}) must be <= model.num_layers "
            f"({self.model.num_layers})",
        )
        check(
            self.data.seq_len <= self.model.max_seq_len,
            f"data.seq_len ({self.data.seq_len}) must be <= model.max_seq_len "
            f"({self.model.max_seq_len})",
        )
        self._check_delay()
        if self.pipeline.engine == "distributed":
            self._check_distributed()

    def _check_delay(self) -> None:
        """Rules of the delay config that depend on the pipeline and the training loop."""
        P, L = self.pipeline.num_stages, self.model.num_layers
        if self.delay.policy == "wpipe":
            even = [p for p in (P - 1, P + 1) if 2 <= p <= L and p % 2 == 0]
            fix = (
                f"set pipeline.num_stages to {' or '.join(map(str, even))}"
                if even
                else "it needs model.num_layers >= 2"
            )
            check(
                P % 2 == 0,
                f"delay.policy wpipe needs an even pipeline.num_stages (WPipe splits the model "
                f"into two equal groups of stages, two per worker), got {P}; {fix}",
            )
        if self.delay.sync_cooldown_wsd:
            check(
                self.train.lr_schedule == "wsd",
                f"delay.sync_cooldown_wsd aligns the cooldown with WSD's decay phase, but "
                f"train.lr_schedule is {self.train.lr_schedule!r}; set train.lr_schedule to wsd, "
                f"or delay.sync_cooldown_wsd to false and the cooldown in delay.sync_cooldown",
            )

    def _check_distributed(self) -> None:
        """Rules of the distributed engine (pipeline.engine distributed) alone."""
        pc, tc = self.pipeline, self.train
        P, m, B, D = pc.num_stages, tc.num_microbatches, tc.batch_size, pc.data_parallel
        check(
            B % (m * D) == 0,
            f"train.batch_size ({B}) must be divisible by train.num_microbatches x "
            f"pipeline.data_parallel ({m} x {D}); set train.batch_size to "
            f"{multiples_near(B, m * D)}",
        )
        if pc.schedule == "2bw" and m < P - 1:
            # the fix: the smallest count that works with this batch, or fewer stages
            ok = [n for n in range(P - 1, B // D + 1) if B % (n * D) == 0]
            more = f"train.num_microbatches to {ok[0]} or " if ok else ""
            raise ConfigError(
                f"pipeline.schedule 2bw needs train.num_microbatches >= pipeline.num_stages - 1 "
                f"= {P - 1} (a forward would need weights not yet updated), got {m}; "
                f"set {more}pipeline.num_stages to {m + 1}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExperimentConfig:
        return from_dict(cls, d)
