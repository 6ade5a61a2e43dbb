"""Report plots (matplotlib, Agg): loss curves per baseline, the gap against one axis, and val
loss against tokens with the token overhead marked.

Each function takes the report's rows and returns a PNG as bytes, or None when the rows do not
vary along that axis (a plot with one point says nothing).
"""

from __future__ import annotations

import io
import json
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from stalepipe.lab.analysis import overhead
from stalepipe.lab.analysis.results import Row, best_row, config_key, val_curves
from stalepipe.lazy import require
from stalepipe.training.delay import DelaySchedule
from stalepipe.training.delay.policies import never_delays, same_delay_at_any_depth


def pyplot() -> Any:
    """matplotlib's pyplot, headless, with `$...$` read as text: plot labels come from records
    (group names), and a label that is bad mathtext would fail the whole report."""
    matplotlib = require("matplotlib", "plots")
    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt  # optional (the plots extra): required above

    return plt


def _grid(n: int, max_cols: int, width: float, height: float) -> tuple[Any, Any]:
    """A figure of `n` panels, `max_cols` to a row, each `width` x `height` inches."""
    cols = min(max_cols, n)
    nrows = math.ceil(n / cols)
    return pyplot().subplots(nrows, cols, figsize=(width * cols, height * nrows), squeeze=False)


def _finish_grid(fig, axes, used: int) -> bytes:
    """Blank the unused panels of a grid figure and return it as PNG bytes."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    fig.tight_layout()
    return png_bytes(fig, dpi=80)


def png_bytes(fig: Any, dpi: int = 110) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    pyplot().close(fig)
    return buf.getvalue()


def _smooth(ys: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def seed_curves(row: Row) -> tuple[list[int], list[list[float]]]:
    """Train loss of each finished seed of `row`, on the steps every seed logged."""
    curves = [dict(r.curve) for r in row.runs if r.status == "finished" and r.curve]
    if not curves:
        return [], []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return steps, [[c[s] for s in steps] for c in curves]


def mean_curve(row: Row) -> tuple[list[int], list[float]]:
    """Train loss averaged over the row's finished seeds, per step."""
    steps, curves = seed_curves(row)
    return steps, [sum(ys) / len(ys) for ys in zip(*curves)]


def loss_curve_panels(rows: list[Row]) -> dict[str, list[Row]]:
    """Baseline label -> [baseline, every configuration compared with it]: the panels of
    `loss_curves`, one per sync baseline with a finished run, none left out."""
    panels: dict[str, list[Row]] = {}
    for r in rows:
        if r.is_sync and r.values:
            panels.setdefault(r.label, [r])
    for r in rows:
        if r.baseline is not None and r.values:
            panels.setdefault(r.baseline.label, [r.baseline]).append(r)
    return panels


