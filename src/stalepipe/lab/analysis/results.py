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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalepipe.config import ExperimentConfig, upgrade_record
from stalepipe.config.overrides import default_of
from stalepipe.config.registry import CORRECTORS
from stalepipe.fileio import flatten_dict, inside, one_line, read_json_record, shown
from stalepipe.lab.analysis import overhead, stats
from stalepipe.lab.analysis import targets as targets_mod
from stalepipe.lab.analysis.records import read_spec, seed_or_none, warn, wrong_value
from stalepipe.training.delay.policies import SYNC, never_delays
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
    from stalepipe.training.rundir.metrics import read_metrics

    config: dict[str, Any] = {}
    if inside(root, d / "config.json").exists():
        with contextlib.suppress(ValueError):  # unreadable: the run has no configuration
            config = flatten_dict(upgrade_record(read_json_record(root, d / "config.json")))
    spec = read_spec(root, d)
    status = run_status(d)
    if status == "partial" and not inside(root, d / "metrics.jsonl").exists():
        status = "missing"  # planned by the sweep, not started
    run = Run(
        one_line(d.name), d, status, config, one_line(spec.get("group", "")), spec.get("seed")
    )
    if run.seed is None and config:
        run.seed = seed_or_none(config.get("train.seed"))
    records = read_metrics(d)
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


@dataclass
class Row:
    """One configuration: its runs over seeds and its statistics."""

    label: str
    config: dict[str, Any]
    runs: list[Run]
    values: list[float]  # final val losses of finished seeds
    mean: float = math.nan
    std: float = math.nan
    baseline: Row | None = None  # the sync configuration it is compared with
    gap: float = math.nan
    gap_p: float = math.nan  # two-sided, paired by seed where >= 2 seeds pair, else Welch
    gap_test: stats.Difference | None = None  # that test, with the gap's 95 % interval
    gap_p_welch: float = math.nan  # Welch's test beside it (unpaired)
    unmitigated: Row | None = None
    recovered: float = math.nan  # share of the unmitigated gap this mitigation removes
    recovered_p: float = math.nan  # vs the unmitigated configuration (paired as gap_p)
    token_overhead: overhead.Overhead | None = None  # over the baseline (overhead.py)
    targets: dict[str, targets_mod.TargetOverhead] = field(default_factory=dict)  # targets.py
    _exit: float | None = None  # cache of `regime.plateau_exit_of`

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
    """Group runs into configurations and fill in every statistic."""
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
    rows = []
    for members in groups.values():
        members.sort(key=lambda r: (r.seed if r.seed is not None else 0, r.name))
        # one configuration planned under several names (e.g. a length study's 2x arm and an
        # --extend 2 of the 1x arm) reads as its names, not as a list of its whole config
        labels = {r.group for r in members}
        label = " = ".join(sorted(labels)) if "" not in labels else ""
        config = members[0].config
        vals = [
            r.final_val for r in members if r.status == "finished" and math.isfinite(r.final_val)
        ]
        row = Row(one_line(label or _label(config, varying)), config, members, vals)
        row.mean, row.std = stats.mean(vals), stats.std(vals)
        rows.append(row)
    _link(rows)
    longer = longer_runs(rows)
    for row in rows:
        if row.baseline is not None:
            row.token_overhead = row_overhead(row, row.baseline)
            row.targets = row_targets(row, row.baseline, longer.get(id(row), []))
    # each sync baseline, then the configurations compared with it
    rows.sort(key=lambda r: (r.baseline.label if r.baseline else r.label, not r.is_sync, r.label))
    return rows


def _sync_version(config: dict[str, Any]) -> dict[str, Any]:
    c = dict(config)
    c["delay.policy"] = SYNC
    c.update(mitigation_defaults())
    return c


