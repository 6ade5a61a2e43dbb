"""The text tables of `stalepipe simulate`: one row per schedule, or one per stage.

Times in the cost model's unit (ms for analytic costs), throughput in tokens/s or microbatches
per unit, memory per rank in GB (analytic costs) or units (uniform costs: `sim.memory`).
"""

from __future__ import annotations

from stalepipe.lab.sim.timing import CostModel, SimResult, Timeline

LEGEND = (
    "bubble: idle share of P x makespan; steady: per step once the pipeline is full; "
    "stash/versions/staleness: range over stages; memory: the largest rank's peak "
    "(weights x versions + optimizer state + stashed activations; docs/schedules.md)"
)


def _fmt_time(x: float, unit: str) -> str:
    return f"{x * 1e3:.1f} ms" if unit == "s" else f"{x:.2f}"


def _fmt_rate(x: float, tokens: bool) -> str:
    if not tokens:
        return f"{x:.4f} mb/u"
    return f"{x / 1e3:.1f}k tok/s" if x < 1e6 else f"{x / 1e6:.2f}M tok/s"


def _span(xs: tuple[int, ...]) -> str:
    lo, hi = min(xs), max(xs)
    return str(hi) if lo == hi else f"{lo}-{hi}"


def _memory_head(costs: CostModel, memory_limit: float | None) -> list[str]:
    """The memory columns: GB per rank (and whether it fits) for bytes, weights and
    activations per rank for units, none without sizes."""
    if not costs.has_memory:
        return []
    if costs.memory_unit == "unit":
        return ["weights/rank", "act/rank"]
    return ["mem/rank GB"] + ([f"fits {memory_limit / 1e9:.0f} GB"] if memory_limit else [])


def _memory_cells(r: SimResult, memory_limit: float | None) -> list[str]:
    """The memory columns of one row (the largest rank's peaks)."""
    if r.memory_unit == "unit":
        return [f"{max(m.weights for m in r.rank_memory):.3g}"] + [
            f"{max(m.activations for m in r.rank_memory):.3g}"
        ]
    peak = max(r.peak_memory)
    return [f"{peak / 1e9:.1f}"] + (
        ["yes" if peak <= memory_limit else "no"] if memory_limit else []
    )


def format_table(
    rows: list[tuple[str, SimResult | str]],
    costs: CostModel,
    memory_limit: float | None = None,
) -> str:
    """One row per schedule; a string result is a refusal message. `memory_limit` (bytes)
    adds a column saying whether the largest rank's peak fits."""
    tokens = costs.tokens_per_microbatch > 0
    mem = _memory_head(costs, memory_limit)
    head = [
        "schedule",
        "policy",
        "stages",
        "steps",
        "makespan",
        "throughput",
        "bubble",
        "steady bubble",
        "steady thrpt",
        "stash/stage",
        "versions",
        "staleness",
    ] + mem
    table = [head]
    for name, r in rows:
        if isinstance(r, str):
            table.append([name, f"refused: {r}"])
            continue
        unit = costs.time_unit
        row = [
            name,
            r.policy,
            f"{r.num_ranks}x{r.num_stages // r.num_ranks}"
            if r.num_stages > r.num_ranks
            else str(r.num_ranks),
            str(r.num_steps),
            _fmt_time(r.makespan, unit),
            _fmt_rate(r.throughput, tokens),
            f"{r.bubble:.1%}",
            f"{r.steady_bubble:.1%}",
            _fmt_rate(r.steady_throughput, tokens),
            _span(r.peak_activations),
            _span(r.peak_versions),
            _span(r.staleness),
        ] + (_memory_cells(r, memory_limit) if mem else [])
        table.append(row)
    widths = [
        max(len(row[i]) for row in table if i < len(row) and len(row) > 2) for i in range(len(head))
    ]
    lines = []
    for row in table:
        if len(row) == 2:  # refusal: free text after the name
            lines.append(f"{row[0]:<{widths[0]}}  {row[1]}")
        else:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def format_stages(tl: Timeline, r: SimResult) -> str:
    """Per-stage detail of one schedule: costs, stash, versions, staleness, and the memory of
    the stage's rank (its peak, all its stages together)."""
    c, sched = tl.costs, tl.schedule
    mem, gb = c.has_memory, c.memory_unit == "B"
    head = ["stage", "rank", "F", "BI", "BW", "opt", "stash", "versions", "tau"] + (
        [("rank mem GB" if gb else "rank mem w/a")] if mem else []
    )
    table = [head]
    for s in range(sched.num_stages):
        row = [str(s), str(sched.rank_of(s))]
        row += [
            _fmt_time(x[s], c.time_unit)
            for x in (c.forward, c.backward_input, c.backward_weight, c.optimizer)
        ]
        row += [str(r.peak_activations[s]), str(r.peak_versions[s]), str(r.staleness[s])]
        held = r.rank_memory[sched.rank_of(s)]
        if mem:
            row.append(
                f"{held.total / 1e9:.1f}" if gb else f"{held.weights:.3g}/{held.activations:.3g}"
            )
        table.append(row)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in table)
