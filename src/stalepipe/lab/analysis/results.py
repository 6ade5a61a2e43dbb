"""Read a sweep's run directories and reduce them to one row per configuration.

Only files in the run directories are read (config.json, metrics.jsonl, sweep.json,
error.json), never a model. Runs are grouped into *configurations* by their config.json with the
seeds removed; for each configuration the table holds the final val loss over seeds, the gap to
its synchronous baseline, the token overhead over it (overhead.py: the tokens the delayed runs
need to reach the baseline's losses, paired by seed) and, for mitigated runs, the share of the
unmitigated gap recovered.

Matching is done on the full config, not on names: the sync baseline of a configuration is the
one whose config is equal after setting the delay policy to `sync` and every mitigation off
(ignoring `pipeline.num_stages` when no sync run of the same depth exists, since synchronous
training does not depend on the split); the unmitigated counterpart is equal after switching the
mitigations off.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from stalepipe.config import ExperimentConfig, upgrade_record
from stalepipe.config.overrides import default_of
from stalepipe.config.registry import CORRECTORS
from stalepipe.fileio import flatten_dict, inside, one_line, read_json_record, shown
from stalepipe.lab.analysis import overhead, stats
from stalepipe.lab.analysis import targets as targets_mod
from stalepipe.lab.analysis.records import read_spec, seed_or_none, warn, wrong_value
from stalepipe.training.delay.policies import SYNC, never_delays
from stalepipe.training.rundir.metrics import read_metrics
from stalepipe.training.rundir.status import ERROR_FILE, SPEC_FILE, run_status

# Keys that do not define a configuration (the seed axis, names, logging and speed knobs).
NON_CONFIG_KEYS = {
    "name", "out_dir", "train.seed", "data.seed", "train.progress", "train.log_every",
    "train.ckpt_every", "train.keep_last", "train.threads", "data.data_dir",
}  # fmt: skip


def mitigation_defaults() -> dict[str, Any]:
    """Every registered mitigation's and corrector's settings at their values when off
    (`CorrectorSpec.fields`, config/registry.py): a run with all of them so is unmitigated.
    Records from before a corrector lack its keys and read as off."""
    return {f"delay.{k}": v for _, spec in CORRECTORS.items() for k, v in spec.fields.items()}


def _tuning() -> tuple[str, ...]:
    """Settings that only tune a mitigation once on (Taylor's EMA and eps): ignored when
    matching a run with its baseline and its unmitigated counterpart."""
    return tuple(f"delay.{k}" for _, spec in CORRECTORS.items() for k in spec.tuning)


@dataclass
class Run:
    """One run directory as the report sees it."""

    name: str
    path: Path
    status: str  # finished | partial | failed | missing | unreadable (a wrong value in its records)
    config: dict[str, Any]  # flattened config.json ({} if absent)
    group: str = ""  # sweep.json's group label, or ""
    seed: int | None = None
    final_val: float = math.nan
    steps_done: int = 0
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, train loss)
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    error: str = ""
    staleness: list[dict[str, float]] = field(default_factory=list)  # log.staleness lines


def load_runs(root: str | Path) -> list[Run]:
    """Every run directory directly under `root` (a directory holding a config.json or a
    sweep.json), sorted by name. Nothing outside `root` is read: a link in it that leads out
    is a LinkError (`fileio.inside`, exit 2). A run whose records hold a wrong value (a
    val_loss that is not a number) is kept as 'unreadable', with a warning naming the file:
    the rest of the sweep still reports, and the run is listed, not silently dropped."""
    root = Path(root)
    runs = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        if (d / "config.json").exists() or (d / SPEC_FILE).exists():
            runs.append(_load_run(root, inside(root, d)))
    return runs


def _load_run(root: Path, d: Path) -> Run:
    """One run directory as the report reads it (`load_runs`)."""
    config: dict[str, Any] = {}
    if inside(root, d / "config.json").exists():
        with contextlib.suppress(ValueError):  # unreadable: the run has no configuration
            config = flatten_dict(upgrade_record(read_json_record(root, d / "config.json")))
    spec = read_spec(root, d)
    read = functools.cache(lambda: read_metrics(d))  # the status and the curves: parsed once
    status = run_status(d, metrics=read)
    if status == "partial" and not inside(root, d / "metrics.jsonl").exists():
        status = "missing"  # planned by the sweep, not started
    run = Run(
        one_line(d.name), d, status, config, one_line(spec.get("group", "")), spec.get("seed")
    )
    if run.seed is None and config:
        run.seed = seed_or_none(config.get("train.seed"))
    records = read()
    wrong = wrong_value(records)
    if wrong:
        warn(
            f"{shown(d / 'metrics.jsonl')}: {wrong}; run {run.name} is left out of the tables "
            "(fix or delete that line, then report again)"
        )
        run.status, run.error, run.seed = "unreadable", f"metrics.jsonl: {wrong}", None
        return run
    run.curve = [(r["step"], r["loss"]) for r in records if "loss" in r]
    run.val_curve = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    run.steps_done = records[-1]["step"] + 1 if records else 0
    run.staleness = [r for r in records if any(k.startswith("update_rel/") for k in r)]
    if status == "finished" and run.val_curve:
        run.final_val = run.val_curve[-1][1]
    if status == "failed":
        try:
            run.error = one_line(read_json_record(root, d / ERROR_FILE).get("error", ""))
        except (OSError, ValueError):
            run.error = "unreadable error.json"
    return run


def config_key(config: dict[str, Any], drop: tuple[str, ...] = ()) -> tuple:
    """A hashable identity of a configuration (seeds and `drop` keys left out). A setting at
    its default is left out too: a record written before the setting existed (a mitigation, a
    corrector, `pipeline.num_chunks`) means the default, and the two are one configuration."""
    return tuple(
        sorted(
            (k, json.dumps(v))
            for k, v in config.items()
            if k not in NON_CONFIG_KEYS and k not in drop and not _at_default(k, v)
        )
    )


@functools.cache
def _default(key: str) -> Any:
    try:
        return default_of(ExperimentConfig, key)
    except KeyError:  # not a config field (an old record's key): never at a default
        return _NO_DEFAULT


_NO_DEFAULT = object()


def _at_default(key: str, value: Any) -> bool:
    return _default(key) is not _NO_DEFAULT and value == _default(key)


@dataclass(frozen=True, eq=False)
class Configuration:
    """One configuration's runs over seeds and its own statistics, before it is compared with
    another (`build_rows` links these into `Row`s). Equal only to itself: rows are compared
    and looked up by identity (`row.baseline is sync`)."""

    label: str
    config: dict[str, Any]
    runs: tuple[Run, ...]
    values: tuple[float, ...]  # final val losses of finished seeds
    mean: float
    std: float

    @property
    def policy(self) -> str:
        return str(self.config.get("delay.policy", SYNC))

    @property
    def mitigations(self) -> dict[str, Any]:
        return {
            k: self.config.get(k, d)
            for k, d in mitigation_defaults().items()
            if self.config.get(k, d) != d
        }

    @property
    def is_sync(self) -> bool:
        return never_delays(self.policy) and not self.mitigations

    @property
    def seeds_done(self) -> int:
        return len(self.values)


C = TypeVar("C", bound=Configuration)


@dataclass(frozen=True)
class Recovery:
    """The share of its unmitigated counterpart's gap a mitigated row removes."""

    share: float  # the seeds' mean share (`recovered_shares`), else from the two gaps; nan: none
    p: float  # mitigated against unmitigated final loss (`compare`, paired as the gap)


@dataclass(frozen=True, eq=False)
class Row(Configuration):
    """One configuration: its runs over seeds, its statistics and its comparisons, all set
    when `build_rows` builds it (immutable)."""

    baseline: Row | None = None  # the sync configuration it is compared with
    # mean(row) - mean(baseline) with its test and 95 % interval: paired by seed where >= 2
    # seeds pair, else Welch's over all finished runs (`compare`); None without a baseline or
    # a finished run
    gap: stats.Difference | None = None
    gap_welch: stats.Difference | None = None  # Welch's test of the same gap beside it
    unmitigated: Row | None = None
    recovered: Recovery | None = None  # with an unmitigated counterpart
    token_overhead: overhead.Overhead | None = None  # over the baseline (overhead.py)
    targets: dict[str, targets_mod.TargetOverhead] = field(default_factory=dict)  # targets.py

    @property
    def gap_diff(self) -> float:
        """The gap's point estimate (`gap.diff`), nan without a gap."""
        return self.gap.diff if self.gap is not None else math.nan


def _short(key: str) -> str:
    return key.split(".")[-1]


def _label(config: dict[str, Any], varying: list[str]) -> str:
    parts = []
    for k in varying:
        v = config.get(k)
        if k in ("optim.name", "delay.policy"):
            parts.append(str(v))
        elif isinstance(v, bool):
            if v:
                parts.append(_short(k))
        else:
            parts.append(f"{_short(k)}={v}")
    return " ".join(parts) or "base"


def _implied_by_optimizer(key: str, runs: list[Run]) -> bool:
    """Whether `key` takes one value per optimizer (its defaults, e.g. beta1 or lr per
    optimizer): the optimizer's name already says it, so labels leave it out."""
    values: dict[str, set[str]] = {}
    for r in runs:
        values.setdefault(str(r.config.get("optim.name")), set()).add(json.dumps(r.config.get(key)))
    return len(values) > 1 and all(len(v) == 1 for v in values.values())


def build_rows(runs: list[Run]) -> list[Row]:
    """Group runs into configurations and build each one's row once, with every statistic:
    sync rows first, then the unmitigated delayed rows (compared with their baseline), then the
    mitigated ones (with their baseline and their unmitigated counterpart)."""
    with_cfg = [r for r in runs if r.config]
    groups: dict[tuple, list[Run]] = {}
    for r in with_cfg:
        groups.setdefault(config_key(r.config), []).append(r)
    all_keys = sorted({k for r in with_cfg for k in r.config} - NON_CONFIG_KEYS)
    varying = [k for k in all_keys if len({json.dumps(r.config.get(k)) for r in with_cfg}) > 1]
    varying = [k for k in varying if k == "optim.name" or not _implied_by_optimizer(k, with_cfg)]
    # optimizer-implied defaults vary with optim.name; keep them out of labels when a sweep
    # label exists, and order the label: optimizer, policy, then the rest
    varying.sort(key=lambda k: (k != "optim.name", k != "delay.policy", k))
    configurations = [_configuration(members, varying) for members in groups.values()]
    find = _Counterparts(configurations)
    longer = longer_runs(configurations)
    built: dict[int, Row] = {}  # id(configuration) -> its row
    for tier in (_SYNC, _UNMITIGATED, _MITIGATED):
        for c in configurations:
            if _tier(c) == tier:
                built[id(c)] = _row(c, find, built, longer.get(id(c), []))
    rows = [built[id(c)] for c in configurations]
    # each sync baseline, then the configurations compared with it
    rows.sort(key=lambda r: (r.baseline.label if r.baseline else r.label, not r.is_sync, r.label))
    return rows


def _configuration(members: list[Run], varying: list[str]) -> Configuration:
    """One configuration's runs, sorted by seed, with its label and own statistics."""
    members = sorted(members, key=lambda r: (r.seed if r.seed is not None else 0, r.name))
    # one configuration planned under several names (e.g. a length study's 2x arm and an
    # --extend 2 of the 1x arm) reads as its names, not as a list of its whole config
    labels = {r.group for r in members}
    label = " = ".join(sorted(labels)) if "" not in labels else ""
    config = members[0].config
    vals = [r.final_val for r in members if r.status == "finished" and math.isfinite(r.final_val)]
    label = one_line(label or _label(config, varying))
    return Configuration(
        label, config, tuple(members), tuple(vals), stats.mean(vals), stats.std(vals)
    )


_SYNC, _UNMITIGATED, _MITIGATED = range(
    3
)  # the order rows are built in: each needs the ones before


def _tier(c: Configuration) -> int:
    return _SYNC if c.is_sync else _MITIGATED if c.mitigations else _UNMITIGATED


def _sync_version(config: dict[str, Any]) -> dict[str, Any]:
    c = dict(config)
    c["delay.policy"] = SYNC
    c.update(mitigation_defaults())
    return c


class _Counterparts:
    """Finds a configuration's sync baseline and unmitigated counterpart, each only with a
    finished run, by config (module docstring)."""

    def __init__(self, configurations: list[Configuration]) -> None:
        self.ignore = _tuning() + ("delay.mode",)
        self.by_key = {config_key(c.config, self.ignore): c for c in configurations}
        self.by_key_any_depth: dict[tuple, Configuration] = {}
        for c in configurations:
            if c.is_sync:
                key = config_key(c.config, self.ignore + ("pipeline.num_stages",))
                self.by_key_any_depth.setdefault(key, c)

    def baseline(self, c: Configuration) -> Configuration | None:
        if c.is_sync:
            return None
        target = _sync_version(c.config)
        base = self.by_key.get(config_key(target, self.ignore))
        if base is None or not base.is_sync:
            key = config_key(target, self.ignore + ("pipeline.num_stages",))
            base = self.by_key_any_depth.get(key)
        return base if base is not None and base.values else None

    def unmitigated(self, c: Configuration) -> Configuration | None:
        if not c.mitigations:
            return None
        plain = dict(c.config)
        plain.update(mitigation_defaults())
        un = self.by_key.get(config_key(plain, self.ignore))
        # itself when only a tuning setting is off its default: no counterpart
        return un if un is not None and un is not c and un.values else None


def _row(
    c: Configuration, find: _Counterparts, built: dict[int, Row], longer: list[Configuration]
) -> Row:
    """The row of `c`, its baseline and unmitigated counterpart already `built`."""
    base = find.baseline(c)
    un = find.unmitigated(c)
    baseline = built[id(base)] if base is not None else None
    unmitigated = built[id(un)] if un is not None else None
    gap = welch = None
    if baseline is not None and c.values:
        # the gap, its test and interval from one set of seeds: the paired ones when at least
        # two pair (a seed only one side finished does not move the gap), else all of them
        gap = compare(c, baseline)
        welch = stats.welch_difference(c.values, baseline.values)
    recovered = None
    if unmitigated is not None:
        shares = _shares(c, unmitigated, baseline)  # one estimator: the seeds' mean (claims.py)
        gap_diff = gap.diff if gap is not None else math.nan
        share = (
            stats.mean(shares) if shares else stats.recovered_share(gap_diff, unmitigated.gap_diff)
        )
        recovered = Recovery(share, compare(c, unmitigated).p if c.values else math.nan)
    return Row(
        c.label, c.config, c.runs, c.values, c.mean, c.std,
        baseline=baseline, gap=gap, gap_welch=welch, unmitigated=unmitigated, recovered=recovered,
        token_overhead=row_overhead(c, baseline) if baseline is not None else None,
        targets=row_targets(c, baseline, longer) if baseline is not None else {},
    )  # fmt: skip


def compare(a: Configuration, b: Configuration) -> stats.Difference:
    """mean(a) - mean(b) with its test and interval (`stats.seed_difference`: paired by seed
    where two or more seeds pair, else Welch's over all finished runs)."""
    return stats.seed_difference(seed_values(a), seed_values(b), (a.values, b.values))


def seed_values(row: Configuration) -> dict[int, float]:
    """Seed -> final val loss, for the row's finished runs with a seed."""
    return {
        int(r.seed): r.final_val
        for r in row.runs
        if r.status == "finished" and math.isfinite(r.final_val) and r.seed is not None
    }


def recovered_shares(r: Row) -> list[float]:
    """Per seed, paired over the row, its unmitigated arm and their sync baseline: the share of
    the unmitigated gap the mitigation removes ((plain - mine) / (plain - sync)). Its mean is
    the row's `recovered.share` and its t-interval the claim's, one estimator for both."""
    return _shares(r, r.unmitigated, r.baseline)


def _shares(r: Configuration, un: Configuration | None, sync: Configuration | None) -> list[float]:
    if un is None or sync is None:
        return []
    mine, plain, base = seed_values(r), seed_values(un), seed_values(sync)
    seeds = sorted(mine.keys() & plain.keys() & base.keys())
    return [(plain[s] - mine[s]) / (plain[s] - base[s]) for s in seeds if plain[s] != base[s]]


def best_row(rows: list[Row]) -> Row:
    """The row with the lowest mean final val loss over the seeds every row finished (over its
    own seeds when they share none), so a setting with more seeds is not favoured by them."""
    common = set.intersection(*(set(seed_values(r)) for r in rows))

    def score(r: Row) -> float:
        vals = seed_values(r)
        return stats.mean([vals[s] for s in sorted(common)]) if common else r.mean

    return min(rows, key=score)


def val_curves(row: Configuration) -> dict[int, overhead.Curve]:
    """Seed -> val loss against tokens, for the row's finished runs with a seed."""
    return {
        int(r.seed): overhead.token_curve(r.val_curve, overhead.tokens_per_step(r.config))
        for r in row.runs
        if r.status == "finished" and r.val_curve and r.seed is not None
    }


def row_overhead(
    row: Configuration, baseline: Configuration, rule: overhead.BandRule = overhead.DEFAULT_RULE
) -> overhead.Overhead:
    """The token overhead of `row` over its sync `baseline`, finished runs paired by seed."""
    return overhead.overhead_over_seeds(val_curves(baseline), val_curves(row), rule)


LENGTH_KEYS = ("train.num_steps", "train.warmup_steps", "train.eval_every")


def longer_runs(rows: Sequence[C]) -> dict[int, list[C]]:
    """id(row) -> the rows equal to it but for a longer training length (the same delayed arm
    planned longer: its runs count toward reaching sync's final loss, `targets.py`)."""
    by_key: dict[tuple, list[C]] = {}
    for r in rows:
        by_key.setdefault(config_key(r.config, LENGTH_KEYS), []).append(r)
    steps = lambda r: int(r.config.get("train.num_steps", 0))  # noqa: E731
    return {
        id(r): [o for o in group if steps(o) > steps(r)]
        for group in by_key.values()
        for r in group
        if not r.is_sync
    }


def row_targets(
    row: Configuration, baseline: Configuration, longer: Sequence[Configuration]
) -> dict[str, targets_mod.TargetOverhead]:
    """The token overhead of `row` at sync's final loss and at shares of its drop, counting
    the same arm's longer planned runs (`targets.target_overheads`)."""
    delayed: dict[int, list[overhead.Curve]] = {}
    for r in (row, *longer):
        for seed, curve in val_curves(r).items():
            delayed.setdefault(seed, []).append(curve)
    c = baseline.config
    warmup = int(c.get("train.warmup_steps", 0)) * overhead.tokens_per_step(c)
    return targets_mod.target_overheads(val_curves(baseline), delayed, warmup)


def missing_summary(runs: list[Run], rows: list[Row]) -> list[str]:
    """Human-readable lines on what is not finished yet (empty when everything is)."""
    lines = []
    by_status: dict[str, list[Run]] = {}
    for r in runs:
        by_status.setdefault(r.status, []).append(r)
    if by_status.get("missing"):
        lines.append(
            f"{len(by_status['missing'])} planned run(s) not started: "
            + ", ".join(r.name for r in by_status["missing"][:12])
            + (" ..." if len(by_status["missing"]) > 12 else "")
        )
    if by_status.get("partial"):
        lines.append(
            f"{len(by_status['partial'])} run(s) unfinished: "
            + ", ".join(f"{r.name} (step {r.steps_done})" for r in by_status["partial"][:12])
        )
    for r in by_status.get("failed", []):
        lines.append(f"failed: {r.name}: {r.error}")
    for r in by_status.get("unreadable", []):
        lines.append(f"unreadable, left out: {r.name}: {r.error}")
    for row in rows:
        if not row.is_sync and row.baseline is None and row.values:
            lines.append(f"{row.label}: no finished sync baseline{_apart(row, rows)}, so no gap")
        if row.mitigations and row.unmitigated is None and row.values:
            lines.append(f"{row.label}: no finished unmitigated counterpart, so no recovery share")
    return lines


def _apart(row: Row, rows: list[Row]) -> str:
    """Why a sync arm equal but for `train.compile` (a setting of the numbers) is not its."""
    ignore = _tuning() + ("delay.mode", "train.compile")
    key = config_key(_sync_version(row.config), ignore)
    other = [r for r in rows if r.is_sync and r.values and config_key(r.config, ignore) == key]
    if not other:
        return ""
    return f" of its train.compile ({other[0].label} ran with another: never paired)"
