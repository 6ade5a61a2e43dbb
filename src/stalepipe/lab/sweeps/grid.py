"""Sweep grids: which runs a sweep makes, as data.

A sweep is a list of `RunSpec`s (a run name and dotted config overrides on a base config). The
grid is a product of *axes*; an axis is a list of labelled override bundles, so one axis value
can set several keys at once (`2bw+ef` = `delay.policy 2bw` + `delay.ef true`):

    axes = [axis("optim.name", ["adamw", "muon"]), axis("delay.policy", ["sync", "2bw"])]
    specs = expand(axes, seeds=3)      # 2 x 2 x 3 runs named e.g. "adamw_2bw_s0"

Running them is `experiments.sweep.run_sweep`.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalepipe.config import ConfigError, ExperimentConfig, apply_overrides
from stalepipe.config.overrides import parse_field
from stalepipe.errors import UserError
from stalepipe.fileio import flatten_dict
from stalepipe.training.delay.policies import never_delays

Bundle = tuple[str, dict[str, str]]  # (label used in run names, dotted overrides)

# Short names of common keys, for run names of ad-hoc grids.
_SHORT = {
    "optim.name": "",
    "delay.policy": "",
    "delay.sync_start": "sstart",
    "delay.sync_cooldown": "scool",
    "optim.lr": "lr",
    "optim.beta1": "b1",
    "optim.weight_decay": "wd",
    "pipeline.num_stages": "P",
    "train.num_steps": "steps",
    "train.batch_size": "bs",
}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+=-]+", "-", text).strip("-")


def axis(key: str, values: Iterable[Any], label: str | None = None) -> list[Bundle]:
    """One single-key axis: `axis("optim.lr", [1e-3, 3e-3])`. Labels are `<short><value>`
    (the optimizer and delay policy names stand for themselves)."""
    short = _SHORT.get(key, key.split(".")[-1]) if label is None else label
    return [(_slug(f"{short}{v}"), {key: str(v)}) for v in values]


def _key_values(text: str, flag: str) -> tuple[str, list[str]]:
    """`optim.name=adamw,muon` (the `--grid` / `--only` syntax) -> (key, values)."""
    key, _, values = text.partition("=")
    vals = [v for v in values.split(",") if v]
    if not key.strip() or not vals:
        raise UserError(f"{flag} expects KEY=V1,V2,... (e.g. optim.name=adamw,muon), got {text!r}")
    return key.strip(), vals


def parse_grid_arg(text: str) -> list[Bundle]:
    """`optim.name=adamw,muon` (the `--grid` CLI syntax) -> an axis."""
    return axis(*_key_values(text, "--grid"))


def select_runs(
    specs: Sequence[RunSpec], base: ExperimentConfig, only: Sequence[str]
) -> list[RunSpec]:
    """The runs of `specs` that `--only KEY=V1,V2` (repeatable; all must hold) keep: those whose
    config has one of the values at KEY, compared as the config holds them (`optim.lr=1e-2`
    keeps a run at 0.01, `delay.ef=true` one with EF on). For running part of a study first."""
    if not only:
        return list(specs)
    wanted: list[tuple[str, list[Any]]] = []
    for item in only:
        key, vals = _key_values(item, "--only")
        wanted.append((key, [parse_field(ExperimentConfig, key, v) for v in vals]))

    def keeps(spec: RunSpec) -> bool:
        flat = flatten_dict(spec.config(base, ".").to_dict())
        return all(flat[key] in vals for key, vals in wanted)

    kept = [s for s in specs if keeps(s)]
    if specs and not kept:
        raise UserError(f"no run of this sweep matches --only {' '.join(only)}")
    return kept


def parse_set_args(items: Sequence[str]) -> dict[str, str]:
    """`["train.num_steps=100", ...]` (the `--set` CLI syntax) -> overrides for every run."""
    fixed = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects KEY=VALUE (e.g. train.num_steps=100), got {item!r}")
        key, value = item.split("=", 1)
        fixed[key] = value
    return fixed


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its directory name, the overrides on the base config, its seed."""

    name: str
    overrides: dict[str, str]
    seed: int
    group: str = ""  # the run name without the seed: runs of one configuration share it

    def config(self, base: ExperimentConfig, out_dir: str | Path) -> ExperimentConfig:
        """The run's full config: `base` + overrides, named `name`, under `out_dir`."""
        seeded = {"train.seed": str(self.seed), "data.seed": str(self.seed), **self.overrides}
        cfg = apply_overrides(base, seeded)
        return dataclasses.replace(cfg, name=self.name, out_dir=str(out_dir))


def expand(
    axes: Sequence[Sequence[Bundle]],
    seeds: int | Sequence[int] = 1,
    fixed: dict[str, str] | None = None,
) -> list[RunSpec]:
    """The product of `axes` times seeds, as RunSpecs. Later axes override earlier ones on a
    shared key. `fixed` overrides apply to every run (they do not appear in names). Seeds set
    both `train.seed` (init, dropout) and `data.seed` (batch order)."""
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    out = []
    for combo in itertools.product(*axes) if axes else [()]:
        labels = [lab for lab, _ in combo if lab]
        overrides = dict(fixed or {})
        for _, o in combo:
            overrides.update(o)
        group = "_".join(labels) or "base"
        for s in seed_list:
            out.append(RunSpec(f"{group}_s{s}", overrides, s, group))
    return out


def dedupe(specs: Iterable[RunSpec]) -> list[RunSpec]:
    """Drop repeated run names (the same configuration listed by two grids of a study); two
    different override sets under one name are a bug in the study definition."""
    seen: dict[str, RunSpec] = {}
    for spec in specs:
        if spec.name in seen:
            assert seen[spec.name].overrides == spec.overrides, f"run name clash: {spec.name}"
            continue
        seen[spec.name] = spec
    return list(seen.values())


def check_overrides(specs: Sequence[RunSpec], base: ExperimentConfig) -> None:
    """Build every run's config once, so a bad grid value fails before anything runs."""
    for spec in specs:
        try:
            spec.config(base, "runs")
        except ConfigError as e:
            raise ConfigError(f"run {spec.name}: {e}") from None


def extend_delayed(
    specs: Sequence[RunSpec],
    base: ExperimentConfig,
    factors: Sequence[float],
    sync_too: bool = False,
) -> list[RunSpec]:
    """Longer runs of every delayed spec (a `delay.policy` other than sync; with `sync_too`,
    of every spec: `sweep --lengths`): the same configuration and seed at `factor` x its steps,
    each a complete run with its schedule stretched (warmup and the evaluation interval
    scaled, so the number of evaluations stays). The report and the verdict read their final
    losses against their lengths for the token overhead at sync's final loss
    (`analysis.targets.final_crossing`); a run already `factor` x long is not extended again."""
    flag = "--lengths" if sync_too else "--extend"
    out = []
    for spec in specs:
        cfg = spec.config(base, ".")
        if never_delays(cfg.delay.policy) and not sync_too:
            continue
        tc = cfg.train
        for f in factors:
            if not f > 1:
                raise UserError(f"{flag} factors must be > 1, got {f:g}")
            o = dict(spec.overrides)
            o["train.num_steps"] = str(round(tc.num_steps * f))
            o["train.warmup_steps"] = str(round(tc.warmup_steps * f))
            o["train.eval_every"] = str(round(tc.eval_every * f))
            group = f"{spec.group}_x{f:g}"
            out.append(RunSpec(f"{group}_s{spec.seed}", o, spec.seed, group))
    return out