def _legend_outside(ax: Any, fontsize: int = 7) -> None:
    """The legend right of the panel, never over the data."""
    ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def loss_curves(rows: list[Row]) -> bytes | None:
    """One panel per sync baseline: its train loss and that of every configuration compared
    with it (each configuration one curve: the mean over its seeds, the band between its
    seeds' lowest and highest, running means over 1/20 of the run)."""
    items = list(loss_curve_panels(rows).items())
    if not items:
        return None
    fig, axes = _grid(len(items), 2, 7.5, 3.4)
    for ax, (title, members) in zip(axes.flat, items):
        lo = math.inf
        for i, r in enumerate(members):
            steps, curves = seed_curves(r)
            if not steps:
                continue
            w = max(len(steps) // 20, 1)
            smooth = [_smooth(ys, w) for ys in curves]
            mean = [sum(v) / len(v) for v in zip(*smooth)]
            color = "black" if r.is_sync else f"C{i % 10}"
            width = 1.4 if r.is_sync else 1.1
            ax.plot(steps, mean, lw=width, color=color, label=f"{r.label} ({len(curves)} seeds)")
            if len(curves) > 1:
                low, high = [min(v) for v in zip(*smooth)], [max(v) for v in zip(*smooth)]
                ax.fill_between(steps, low, high, color=color, alpha=0.15, lw=0)
            lo = min(lo, min(mean[len(mean) // 3 :]))
        if math.isfinite(lo):
            ax.set_ylim(lo - 0.05, lo + 1.0)
        ax.set_title(f"baseline: {title}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (smoothed)")
        _legend_outside(ax, 6)
        ax.grid(alpha=0.3)
    return _finish_grid(fig, axes, len(items))


def _tokens(r: Row) -> float:
    c = r.config
    return c.get("train.num_steps", 0) * c.get("train.batch_size", 0) * c.get("data.seq_len", 0)


def _uniform_delay(policy: str) -> bool:
    """Policies whose staleness is the same on every stage at every depth (fixed:N, and 2bw:
    tau = 1 everywhere, so 2bw's runs are the delay series' N = 1); the policy answers."""
    return same_delay_at_any_depth(policy)


def _delay(r: Row) -> float:
    return max(DelaySchedule.build(r.policy, int(r.config.get("pipeline.num_stages", 1))).max_tau)


AXES: dict[str, tuple[str, Callable[[Row], float]]] = {
    "momentum": ("beta1 (momentum)", lambda r: r.config.get("optim.beta1", math.nan)),
    "depth": ("pipeline stages P", lambda r: r.config.get("pipeline.num_stages", 1)),
    "delay": ("max staleness (steps)", _delay),
    "tokens": ("training tokens", _tokens),
    "lr": ("learning rate", lambda r: r.config.get("optim.lr", math.nan)),
    "batch_size": ("sequences per step", lambda r: r.config.get("train.batch_size", math.nan)),
    "weight_decay": ("weight decay", lambda r: r.config.get("optim.weight_decay", math.nan)),
}
# Keys that define the x-axis of each plot (excluded from the series label).
_AXIS_KEYS = {
    "momentum": ("optim.beta1",),
    "depth": ("pipeline.num_stages",),
    "delay": ("delay.policy",),
    "tokens": ("train.num_steps", "train.warmup_steps", "train.eval_every"),
    "lr": ("optim.lr",),
    "batch_size": ("train.batch_size",),
    "weight_decay": ("optim.weight_decay",),
}
_LOG_BASE = {"depth": 2, "delay": 2, "tokens": 10, "lr": 10, "batch_size": 2}
# Keys retuned at each x on the synchronous baseline: a series reads each x at the value whose
# sync run is best (the momentum study retunes the LR per beta1; RESULTS.md, study 2).
_TUNED_KEYS = {"momentum": ("optim.lr",)}


_SHOWN = (
    "optim.lr",
    "optim.beta1",
    "optim.beta2",
    "optim.weight_decay",
    "pipeline.num_stages",
    "train.batch_size",
    "train.num_steps",
)


def _points(series: dict[str, list[tuple[float, Row | None]]]) -> dict[str, list]:
    return {
        name: [(x, r.gap_diff, r.std) if r is not None else (x, 0.0, 0.0) for x, r in pts]
        for name, pts in series.items()
    }


def gap_series(rows: list[Row], kind: str) -> dict[str, list[tuple[float, Row | None]]]:
    """Series name -> [(x, row)] for unmitigated delayed rows with a gap, when x takes at least
    two values within a series. A series is a set of rows equal in everything but the x-axis
    keys. Depth series of pipedream start at P = 1 (sync by definition: row None, gap 0)."""
    _, fx = AXES[kind]
    cands = [
        r
        for r in rows
        if not r.is_sync
        and not r.mitigations
        and math.isfinite(r.gap_diff)
        and (kind != "delay" or _uniform_delay(r.policy))
    ]
    drop = _AXIS_KEYS[kind] + _TUNED_KEYS.get(kind, ())
    # a series is named by its optimizer, policy and the shown keys that differ from the value
    # most of that optimizer's rows have (so the main runs are just "adamw 2bw")
    usual: dict[tuple[str, str], Any] = {}
    for opt in {r.config.get("optim.name") for r in cands}:
        for k in _SHOWN:
            vals = [json.dumps(r.config.get(k)) for r in cands if r.config.get("optim.name") == opt]
            usual[(opt, k)] = Counter(vals).most_common(1)[0][0]
    series: dict[tuple, list[tuple[float, Row | None]]] = {}
    names: dict[tuple, str] = {}
    for r in cands:
        x = fx(r)
        if x is None or (isinstance(x, float) and math.isnan(x)):
            continue
        key = config_key(r.config, drop)
        names[key] = " ".join(
            [str(r.config.get("optim.name", ""))]
            + ([r.policy] if kind != "delay" else [])
            + [
                f"{k.split('.')[-1]}={r.config.get(k)}"
                for k in _SHOWN
                if k not in drop
                and json.dumps(r.config.get(k)) != usual[(r.config.get("optim.name"), k)]
            ]
        )
        series.setdefault(key, []).append((float(x), r))
    out = {}
    for k, pts in series.items():
        if kind == "delay":  # 2bw and fixed:1 are one delay: keep fixed:1 where both ran
            pts = list({x: (x, r) for x, r in sorted(pts, key=lambda p: p[1].policy)}.values())
        if kind in _TUNED_KEYS:
            pts = _tuned_on_sync(pts, rows, kind)
        pts.sort(key=lambda p: p[0])
        if kind == "depth" and " pipedream" in names[k] and pts[0][0] > 1:
            pts.insert(0, (1.0, None))  # pipedream at P = 1 is sync: gap 0 by definition
        if len({p[0] for p in pts}) >= 2:
            out[names[k]] = pts
    return out


def tuned_tags(
    series: dict[str, list[tuple[float, Row | None]]], kind: str
) -> dict[tuple[float, float], str]:
    """(x, gap) -> "lr=..." for the points of `gap_series` whose tuned setting varies with x
    (empty when nothing is tuned), to print beside the points."""
    tags = {}
    for pts in series.values():
        for key in _TUNED_KEYS.get(kind, ()):
            values = {json.dumps(r.config.get(key)) for _, r in pts if r is not None}
            if len(values) > 1:
                tags.update(
                    {
                        (x, r.gap_diff): f"{key.split('.')[-1]}={r.config.get(key):g}"
                        for x, r in pts
                        if r is not None
                    }
                )
    return tags


def _tuned_on_sync(
    pts: list[tuple[float, Row | None]], rows: list[Row], kind: str
) -> list[tuple[float, Row | None]]:
    """At each x, the delayed row at the setting of `_TUNED_KEYS[kind]` whose sync run is best
    (`results.best_row`); an x whose best sync setting has no delayed run is left out rather
    than read at a worse one."""
    drop = _AXIS_KEYS[kind] + _TUNED_KEYS[kind]
    _, fx = AXES[kind]
    out = []
    for x in sorted({x for x, _ in pts}):
        here = [r for xx, r in pts if xx == x and r is not None and r.baseline is not None]
        if not here:
            continue
        family = config_key(here[0].baseline.config, drop)
        syncs = [
            s
            for s in rows
            if s.is_sync and s.values and fx(s) == x and config_key(s.config, drop) == family
        ]
        best = best_row(syncs)
        out += [(x, r) for r in here if r.baseline is best]
    return out


def gap_plot(rows: list[Row], kind: str) -> bytes | None:
    """The gap to sync (mean over seeds; bars: std of the delayed runs) against `kind`."""
    series = gap_series(rows, kind)
    if not series:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for name, pts in _points(series).items():
        xs, ys, es = zip(*pts)
        es = [0.0 if not math.isfinite(e) else e for e in es]
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=name)
    tags = tuned_tags(series, kind)
    for (x, y), tag in tags.items():
        ax.annotate(tag, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=6)
    ax.axhline(0.0, color="black", lw=0.8)
    label = AXES[kind][0]
    ax.set_xlabel(label)
    if kind in _LOG_BASE:
        ax.set_xscale("log", base=_LOG_BASE[kind])
    ax.set_ylabel("final val loss gap to sync")
    ax.set_title(
        f"gap vs {label}" + (" (each point at its best LR on sync)" if tags else ""), fontsize=10
    )
    _legend_outside(ax, 8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return png_bytes(fig)


def overhead_panels(rows: list[Row]) -> list[Row]:
    """The delayed configurations `overhead_plot` draws: every one with a token overhead."""
    return [
        r
        for r in rows
        if r.token_overhead is not None
        and r.baseline is not None
        and r.token_overhead.mean_pair is not None
    ]


def overhead_plot(rows: list[Row], marks: int = 4) -> bytes | None:
    """One panel per delayed configuration with a token overhead: the seed-mean val loss
    against tokens of it and its sync baseline, the band of targets shaded, and at `marks`
    targets of the band an arrow from T_sync(L) to T_delayed(L) labelled with the multiplier
    (a cross at the sync point where the delayed run never gets there)."""
    items = overhead_panels(rows)
    if not items:
        return None
    fig, axes = _grid(len(items), 4, 4.6, 3.4)
    for ax, r in zip(axes.flat, items):
        o, base = r.token_overhead, r.baseline
        assert o is not None and o.mean_pair is not None and base is not None
        seeds = [p.seed for p in o.pairs]
        for row, style in ((base, dict(color="black", lw=1.4)), (r, dict(color="C3", lw=1.2))):
            curves = val_curves(row)
            pts = overhead.mean_curve([curves[s] for s in seeds if s in curves])
            if pts:
                ax.plot(*zip(*pts), marker=".", ms=3, label=row.label, **style)
        _mark_multipliers(ax, o.mean_pair, marks)
        ax.set_title(f"{r.label}: {o.describe()}", fontsize=9)
        ax.set_xlabel("tokens")
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
        ax.set_ylabel(f"val loss (mean of {len(seeds)} seed(s))")
        ax.legend(fontsize=6, loc="upper right", frameon=False)  # the curves fall to the lower left
        ax.grid(alpha=0.3)
    return _finish_grid(fig, axes, len(items))


def _mark_multipliers(ax: Any, pair: Any, marks: int) -> None:
    """Shade `pair`'s band and draw its iso-loss multipliers at `marks` evenly chosen targets."""
    if not pair.has_band:
        return
    top, bottom = pair.band
    ax.axhspan(bottom, top, color="C0", alpha=0.08, lw=0)
    n = len(pair.targets)
    for i in sorted({round(k * (n - 1) / max(marks - 1, 1)) for k in range(marks)}):
        L, ts, td, m = (
            pair.targets[i],
            pair.tokens_sync[i],
            pair.tokens_delayed[i],
            pair.multipliers[i],
        )
        if math.isfinite(td):
            ax.annotate(
                "", xy=(td, L), xytext=(ts, L), arrowprops=dict(arrowstyle="->", color="C0", lw=1)
            )
            ax.text(td, L, f" {m:.2f}x", va="center", fontsize=7, color="C0")
        else:
            ax.plot([ts], [L], "x", color="C0")
            ax.text(ts, L, " never", va="center", fontsize=7, color="C0")


def verdict_plot(
    schedules: list[tuple[str, float, str]],
    ratios: list[tuple[str, float, float, float, str]],
    title: str = "",
) -> bytes:
    """`stalepipe verdict`'s figure. Left: tokens/s per schedule (name, rate, policy), the
    asynchronous ones in red. Right: each configuration's time to target against the best
    synchronous schedule (label, ratio, low, high, overhead status) with its interval, 1 marked
    (left of it the asynchronous run gets there sooner); a floor or a missing multiplier is
    written in place of a point."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(11, max(3.2, 0.45 * max(len(schedules), len(ratios)) + 1.5))
    )
    names = [s[0] for s in schedules]
    left.barh(
        names,
        [s[1] for s in schedules],
        color=["C0" if never_delays(s[2]) else "C3" for s in schedules],
    )
    left.invert_yaxis()
    left.set_xlabel("tokens/s")
    left.set_title(title, fontsize=8)
    left.grid(alpha=0.3, axis="x")
    ys = list(range(len(ratios)))
    finite = [r for r in ratios if math.isfinite(r[1])]
    xmax = max([r[3] if math.isfinite(r[3]) else r[1] for r in finite] + [1.2]) * 1.1
    for y, (_, value, lo, hi, status) in zip(ys, ratios):
        if math.isfinite(value):
            err = [[value - lo], [hi - value]] if math.isfinite(lo) else None
            right.errorbar([value], [y], xerr=err, fmt="o", color="C3", capsize=3)
        else:
            right.text(1.0, y, f"  {status}", va="center", fontsize=8, color="C7")
    right.axvline(1.0, color="black", lw=0.8)
    right.set_yticks(ys, [r[0] for r in ratios])
    right.set_ylim(len(ratios) - 0.5, -0.5)
    right.set_xlim(0, xmax)
    right.set_xlabel("time to target: async / best sync (< 1: async sooner)")
    right.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return png_bytes(fig)
