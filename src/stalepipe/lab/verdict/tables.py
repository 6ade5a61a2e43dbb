"""The verdict's tables in text, CSV and JSON (`verdict.md`, `verdict.csv`, `--json`): one row
per configuration (the summary) or per (configuration, synchronous schedule) (the CSV).

One label per interval everywhere (issue 52, item 4): a token overhead's interval is the seeds'
95% CI; a time to target's is the one the verdict was called on (`Verdict.ratio_all`), labelled
by `Verdict.interval_kind` ("95% CI" when only the seeds enter it, "bound" when the assumptions'
corners or the overhead's transfer to the target size are stacked on it). The seeds' CI of the
time to target alone is printed only under its own label (`..._ci_...` in the CSV and JSON).
"""

from __future__ import annotations

import math
from typing import Any

from stalepipe.fileio import csv_text
from stalepipe.lab.verdict.rule import RULE, Estimate, Verdict
from stalepipe.lab.verdict.throughput import Throughputs
from stalepipe.training.delay.policies import never_delays


def align(rows: list[list[str]]) -> str:
    """Rows of cells as left-aligned text columns (the first row is the header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


SUMMARY_HEADER = [
    *("configuration", "token overhead at sync's final loss (95% CI)", "band median"),
    *("seeds @ model", "best sync", "throughput async/sync", "time to target"),
    *("interval", "verdict"),
]


def summary_rows(verdicts: list[Verdict]) -> list[list[str]]:
    """One row per configuration, against the best synchronous schedule: the time to target
    with the interval its verdict was called on, and that interval's label."""
    return [
        [
            v.label,
            v.target.describe() if v.target else "-",
            v.overhead.describe(),
            f"{len(v.target.seeds) if v.target else v.overhead.num_seeds} @ {v.measured_on}",
            f"{v.best_sync.shown()}: {v.best_sync.rate_text()} tok/s" if v.best_sync else "-",
            f"{v.speedup:.3f}" if math.isfinite(v.speedup) else "-",
            v.ratio_all.text(),
            v.interval_kind if math.isfinite(v.ratio.value) else "-",
            v.verdict,
        ]
        for v in verdicts
    ]


def detail_rows(v: Verdict, tp: Throughputs) -> list[list[str]]:
    """One configuration's table: every schedule, its throughput and memory, and the async
    schedule's time to target against each synchronous one (its interval labelled)."""
    head = [
        *("schedule", "policy", "tokens/s", "bubble", "peak mem/rank GB", "fits"),
        f"{v.schedule} time to target vs it ({v.interval_kind})",
    ]
    out = [head]
    for s in (v.throughputs or tp).rows:  # its arm's, costed with its optimizer
        if not never_delays(s.policy) and s is not v.async_row:
            continue  # another delay policy's schedule, or another P of it
        name = s.shown() + (" (best sync)" if v.best_sync and s.name == v.best_sync.name else "")
        if s.refused:
            out.append([name, s.policy, "refused: " + s.refused, "", "", "", ""])
            continue
        rate = v.async_tokens_per_s if s is v.async_row else s.tokens_per_s
        shown = v.ratio_against(s).text() if s.name in v.ratios else "-"
        out.append(
            [name, s.policy, s.rate_text(rate), s.bubble_text(), s.memory_text(), s.fits_text(),
             shown]
        )  # fmt: skip
    return out


def intervals_line(verdicts: list[Verdict]) -> str:
    """What the time-to-target intervals are, in one 'inputs' line."""
    v = next((v for v in verdicts if not v.at_length), verdicts[0] if verdicts else None)
    if v is None or v.interval_kind == "95% CI":
        return "time-to-target intervals: the seeds' 95% CI (the throughputs are point values)"
    parts = ["the seeds' 95% CI"]
    if v.edge_factors != (1.0, 1.0):
        parts.append("MFU, link efficiency and overlap cost at their ranges' corners")
    if not v.transfer.none:
        parts.append(f"the overhead's transfer {v.transfer.text()}")
    return "time-to-target intervals: a worst-case bound (not a 95% interval) over " + ", ".join(
        parts
    )


