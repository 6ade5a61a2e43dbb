"""The regime checks of a run's curve, read from its records (and its token data when found).

A delay study says something about pretraining only if its runs behave like pretraining runs
(docs/RESULTS.md, "Regime"):

- (a) every arm leaves the initial plateau early: the first step at which the train loss,
  smoothed by a trailing mean over `smooth_window(steps)` logged steps, is below the unigram
  entropy of the training tokens minus `MARGIN` nats, as a fraction of the run, is at most
  `EXIT_BY` for every seed. A delayed arm that escapes late has a gap that mixes delay damage
  with a late escape.
- (b) the seed spread of the synchronous baseline is at most a fifth of the gap
  (`regime_check`).
- (c) the train loss is still falling at the end (`end_slope` < 0), read by
  benchmarks/studies/regime_probe.py when a scale is chosen.

(a) needs the unigram entropy of the run's training tokens: `run_entropy` finds the run's data
from its records (`rundir.directory.locate_run_data`); where the data is not on this machine
the check reads nan ("not read"), never a pass.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING

from stalepipe.config import ExperimentConfig, upgrade_record
from stalepipe.fileio import read_json_record

if TYPE_CHECKING:
    from stalepipe.lab.analysis.results import Row, Run

MARGIN = 0.3  # nats below the unigram entropy that count as "off the plateau"
EXIT_BY = 0.1  # criterion (a): off the plateau within the first tenth of the run


def smooth_window(steps: int) -> int:
    """The trailing-mean window over logged train losses."""
    return max(5, steps // 100)


def plateau_exit(losses: list[float], entropy: float) -> int | None:
    """The first index whose trailing mean train loss is below `entropy - MARGIN` (None:
    never)."""
    w = smooth_window(len(losses))
    total = sum(losses[:w])
    for i in range(w, len(losses) + 1):
        if i > w:
            total += losses[i - 1] - losses[i - 1 - w]
        if total / w < entropy - MARGIN:
            return i - 1
    return None


def end_slope(losses: list[float]) -> float:
    """Least-squares slope of the train loss over the last 20% of steps, per 10% of the run."""
    n = len(losses)
    tail = losses[int(n * 0.8) :]
    if len(tail) < 2:
        return math.nan
    xm, ym = (len(tail) - 1) / 2, sum(tail) / len(tail)
    num = sum((x - xm) * (y - ym) for x, y in enumerate(tail))
    den = sum((x - xm) ** 2 for x in range(len(tail)))
    return num / den * n * 0.1


def run_entropy(run: Run) -> float:
    """The unigram entropy of the tokens `run` trained on; nan when its data is not found."""
    # here, not at the top: the data package loads torch, and `--help` reads the claims
    from stalepipe.training.data.manifest import unigram_entropy
    from stalepipe.training.rundir.directory import locate_run_data

    try:  # read_json_record: no link out of the run
        record = read_json_record(run.path, run.path / "config.json")
        cfg = ExperimentConfig.from_dict(upgrade_record(record), strict=False)
        found = locate_run_data(run.path, cfg)
    except Exception:  # an unreadable or foreign config only loses this check
        return math.nan
    if found is None or not found.is_dir():
        return math.nan
    try:
        return unigram_entropy(str(found.resolve()))
    except (OSError, ValueError):
        return math.nan


def exit_fraction(run: Run, entropy: float) -> float:
    """When `run` leaves the plateau, as a fraction of its logged steps (inf: never; nan: not
    read)."""
    losses = [loss for _, loss in run.curve]
    if not losses or not math.isfinite(entropy):
        return math.nan
    i = plateau_exit(losses, entropy)
    return math.inf if i is None else (i + 1) / len(losses)


def plateau_exit_of(row: Row) -> float:
    """The latest plateau exit over the row's finished seeds, as a fraction of the run
    (criterion (a)): inf if a seed never leaves, nan if not read. Cached per row (a row is
    immutable and hashed by identity; the cache holds it weakly)."""
    if row not in _EXITS:
        done = [r for r in row.runs if r.status == "finished"]
        entropy = run_entropy(done[0]) if done else math.nan
        fractions = [exit_fraction(r, entropy) for r in done]
        _EXITS[row] = max(fractions) if fractions and math.isfinite(entropy) else math.nan
    return _EXITS[row]


_EXITS: weakref.WeakKeyDictionary[Row, float] = weakref.WeakKeyDictionary()


UNREAD = "unread"  # a regime check that could not be read: never a pass (`claims.label`)


def regime_check(r: Row) -> str:
    """The regime check a delayed row fails ('' when it passes, `analysis.regime`): (a) it or
    its baseline leaves the initial plateau after the first tenth of the run in some seed;
    (b) the seed spread of its synchronous baseline above a fifth of its gap, so the gap is not
    much larger than the noise between seeds. A check (a) that cannot be read (the runs' token
    data not found, so no plateau to measure against) is `UNREAD ...`, which `claims.label` caps at
    inconclusive: an unread check is never a pass. (Moved here from `claims` in issue 51, so
    that the ladder's labels read the same checks.)"""
    for arm in (r, r.baseline):
        if arm is not None and math.isnan(plateau_exit_of(arm)):
            return f"{UNREAD}: no token data to find {arm.label}'s plateau exit against"
        if arm is not None and plateau_exit_of(arm) > EXIT_BY:
            late = plateau_exit_of(arm)
            when = "never" if math.isinf(late) else f"at {100 * late:.0f}%"
            return (
                f"(a) {'sync ' if arm is not r else ''}plateau exit {when} > {100 * EXIT_BY:.0f}%"
            )
    # (b) against the delay's gap: a mitigated row's own gap is small by design
    base, effect = r.baseline, (r.unmitigated or r).gap_diff
    readable = base is not None and len(base.values) >= 2 and math.isfinite(effect) and effect > 0
    if readable and base.std > effect / 5:
        return f"(b) sync std {base.std:.4f} > gap/5"
    return ""