def _link(rows: list[Row]) -> None:
    """Find each row's sync baseline and unmitigated counterpart; compute gaps and shares."""
    ignore = _tuning() + ("delay.mode",)
    by_key = {config_key(r.config, ignore): r for r in rows}
    by_key_any_depth = {}
    for r in rows:
        if r.is_sync:
            by_key_any_depth.setdefault(config_key(r.config, ignore + ("pipeline.num_stages",)), r)
    for r in rows:
        if r.is_sync:
            continue
        target = _sync_version(r.config)
        base = by_key.get(config_key(target, ignore))
        if base is None or not base.is_sync:
            base = by_key_any_depth.get(config_key(target, ignore + ("pipeline.num_stages",)))
        if base is not None and base.values:
            _set_gap(r, base)
        if r.mitigations:
            plain = dict(r.config)
            plain.update(mitigation_defaults())
            un = by_key.get(config_key(plain, ignore))
            if un is not None and un.values:
                r.unmitigated = un
                if un.baseline is None:
                    _link_one_baseline(un, by_key, by_key_any_depth, ignore)
                shares = recovered_shares(r)  # one estimator: the seeds' mean share (claims.py)
                r.recovered = stats.mean(shares) if shares else stats.recovered_share(r.gap, un.gap)
                r.recovered_p = compare(r, un).p if r.values else math.nan


def _link_one_baseline(r: Row, by_key: dict, by_key_any_depth: dict, ignore: tuple) -> None:
    target = _sync_version(r.config)
    base = by_key.get(config_key(target, ignore)) or by_key_any_depth.get(
        config_key(target, ignore + ("pipeline.num_stages",))
    )
    if base is not None and base.values and r.values:
        _set_gap(r, base)


def compare(a: Row, b: Row) -> stats.Difference:
    """mean(a) - mean(b) with its test and interval (`stats.seed_difference`: paired by seed
    where two or more seeds pair, else Welch's over all finished runs)."""
    return stats.seed_difference(seed_values(a), seed_values(b), (a.values, b.values))


def _set_gap(r: Row, base: Row) -> None:
    """The gap, its test and interval, from one set of seeds: the paired ones when at least
    two pair (a seed only one side finished does not move the gap), else all of them."""
    r.baseline = base
    r.gap_test = compare(r, base) if r.values else None
    paired = r.gap_test is not None and r.gap_test.paired
    r.gap = (
        r.gap_test.diff if paired else stats.gap(r.values, base.values) if r.values else math.nan
    )
    r.gap_p = r.gap_test.p if r.gap_test else math.nan
    r.gap_p_welch = stats.welch_t_test(r.values, base.values).p


def seed_values(row: Row) -> dict[int, float]:
    """Seed -> final val loss, for the row's finished runs with a seed."""
    return {
        int(r.seed): r.final_val
        for r in row.runs
        if r.status == "finished" and math.isfinite(r.final_val) and r.seed is not None
    }


def recovered_shares(r: Row) -> list[float]:
    """Per seed, paired over the row, its unmitigated arm and their sync baseline: the share of
    the unmitigated gap the mitigation removes ((plain - mine) / (plain - sync)). Its mean is
    the row's `recovered` and its t-interval the claim's, one estimator for both."""
    un, sync = r.unmitigated, r.baseline
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


def val_curves(row: Row) -> dict[int, overhead.Curve]:
    """Seed -> val loss against tokens, for the row's finished runs with a seed."""
    return {
        int(r.seed): overhead.token_curve(r.val_curve, overhead.tokens_per_step(r.config))
        for r in row.runs
        if r.status == "finished" and r.val_curve and r.seed is not None
    }


def row_overhead(
    row: Row, baseline: Row, rule: overhead.BandRule = overhead.DEFAULT_RULE
) -> overhead.Overhead:
    """The token overhead of `row` over its sync `baseline`, finished runs paired by seed."""
    return overhead.overhead_over_seeds(val_curves(baseline), val_curves(row), rule)


LENGTH_KEYS = ("train.num_steps", "train.warmup_steps", "train.eval_every")


def longer_runs(rows: list[Row]) -> dict[int, list[Row]]:
    """id(row) -> the rows equal to it but for a longer training length (the same delayed arm
    planned longer: its runs count toward reaching sync's final loss, `targets.py`)."""
    by_key: dict[tuple, list[Row]] = {}
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
    row: Row, baseline: Row, longer: list[Row]
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