def format_verdict(
    verdicts: list[Verdict], skipped: list[str], tp: Throughputs, inputs: list[str]
) -> str:
    """The text `stalepipe verdict` prints: inputs, the summary table, one table per
    configuration, what was left out, and the rule."""
    out = ["inputs:", *(f"  {line}" for line in inputs), ""]
    out += [align([SUMMARY_HEADER, *summary_rows(verdicts)]), ""]
    for v in verdicts:
        windows = (
            f"; {v.sync_window_share:.0%} of its steps in sync windows, at the flushed rate"
            if v.sync_window_share
            else ""
        )
        out += [
            f"{v.label} (vs {v.baseline}): token overhead at sync's final loss "
            f"{v.target.describe() if v.target else '-'}, over the band {v.overhead.describe()}, "
            f"{v.overhead.num_seeds} seed(s){windows}",
            align(detail_rows(v, tp)),
            "",
        ]
    out += [f"no verdict: {s}" for s in skipped]
    out += [RULE]
    return "\n".join(out)


CSV_HEADER = [
    *("configuration", "baseline", "async_schedule", "token_overhead"),
    *("token_overhead_ci_low", "token_overhead_ci_high", "token_overhead_status"),
    *("band_token_overhead", "band_token_overhead_status", "seeds", "measured_on_params"),
    *("sync_schedule", "best_sync", "async_tokens_per_s", "sync_tokens_per_s", "time_to_target"),
    # the seeds' 95% CI alone; then the interval the verdict is called on and its label
    *("time_to_target_ci_low", "time_to_target_ci_high"),
    *("time_to_target_low", "time_to_target_high", "time_to_target_interval"),
    *("transfer_low", "transfer_high", "transfer_source"),
    *("async_peak_memory_gb", "sync_peak_memory_gb", "throughput_source", "verdict"),
]


def verdict_csv(verdicts: list[Verdict], tp: Throughputs) -> str:
    """verdict.csv's text: one row per (configuration, synchronous schedule)."""
    rows: list[list[object]] = [CSV_HEADER]
    for v in verdicts:
        a, t = v.async_row, v.transfer
        for s in (v.throughputs or tp).sync():  # its arm's (`Verdict.throughputs`)
            r = v.ratios[s.name]
            called = v.ratio_against(s)
            rows.append(
                [
                    *(v.label, v.baseline, v.schedule, *_target_cells(v), v.overhead.estimate),
                    *(v.overhead.status, v.overhead.num_seeds, v.measured_on, s.name),
                    v.best_sync is not None and s.name == v.best_sync.name,
                    *(v.async_tokens_per_s, s.tokens_per_s, r.value, r.low, r.high),
                    *(called.low, called.high, v.interval_kind, t.low, t.high, t.source),
                    *(a.memory_list() if a else "", s.memory_list(), s.source, v.verdict),
                ]
            )
    return csv_text(rows)


def _target_cells(v: Verdict) -> list[object]:
    """The final-loss overhead's estimate, interval and status ('short': a bound) for the CSV."""
    e = Estimate.of(v.target) if v.target else None
    if e is None:
        return [math.nan, math.nan, math.nan, "no pairs"]
    return [e.bound if e.status == "short" else e.value, e.low, e.high, e.status]


def verdict_json(verdicts: list[Verdict], inputs: list[str], skipped: list[str]) -> dict[str, Any]:
    """`--json`: the inputs, and per configuration what the summary table prints; the time to
    target's interval (`time_to_target_interval`: [value, low, high]) is the one the verdict
    was called on, labelled by `interval`; `time_to_target_ci` is the seeds' 95% CI alone."""
    keys = ["configuration", "token_overhead", "band", "seeds", "best_sync",
            "throughput_ratio", "time_to_target", "interval", "verdict"]  # fmt: skip
    rows = [dict(zip(keys, row)) for row in summary_rows(verdicts)]

    def finite(*xs: float) -> list[float | None]:
        return [x if math.isfinite(x) else None for x in xs]

    for row, v in zip(rows, verdicts):
        row["seeds"], row["measured_on_params"] = row["seeds"].split(" @ ")
        row["best_sync_tokens_per_s"] = v.best_sync.tokens_per_s if v.best_sync else None
        row["async_tokens_per_s"] = v.async_tokens_per_s
        row["async_config"] = v.async_row.shown() if v.async_row else v.schedule
        row["time_to_target_interval"] = finite(*_values(v.ratio_all))
        row["time_to_target_ci"] = finite(*_values(v.ratio))
        row["transfer"] = [v.transfer.low, v.transfer.high, v.transfer.source]
        # the optimizer its throughputs are costed with (None: not per arm; `sim.optimizer`)
        row["arm"] = v.arm.label() if v.arm is not None else None
    return {"inputs": inputs, "skipped": skipped, "verdicts": rows}


def _values(r: Any) -> tuple[float, float, float]:
    return r.value, r.low, r.high
