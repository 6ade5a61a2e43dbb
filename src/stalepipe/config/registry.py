"""One registry per kind of component: optimizers, delay policies, pipeline schedules, LR
schedules, correctors.

Each component states its facts (its name, the config fields it reads, its defaults, the delay
policy a schedule realises, how many stages a process runs, ...) next to its code and registers
them here; the config sections validate against these registries and list no names themselves.
Iterating a registry gives the names in registration order (the order of help texts and
"choose from" lists).

Why the registries live in the config room (layer 0) and how they fill before a config is
validated: the config must check `optim.name` without importing the rooms above it (the import
order of docs/design.md, 'Architecture') and without importing torch (`stalepipe train --help`
stays fast; a test). So every spec is torch-free: an optimizer's spec is data plus a builder that
imports its torch code when called (`optim/specs.py`), a delay policy is a few pure functions
(`delay/policies.py`), a pipeline schedule's generator is pure Python
(`schedules/generators.py`), an LR schedule is a pure function (`optim/lr_schedule.py`). The
package root (`stalepipe/__init__.py`) imports those modules, so the registries are full before
any `stalepipe.*` module runs a line; a component defined elsewhere (a plugin, a test) registers
itself when it is imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from stalepipe.config.base import Setting, unknown_choice

S = TypeVar("S")


class Registry(Generic[S]):
    """Specs of one kind by name (each spec has a `name`), in registration order."""

    def __init__(self, kind: str, key: str) -> None:
        self.kind = kind  # 'optimizer', as the error messages say it
        self.key = key  # the config field that names one, e.g. 'optim.name'
        self._specs: dict[str, S] = {}

    def register(self, spec: S) -> S:
        """Add `spec`; a second spec under the same name, or a setting declared twice
        differently (`settings`), is a programming error."""
        name = spec.name  # type: ignore[attr-defined]
        if name in self._specs:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        known = self.settings()
        for s in getattr(spec, "settings", ()):
            if known.get(s.name, s) != s:
                raise ValueError(f"{self.kind} {name!r} declares setting {s.name!r} differently")
        self._specs[name] = spec
        return spec

    def settings(self) -> dict[str, Setting]:
        """The settings the specs declare for their config section (`spec.settings`), by name,
        in registration order (one shared by two specs, like muon's and mars's adam_lr, once)."""
        out: dict[str, Setting] = {}
        for spec in self._specs.values():
            for s in getattr(spec, "settings", ()):
                out.setdefault(s.name, s)
        return out

    def unregister(self, name: str) -> None:
        """Remove `name` (a test that registered a component cleans up with this)."""
        del self._specs[name]

    def __getitem__(self, name: str) -> S:
        """The spec of `name`; ConfigError listing the names (and the closest) otherwise."""
        if name not in self._specs:
            raise unknown_choice(self.kind, name, self._specs, key=self.key)
        return self._specs[name]

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def get(self, name: str) -> S | None:
        """The spec of `name`, or None when none is registered (a family such as fixed:N)."""
        return self._specs.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._specs))

    def __len__(self) -> int:
        return len(self._specs)

    def items(self) -> list[tuple[str, S]]:
        return list(self._specs.items())

    def choices(self, sep: str = " | ") -> str:
        """The names joined by `sep`, for a help text."""
        return sep.join(self._specs)


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """What the config and the optimizer registry need of one optimizer.

    `reads`: the `OptimConfig` fields it reads of those every optimizer shares (lr, beta1,
    beta2, eps, weight_decay); `settings`: its own hyperparameters (`Setting`: name, type, help,
    range), which `OptimConfig` holds beside the shared fields (`--optim.<name>`, config files,
    config.json, `--help`) and which it reads too (appended to `reads`; a value in a field it
    does not read is refused); `defaults`: the value of each field read when the config leaves
    it `None`; `fixed`: fields it does not let a config change but records at the value it uses;
    `finish`: a last step of `optim.resolve_config` for defaults that depend on other fields
    (muon); `composite`: it runs an AdamW part of fixed betas beside its own rule (muon, mars);
    `build(cfg, split)`: the `torch.optim.Optimizer` over a `ParamSplit`, for a resolved `cfg`
    (imports torch when called).
    """

    name: str
    reads: tuple[str, ...]
    defaults: dict[str, Any]
    build: Callable[[Any, Any], Any]
    settings: tuple[Setting, ...] = ()
    fixed: dict[str, Any] = field(default_factory=dict)
    finish: Callable[[Any], Any] | None = None
    composite: bool = False

    def __post_init__(self) -> None:
        own = tuple(s.name for s in self.settings if s.name not in self.reads)
        object.__setattr__(self, "reads", (*self.reads, *own))


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """What the config, the simulator and the runtime need of one pipeline schedule.

    `policy`: the delay policy it realises (the runtime refuses a `delay.policy` that differs);
    `generate(delay, num_microbatches, num_chunks=...)`: its `Schedule`; `chunks`: the stages each
    process runs on the runtime (`pipeline.num_chunks`; None = any count >= 2); `rank_stages`:
    stages per rank of the generated schedule when that differs from `chunks` (wpipe's two
    groups); `placement`: 'v' puts rank r's stages at r and 2R-1-r; `runtime`: the distributed
    engine runs it (every schedule so far: the runtime runs every schedule the simulator times);
    `sizes`: its own rule on the microbatch count (interleaved 1F1B's groups, DualPipeV's and
    2BW's minimum); `cluster`: the cluster model compares it; `splits_backward`: its backward
    runs as BI and BW apart (zero-bubble schedules).
    """

    name: str
    policy: str
    generate: Callable[..., Any]
    chunks: int | None = 1
    rank_stages: int | None = None
    placement: str = "interleaved"
    runtime: bool = True
    # an asynchronous schedule's order with a flush at every step: the synchronous schedule a
    # sync window (`delay.sync_start` / `sync_cooldown`) runs it as ("" for a synchronous one)
    flushed: str = ""
    # its rule on the microbatch count on the distributed engine: (P, processes, m, batch,
    # replicas) -> why the sizes are refused, with the fix ("" when they are fine)
    sizes: Callable[[int, int, int, int, int], str] | None = None
    # the verdict's cluster model compares it (`sim.parallel`): False for a schedule another
    # one dominates there (GPipe: 1F1B's time with more memory) or whose delay is not comparable
    # across P (WPipe: docs/verdict.md)
    cluster: bool = True
    splits_backward: bool = False

    def size_rule(self, stages: int, ranks: int, m: int, batch: int, replicas: int) -> str:
        """Why the distributed engine refuses these sizes for this schedule ("" if it runs)."""
        return self.sizes(stages, ranks, m, batch, replicas) if self.sizes else ""

    def stages_per_rank(self, num_chunks: int) -> int:
        """Stages on each rank of the generated schedule (`num_chunks` when any count goes)."""
        return self.rank_stages or self.chunks or num_chunks


@dataclass(frozen=True, kw_only=True)
class LRScheduleSpec:
    """What the training loop and the config need of one LR schedule (`train.lr_schedule`).

    `multiplier(step, train)`: the multiplier of the peak LR at a step past the warmup, a pure
    function of the step and the `TrainConfig` (`optim.lr_schedule.lr_multiplier` runs the
    linear warmup first, the same for every schedule); `decay_steps(train)`: the length in steps
    of its final decay phase, for a schedule that has one (WSD: what `delay.sync_cooldown_wsd`
    makes the synchronous cooldown).
    """

    name: str
    multiplier: Callable[[int, Any], float]
    decay_steps: Callable[[Any], int] | None = None


@dataclass(frozen=True, kw_only=True)
class CorrectorSpec:
    """What the config, the sweeps and the reports need of one mitigation or corrector of the
    delay (docs/design.md, 'The delay contract'), and where `DelayedOptimizer.step` runs it.

    `fields`: its settings in the delay section at their values when it is off, the first one
    its switch (any other value turns it on); a run with all of them off is its unmitigated
    counterpart in a report. `tuning`: delay settings that only tune it once on (runs that
    differ in them alone are one configuration). `settings`: the settings it declares in the
    delay section (`Setting`), for a corrector registered outside config/delay.py; its `fields`
    are then those at their defaults. `needs_delay`: it does nothing under a policy without
    delay, which refuses it (EF is the exception: it perturbs the updates there, with a
    warning). `apply(delay_cfg, params, taus, step)`: a registered corrector's stateless,
    in-place step on each stage's parameters, run by `DelayedOptimizer.step` in its `phase`:
    'gradient' on the stale gradients before the base optimizer's step, 'update' after that
    step (and EF); None for the built-in ones, which are `DelayedOptimizer`'s own phases.
    """

    name: str
    fields: dict[str, Any] = field(default_factory=dict)
    tuning: tuple[str, ...] = ()
    settings: tuple[Setting, ...] = ()
    needs_delay: bool = True
    phase: str = "gradient"
    apply: Callable[[Any, Any, list[int], int], None] | None = None

    def __post_init__(self) -> None:
        if not self.fields:
            object.__setattr__(self, "fields", {s.name: s.default for s in self.settings})
        assert self.fields, f"corrector {self.name} has no setting"
        assert self.phase in ("gradient", "update"), self.phase

    @property
    def switch(self) -> str:
        """The delay setting that turns it on."""
        return next(iter(self.fields))

    def on(self, delay_cfg: Any) -> bool:
        """Whether the `DelayConfig` turns it on."""
        return getattr(delay_cfg, self.switch) != self.fields[self.switch]


OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer", "optim.name")
# Specs of type `delay.policies.Policy` (name, tau, max_tau, stage_rule); `fixed:N` is a family
# parsed by `delay.policies.parse_policy`, not a registered name.
DELAY_POLICIES: Registry[Any] = Registry("delay policy", "delay.policy")
PIPELINE_SCHEDULES: Registry[ScheduleSpec] = Registry("pipeline schedule", "pipeline.schedule")
LR_SCHEDULES: Registry[LRScheduleSpec] = Registry("LR schedule", "train.lr_schedule")
# The mitigations and correctors: the built-in ones register in config/delay.py beside their
# fields, in the order reports list them.
CORRECTORS: Registry[CorrectorSpec] = Registry("corrector", "delay")


def with_decay_phase() -> list[str]:
    """The LR schedules with a final decay phase (`LRScheduleSpec.decay_steps`): those a
    synchronous cooldown can be aligned with (`delay.sync_cooldown_wsd`)."""
    return [name for name, spec in LR_SCHEDULES.items() if spec.decay_steps is not None]


def register_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    """Register an optimizer (`stalepipe train --optim.name <spec.name>` then builds it)."""
    return OPTIMIZERS.register(spec)


def resolve_config(cfg: Any) -> Any:
    """`cfg` (an `OptimConfig`) with every `None` field the optimizer reads replaced by its
    default, and the fields it fixes (`OptimizerSpec.fixed`) at their values: what the run's
    config.json records. Torch-free (`stalepipe.training.optim.resolve_config` is this function)."""
    spec = OPTIMIZERS[cfg.name]
    defaults = {**spec.defaults, **spec.fixed}
    out = dataclasses.replace(cfg, **{f: v for f, v in defaults.items() if getattr(cfg, f) is None})
    return spec.finish(out) if spec.finish else out
