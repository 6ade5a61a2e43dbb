"""Final loss against planned length (issue 40): each delayed configuration run complete at
several lengths (`stalepipe sweep --lengths 1.1,1.2,1.35,1.5`), beside its synchronous
baseline at the same lengths, and where the delayed arm's final loss crosses sync's 1x final
loss: the token overhead the verdict reads (`targets.final_crossing`).

`length_series` gathers, per delayed configuration that has runs at two lengths or more, the
final val loss of every finished run by seed and planned length (a multiple of the baseline's
1x tokens); `length_plot` draws them, the seeds' mean with its 95 % t-band per arm, sync's 1x
final loss as the target line, and the overhead's estimate and interval from the rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stalepipe.lab.analysis import plots
from stalepipe.lab.analysis.overhead import tokens_per_step
from stalepipe.lab.analysis.results import LENGTH_KEYS, Row, config_key, val_curves
from stalepipe.lab.analysis.stats import t_interval
from stalepipe.lab.analysis.targets import (
    Relation,
    final_crossing,
    implied_overhead,
    relate,
    sync_slope,
)


@dataclass(frozen=True)
class Series:
    """Final val losses of one arm: planned length (x the baseline's 1x tokens) -> by seed."""

    label: str
    points: dict[float, dict[int, float]]

    def band(self) -> list[tuple[float, float, float, float]]:
        """(length, mean, 95 % low, 95 % high) over seeds at each length (no band with one)."""
        out = []
        for x, by_seed in sorted(self.points.items()):
            values = list(by_seed.values())
            mean = sum(values) / len(values)
            lo, hi = t_interval(values)[1:] if len(values) > 1 else (mean, mean)
            out.append((x, mean, lo, hi))
        return out


def _finals(rows: list[Row], base_tokens: float) -> dict[float, dict[int, float]]:
    out: dict[float, dict[int, float]] = {}
    for r in rows:
        x = round(
            int(r.config.get("train.num_steps", 0)) * tokens_per_step(r.config) / base_tokens, 3
        )
        for seed, curve in val_curves(r).items():
            out.setdefault(x, {})[seed] = curve[-1][1]
    return out


def length_series(rows: list[Row]) -> list[tuple[Row, Series, Series]]:
    """(delayed 1x row, its series, its baseline's series) for each delayed configuration with
    finished runs at two planned lengths or more and a synchronous baseline."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault(config_key(r.config, LENGTH_KEYS), []).append(r)
    steps = lambda r: int(r.config.get("train.num_steps", 0))  # noqa: E731
    out = []
    for group in groups.values():
        first = min(group, key=steps)
        if first.is_sync or first.baseline is None or len({steps(r) for r in group}) < 2:
            continue
        base = first.baseline
        sync = groups.get(config_key(base.config, LENGTH_KEYS), [base])
        one = steps(base) * tokens_per_step(base.config)
        out.append(
            (
                first,
                Series(first.label, _finals(group, one)),
                Series(base.label, _finals(sync, one)),
            )
        )
    return out


def length_plot(rows: list[Row]) -> bytes | None:
    """One panel per delayed configuration of `length_series`: final val loss against planned
    tokens (x sync's 1x), mean and 95 % band over seeds, delayed and sync; sync's 1x final loss
    dashed; the token overhead at it (the verdict's reading) marked with its interval."""
    items = length_series(rows)
    if not items:
        return None
    fig, axes = plots._grid(len(items), 3, 4.6, 3.4)
    for ax, (row, delayed, sync) in zip(axes.flat, items):
        for series, color in ((sync, "black"), (delayed, "C3")):
            band = series.band()
            xs, mean, lo, hi = zip(*band)
            ns = sorted({len(v) for v in series.points.values()})
            seeds = f"{ns[0]}-{ns[-1]}" if len(ns) > 1 else f"{ns[0]}"
            ax.plot(
                xs, mean, marker="o", ms=3, color=color, label=f"{series.label} ({seeds} seeds)"
            )
            ax.fill_between(xs, lo, hi, color=color, alpha=0.15, lw=0)
        one = sync.points.get(1.0)
        if one:
            ax.axhline(sum(one.values()) / len(one), color="black", ls="--", lw=0.8)
        target = row.targets.get("final") if row.targets else None
        if target is not None and target.seeds and not target.missed:
            est, low, high = target.interval()
            ax.axvline(est, color="C3", ls=":", lw=1)
            if math.isfinite(low):
                ax.axvspan(low, high, color="C3", alpha=0.08, lw=0)
        title = target.describe() if target is not None else "no overhead"
        ax.set_title(f"{row.label}: {title}", fontsize=8)
        ax.set_xlabel("planned tokens (x sync's 1x)")
        ax.set_ylabel("final val loss")
        ax.legend(fontsize=6, frameon=False)
        ax.grid(alpha=0.3)
    return plots._finish_grid(fig, axes, len(items))


def slope_relations(rows: list[Row]) -> list[Relation]:
    """Per delayed configuration of `length_series` whose sync baseline ran complete at longer
    lengths too: the overhead the equal-token gap and sync's final slope imply (`sync_slope`
    over sync's complete runs at 1-1.5x), per seed, beside the overhead measured where the
    delayed arm's final losses cross sync's 1x final loss (`targets.relate`). A seed not there
    by its longest run has no measured overhead and is left out."""
    out = []
    for row, delayed, sync in length_series(rows):
        if 1.0 not in sync.points or 1.0 not in delayed.points:
            continue
        implied, measured = [], []
        for seed, l1 in sync.points[1.0].items():
            finals = {x: v[seed] for x, v in sync.points.items() if x <= 1.5 and seed in v}
            ends = [[(x, v[seed])] for x, v in delayed.points.items() if seed in v]
            if len(finals) < 2 or seed not in delayed.points[1.0] or len(ends) < 2:
                continue
            gap = delayed.points[1.0][seed] - l1
            implied.append(implied_overhead(sync_slope(finals), gap))
            measured.append(final_crossing(ends, l1))
        if (r := relate(row.label, implied, measured)) is not None:
            out.append(r)
    return out
