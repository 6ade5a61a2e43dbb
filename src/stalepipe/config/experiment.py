"""`ExperimentConfig`: the sections composed into one run, and the rules that join them.

Besides values out of range, a config refuses settings the run would ignore (docs/design.md,
'Style', rule 12): a pipeline schedule or replica count under the emulator, a delay policy or
mitigation that has no delay to act on, a cooldown that another field overrides. Each refusal names
the setting and the changes that fix it; the fixes offered are tried first, so every one of them
validates. Run records (a checkpoint's config, a config.json read back) load with `from_dict(d,
strict=False)`, which skips only these rules: an old run made with such a setting still loads for
eval, export and as the base of `--config`, and the setting is refused once something changes it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import InitVar, dataclass, field
from typing import Any

from stalepipe.config import sections
from stalepipe.config.base import ConfigError, check, multiples_near, option
from stalepipe.config.delay import DelayConfig
from stalepipe.config.limits import check_name, check_numbers
from stalepipe.config.overrides import (
    apply_overrides,
    as_dict,
    default_of,
    from_dict,
    upgrade_record,
)
from stalepipe.config.registry import (
    CORRECTORS,
    DELAY_POLICIES,
    LR_SCHEDULES,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    with_decay_phase,
)
from stalepipe.config.sections import DEFAULT_SCHEDULE, ModelConfig, PipelineConfig, TrainConfig

Fix = dict[str, Any]  # dotted key -> new value


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """Everything one run needs. `name` is the run directory under `out_dir`."""

    name: str = option("run", "run name: results go to <out_dir>/<name>")
    out_dir: str = option("runs", "parent directory of run directories")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: sections.DataConfig = field(default_factory=sections.DataConfig)
    optim: sections.OptimConfig = field(default_factory=sections.OptimConfig)
    delay: DelayConfig = field(default_factory=DelayConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: sections.LogConfig = field(default_factory=sections.LogConfig)
    # Not a field: False lets settings the run would ignore through (run records, `from_dict(
    # strict=False)`, and the candidates `_validates` tries); `dataclasses.replace` gives True.
    check_ignored: InitVar[bool] = True

    def __post_init__(self, check_ignored: bool) -> None:
        self._check_name_and_numbers()
        self._check_partition()
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
        if check_ignored:
            self._refuse_ignored()

    def _check_partition(self) -> None:
        """Explicit blocks per stage: one count per stage, adding up to the model's blocks."""
        part, P, L = self.pipeline.partition, self.pipeline.num_stages, self.model.num_layers
        if part in ("balanced", "uniform"):
            return
        counts = [int(c) for c in part.split(",")]
        check(
            len(counts) == P and sum(counts) == L,
            f"pipeline.partition {part} needs {P} counts (pipeline.num_stages) adding up to "
            f"model.num_layers={L}",
        )

    def _check_name_and_numbers(self) -> None:
        """The limits every value passes (config/limits.py): a run name that is one safe
        directory name, finite floats, counts no run reaches."""
        from stalepipe.fileio import flatten_dict

        check_name(self.name)
        check_numbers(flatten_dict(self.to_dict()), lambda key: default_of(type(self), key))

    def _check_delay(self) -> None:
        """Rules of the delay config that depend on the pipeline and the training loop."""
        P, L = self.pipeline.num_stages, self.model.num_layers
        policy = DELAY_POLICIES.get(self.delay.policy)  # fixed:N: a family, no stage rule
        refused = _stage_rule_refuses(policy, P) if policy else ""
        if refused:  # the policy's own rule on the stage count (wpipe's even one)
            near = [p for p in (P - 1, P + 1) if 1 <= p <= L and not _stage_rule_refuses(policy, p)]
            fix = f"set pipeline.num_stages to {' or '.join(map(str, near))}" if near else ""
            fix = fix or "it needs more model.num_layers"
            raise ConfigError(f"{refused}; {fix}")
        if self.delay.adaptive_momentum:
            tau = _max_tau(self.delay.policy, P)
            check(
                tau <= P,
                f"delay.adaptive_momentum's mu + tau_s (0.99 - mu) / P passes 0.99 when tau_s > "
                f"pipeline.num_stages; delay.policy {self.delay.policy} has tau {tau} > {P}: set "
                f"delay.policy to fixed:{P} or less",
            )
        if self.delay.sync_cooldown_wsd:
            check(
                LR_SCHEDULES[self.train.lr_schedule].decay_steps is not None,
                f"delay.sync_cooldown_wsd aligns the cooldown with WSD's decay phase, but "
                f"train.lr_schedule is {self.train.lr_schedule!r}; set train.lr_schedule to "
                f"{' or '.join(with_decay_phase())}, or delay.sync_cooldown_wsd to false and the "
                f"cooldown in delay.sync_cooldown",
            )

    def _check_distributed(self) -> None:
        """Rules of the distributed engine (pipeline.engine distributed) alone."""
        pc, tc = self.pipeline, self.train
        P, m, B, D = pc.num_stages, tc.num_microbatches, tc.batch_size, pc.num_replicas
        check(
            B % (m * D) == 0,
            f"train.batch_size ({B}) must be divisible by train.num_microbatches x "
            f"pipeline.num_replicas ({m} x {D}); set train.batch_size to "
            f"{multiples_near(B, m * D)}",
        )
        why = PIPELINE_SCHEDULES[pc.schedule].size_rule(P, pc.num_ranks, m, B, D)
        if why:  # the schedule's own rule on its microbatches (`ScheduleSpec.size_rule`)
            raise ConfigError(why)

    # ---- settings the run would ignore (docs/design.md, 'Style', rule 12) ---------------------

    def _ignored(self) -> Iterator[tuple[str, str, list[Fix]]]:
        """Each setting this run would ignore: (its key, why, the fixes to offer, best first)."""
        pc, dc = self.pipeline, self.delay
        if pc.engine == "emulate" and pc.schedule != DEFAULT_SCHEDULE:
            want = PIPELINE_SCHEDULES[pc.schedule].policy
            why = (
                f"pipeline.schedule {pc.schedule} is run only by the distributed engine; the "
                f"emulator (pipeline.engine emulate) ignores it and takes the delay from "
                f"delay.policy ({dc.policy})"
            )
            plain: Fix = {"pipeline.schedule": DEFAULT_SCHEDULE}
            if pc.num_chunks != 1:  # chunks are read by interleaved-1f1b alone
                plain["pipeline.num_chunks"] = 1
            if want == dc.policy:
                fixes = [plain, {"pipeline.engine": "distributed"}]
            else:
                fixes = [
                    {"delay.policy": want, **plain},
                    {"pipeline.engine": "distributed", "delay.policy": want},
                ]
            yield "pipeline.schedule", why, fixes
        if pc.engine == "emulate" and pc.num_replicas > 1:
            why = (
                f"pipeline.num_replicas {pc.num_replicas} is read only by the distributed "
                f"engine; the emulator's data-parallel replicas are the processes torchrun starts "
                f"(torchrun -m stalepipe train, docs/runtime.md)"
            )
            fixes = [{"pipeline.num_replicas": 1}, {"pipeline.engine": "distributed"}]
            yield "pipeline.num_replicas", why, fixes
        if pc.engine == "distributed" and self.train.device.startswith("cuda:"):
            why = (
                f"train.device {self.train.device}: the distributed engine puts each process on "
                f"the GPU of its local rank (cuda:0, cuda:1, ...) and ignores the index"
            )
            yield "train.device", why, [{"train.device": "cuda"}]
        yield from self._ignored_compile()
        if dc.sync_cooldown_wsd and dc.sync_cooldown:
            why = (
                f"delay.sync_cooldown ({dc.sync_cooldown:g}) is overridden by "
                f"delay.sync_cooldown_wsd, which makes the cooldown WSD's decay phase "
                f"(train.decay_frac {self.train.decay_frac:g} of the steps)"
            )
            fixes = [{"delay.sync_cooldown": 0}, {"delay.sync_cooldown_wsd": False}]
            yield "delay.sync_cooldown", why, fixes
        yield from self._ignored_delay()
        if self.log.staleness and self.pipeline.engine == "distributed":
            why = "log.staleness is measured by the emulator engine only (train/staleness.py)"
            yield "log.staleness", why, [{"log.staleness": False}, {"pipeline.engine": "emulate"}]
        if self.train.final_eval_full and self.pipeline.engine == "distributed":
            why = (
                "train.final_eval_full runs on the emulator engine (the runtime evaluates its "
                "periodic batches only); score a runtime run's checkpoint with `stalepipe eval "
                "RUN --full-split`"
            )
            yield "train.final_eval_full", why, [{"train.final_eval_full": False}]

    def _ignored_compile(self) -> Iterator[tuple[str, str, list[Fix]]]:
        """train.compile compiles each transformer block (`models.compile_blocks`), on both
        engines; the runtime's split backward (BI apart from BW) cannot split a compiled
        block's one backward graph."""
        pc = self.pipeline
        if not (self.train.compile and pc.engine == "distributed"):
            return
        if PIPELINE_SCHEDULES[pc.schedule].splits_backward:
            why = (
                f"train.compile with pipeline.schedule {pc.schedule}: its backward runs as BI and "
                f"BW apart, which a compiled block's one backward graph cannot"
            )
            yield "train.compile", why, [{"train.compile": False}, {"pipeline.schedule": "1f1b"}]

    def _ignored_delay(self) -> Iterator[tuple[str, str, list[Fix]]]:
        """A delay policy without delay at this stage count, and mitigations with no delay."""
        dc, P = self.delay, self.pipeline.num_stages
        # asked of each policy's bound, not of its name: sync and fixed:0 never delay, and
        # PipeDream has no delay on one stage
        never = all(_max_tau(dc.policy, p) == 0 for p in (2, 4, 8))
        if not never and _max_tau(dc.policy, P) == 0:
            why = (
                f"delay.policy {dc.policy} has no delay at pipeline.num_stages {P} (its "
                "staleness is 0 on every stage at this depth: PipeDream's P-1-s on one stage)"
            )
            fixes = [{"pipeline.num_stages": P + 1}, {"delay.policy": "sync"}]
            yield "delay.policy", why, fixes
        if never:  # each registered corrector that needs a delay (config/registry.py)
            for _, spec in CORRECTORS.items():
                if spec.needs_delay and spec.on(dc):
                    key = f"delay.{spec.switch}"
                    why = f"{key} mitigates a delay, but delay.policy {dc.policy} has none"
                    off = spec.fields[spec.switch]
                    yield key, why, [{key: off}, {"delay.policy": "2bw"}]
        elif dc.lr_correction_steps and _max_tau(dc.policy, P) == 1:
            why = (
                f"delay.lr_correction_steps: PipeMare's factor tau^-(1 - min(k/K, 1)) is 1 at "
                f"tau <= 1, the most delay.policy {dc.policy} has at pipeline.num_stages {P}"
            )
            fixes = [{"delay.lr_correction_steps": 0}, {"delay.policy": "fixed:2"}]
            yield "delay.lr_correction_steps", why, fixes
        # at mu = 0.99, mu + tau (0.99 - mu) / P = mu (muon and mars also have an AdamW part at
        # beta1 0.9, which it moves); NAdamW's default beta1 is 0.99 (optim/specs.py)
        composite = OPTIMIZERS[self.optim.name].composite
        if dc.adaptive_momentum and self.optim.beta1 == 0.99 and not composite:
            why = (
                "delay.adaptive_momentum sets mu_s = mu + tau_s (0.99 - mu) / P, which is mu at "
                "optim.beta1 0.99"
            )
            fixes = [{"optim.beta1": 0.9}, {"delay.adaptive_momentum": False}]
            yield "delay.adaptive_momentum", why, fixes
        if dc.taylor_adaptive and dc.taylor == 0:
            why = "delay.taylor_adaptive scales delay.taylor (lambda_0), which is 0 (off)"
            yield "delay.taylor", why, [{"delay.taylor": 0.1}, {"delay.taylor_adaptive": False}]

    def _refuse_ignored(self) -> None:
        """Raise for the first ignored setting, offering the fixes that validate."""
        for key, why, fixes in self._ignored():
            working = [f for f in fixes if self._validates(f)]
            working = working or [{key: default_of(type(self), key)}]
            raise ConfigError(f"{why}; set {', or '.join(map(_describe, working))}")

    def _validates(self, fix: Fix) -> bool:
        """Whether `fix` gives a config that validates and ignores no setting (its own ignored
        settings are listed, not refused, so a candidate never tries fixes in turn)."""
        overrides = {k: _text(v) for k, v in fix.items()}
        try:
            candidate = apply_overrides(self, overrides, check_ignored=False)
        except ConfigError:
            return False
        return next(candidate._ignored(), None) is None

    def warnings(self) -> list[str]:
        """Settings that are legal but probably not meant, one line each (`train` prints them).

        Warmup as long as the run is one: a short smoke run of a preset (`--train.num_steps 10`)
        is legitimate, so it warns instead of refusing."""
        tc = self.train
        out = []
        if tc.compile and self.model.num_experts > 0:
            out.append(
                "train.compile with MoE layers: each layer's dispatch breaks the graph (its "
                "expert group sizes depend on the data) and costs a host sync, so the compiled "
                "model is barely faster than eager after a long compile (docs/benchmarks.md, GPU "
                "check)"
            )
        if tc.warmup_steps < tc.num_steps:
            return out
        return out + [
            f"train.warmup_steps ({tc.warmup_steps}) >= train.num_steps ({tc.num_steps}): the LR rises "
            f"for the whole run and never reaches its peak (the {tc.lr_schedule} schedule after "
            f"the warmup never runs); set train.warmup_steps to {tc.num_steps // 10}, or fewer than "
            f"{tc.num_steps}"
        ]

    # ---- serialisation -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The config as nested dicts, every section's declared settings among its fields."""
        return as_dict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, strict: bool = True) -> ExperimentConfig:
        """The config of a parsed config.json. `strict=False` is for run records (a checkpoint's
        or an old run's config): settings a new run would ignore are let through (module
        docstring); every other rule still applies."""
        return from_dict(cls, upgrade_record(d), check_ignored=strict)


def _stage_rule_refuses(policy: Any, num_stages: int) -> str:
    """Why a registered delay policy's own rule refuses `num_stages` ("" when it takes it)."""
    try:
        policy.stage_rule(num_stages)
    except ConfigError as e:
        return str(e)
    return ""


def _max_tau(policy: str, num_stages: int) -> int:
    """The largest staleness `policy` gives a stage (delay/policies.py defines each one)."""
    if policy.startswith("fixed:"):
        return int(policy.removeprefix("fixed:"))
    bound = DELAY_POLICIES[policy].max_tau
    return max(bound(s, num_stages) for s in range(num_stages))


def _text(value: Any) -> str:
    """A value as an override string (`apply_overrides` parses it back)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _describe(fix: Fix) -> str:
    return " and ".join(f"{k} to {_text(v)}" for k, v in fix.items())
