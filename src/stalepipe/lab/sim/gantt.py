"""Gantt charts of simulated pipeline timelines (PNG, SVG or PDF, by the file's extension).

One panel per schedule, one row per rank (rank 0 on top), one box per action coloured by kind;
boxes are labelled with the microbatch (`j`, or `k.j` over several steps) when wide enough.
Odd chunks of a rank with several stages (interleaved, or the way back up of a V) are hatched.
"""

from __future__ import annotations

from typing import Any

from stalepipe.errors import UserError
from stalepipe.lab.sim.timing import Timeline, summarize
from stalepipe.lazy import require

COLORS = {
    "F": "#4C72B0",
    "B": "#55A868",
    "BI": "#2A9D8F",
    "BW": "#DD8452",
    "STEP": "#222222",
}
LABELS = {
    "F": "forward",
    "B": "backward",
    "BI": "backward (input grad)",
    "BW": "backward (weight grad)",
    "STEP": "optimizer step",
}


def plot_timelines(timelines: list[Timeline], path: str, *, title: str | None = None) -> None:
    """Draw `timelines` one above the other and save to `path` (.png, .svg or .pdf)."""
    if not path.lower().endswith((".png", ".svg", ".pdf")):
        raise UserError(f"plot file must end in .png, .svg or .pdf, got {path!r}")
    require("matplotlib", "--plot").use("Agg")
    import matplotlib.pyplot as plt  # optional (the plots extra): required above

    heights = [max(1.2, 0.32 * tl.schedule.num_ranks + 0.7) for tl in timelines]
    width = 14.0
    fig, axes = plt.subplots(
        len(timelines),
        1,
        figsize=(width, sum(heights) + 0.9),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    # A shared time axis makes schedules comparable at a glance.
    horizon = max(tl.makespan for tl in timelines) or 1.0
    kinds_used: set[str] = set()
    for ax, tl in zip(axes[:, 0], timelines):
        kinds_used |= _draw_panel(ax, tl, horizon, pts_per_unit=(width * 0.9 * 72) / horizon)
    unit = timelines[0].costs.time_unit
    axes[-1, 0].set_xlabel("time" + (" (s)" if unit == "s" else " (cost units)"), fontsize=8)
    handles = _legend_handles(timelines, kinds_used)
    fig_h = fig.get_figheight()
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.35 / fig_h, 1, 1 - (0.3 / fig_h if title else 0)))
    fig.savefig(path, dpi=150)
    plt.close(fig)


def _draw_panel(ax: Any, tl: Timeline, horizon: float, pts_per_unit: float) -> set[str]:
    """One schedule's rows of boxes on `ax`, labelled when wide enough; returns the action
    kinds drawn (for the legend)."""
    sched, res = tl.schedule, summarize(tl)
    kinds: set[str] = set()
    boxes: dict[tuple[int, str, bool], list[tuple[float, float]]] = {}
    for e in tl.events:
        a = e.action
        kinds.add(a.kind)
        dur = e.end - e.start
        if dur < horizon * 3e-3:  # (near) free optimizer step: a tick, so it stays visible
            ax.vlines(e.start, e.rank - 0.45, e.rank + 0.45, color=COLORS[a.kind], lw=1.2)
            continue
        odd = sched.chunk_of(a.stage) % 2 == 1
        boxes.setdefault((e.rank, a.kind, odd), []).append((e.start, dur))
        if a.kind == "STEP":
            continue
        label = f"{a.microbatch}" if sched.num_steps == 1 else f"{a.step}.{a.microbatch}"
        fits = [fs for fs in (6, 5) if dur * pts_per_unit > 0.62 * fs * len(label) + 1]
        if fits:
            ax.text(
                e.start + dur / 2,
                e.rank,
                label,
                ha="center",
                va="center",
                fontsize=fits[0],
                color="white",
            )
    for (rank, kind, odd), spans in boxes.items():  # one call per group: fast
        ax.broken_barh(
            spans,
            (rank - 0.4, 0.8),
            facecolors=COLORS[kind],
            edgecolor="white",
            linewidth=0.3,
            hatch="////" if odd else None,
        )
    ax.set_yticks(range(sched.num_ranks), [f"rank {r}" for r in range(sched.num_ranks)])
    ax.set_ylim(sched.num_ranks - 0.5, -0.5)
    ax.set_xlim(0, horizon * 1.005)
    ax.tick_params(labelsize=7)
    ax.set_title(
        f"{sched.name}  (P={sched.num_ranks}, stages={sched.num_stages}, "
        f"m={sched.num_microbatches}, steps={sched.num_steps}, policy={sched.policy}): "
        f"bubble {res.bubble:.1%}, steady-state bubble {res.steady_bubble:.1%}",
        fontsize=8,
        loc="left",
    )
    return kinds


def _legend_handles(timelines: list[Timeline], kinds_used: set[str]) -> list[Any]:
    """One patch per action kind drawn (in COLORS order), plus the hatch of odd chunks."""
    from matplotlib.patches import Patch  # optional: plot_timelines required it

    handles = [Patch(color=COLORS[k], label=LABELS[k]) for k in COLORS if k in kinds_used]
    if any(tl.schedule.num_chunks > 1 for tl in timelines):
        handles.append(
            Patch(
                facecolor="white",
                edgecolor="grey",
                hatch="////",
                label="odd chunks (several per rank)",
            )
        )
    return handles
