"""The decision block `stalepipe verdict` prints by default (issue 40): what a team acts on, in
at most `MAX_LINES` lines of at most `WIDTH` characters (a longer line wraps); the tables go to verdict.md and
verdict.csv (and to stdout with `--verbose`).

Per configuration with a verdict (3 seeds or more), the fastest first: its verdict ("too close
to call" where the time ratio's interval holds 1), the time to sync's final loss against the
best synchronous configuration with its interval (over the seeds and, with the cluster model,
the ends of its assumptions' ranges), the token overhead and the model size it was measured
on; then the overhead at which the answer flips (2BW's throughput edge, with its range: a lower
overhead makes async sooner), a given overhead judged (`--overhead`, or the size ladder's fit at
a target size, `--overhead-fit`) and what the intervals cover. A lengths sweep's longer runs,
each judged against sync at its own length (`Verdict.at_length`), are counted in one line and
left to the tables: their configuration's row already reads its overhead over all its lengths.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stalepipe.errors import UserError
from stalepipe.lab.analysis import overhead_ladder, scaling
from stalepipe.lab.verdict.rule import Transfer, Verdict, size_text

MAX_LINES, WIDTH = 20, 120
SHOWN = 10  # configurations listed at most (fewer where the block would pass MAX_LINES); the
# rest are counted
TOO_WIDE = 10  # a given overhead's time ratio whose interval leaves [x / 10, 10 x] and holds 1
# says nothing, not "too close": the size ladder's rule for the paper's figures (docs/RESULTS.md)


def plain(verdict: str) -> str:
    """The verdict's words for a decision: an interval holding 1 is too close to call."""
    if verdict.startswith("too close to call (interval holds 1"):
        return "too close to call"
    if verdict.startswith("inconclusive at the target size"):
        return "inconclusive at target size"
    return verdict.split(" (")[0]


def _key(v: Verdict) -> float:
    return v.ratio.value if math.isfinite(v.ratio.value) else math.inf


@dataclass(frozen=True)
class GivenOverhead:
    """A token overhead from elsewhere with its interval (`--overhead`, or the size ladder's
    fit at a target size, `--overhead-fit`), judged against the same best synchronous
    configuration."""

    x: float
    low: float
    high: float
    size: str  # the model size it is for ("" unknown)
    source: str  # the option it came from
    note: str = ""  # what the fit is, on a line of its own
    root: str = ""  # --overhead-fit: the ladder's directory (the fit is read again per size)


def fit_transfer(g: GivenOverhead, measured_n: int) -> Transfer:
    """With `--overhead-fit`, the overhead's transfer from a run's model (`measured_n`
    non-embedding parameters) to the target size: the ladder's 95 % prediction interval at the
    target over its fitted overhead at the measured size (issue 52, item 4)."""
    at_measured = overhead_ladder.overhead_at(Path(g.root), measured_n)[0]
    return Transfer(
        g.low / at_measured,
        g.high / at_measured,
        size_text(measured_n),
        g.size,
        "--overhead-fit: the ladder's 95% prediction interval over its fit at the measured size",
    )


def given_overhead(text: str) -> GivenOverhead:
    """`--overhead X,LOW,HIGH[@SIZE]`: a token overhead with its interval from elsewhere (the
    paper's, a run of one's own), and the model size it is for. One-line UserError naming the
    form otherwise."""
    numbers, _, size = text.partition("@")
    try:
        x, low, high = (float(v) for v in numbers.split(","))
    except ValueError:
        x = low = high = math.nan
    if not (0 < low <= x <= high):
        raise UserError(
            f"--overhead {text!r}: give the overhead and its interval as X,LOW,HIGH with "
            "0 < LOW <= X <= HIGH, optionally @SIZE (e.g. 1.05,1.01,1.10@360M)"
        )
    return GivenOverhead(x, low, high, size.strip(), "--overhead")


def fitted_overhead(text: str) -> GivenOverhead:
    """`--overhead-fit LADDER_DIR@SIZE`: the registered fit of Muon+EF's token overhead over the
    overhead ladder's runs in LADDER_DIR (one token budget at every width;
    `analysis.overhead_ladder.overhead_at`), predicted at SIZE (135M, 360M or a number of
    non-embedding parameters) with its 95 % prediction interval."""
    root, at, size = text.rpartition("@")
    if not at or not root or not Path(root).is_dir():
        missing = f"{root} is not a directory; " if at and root else ""
        raise UserError(
            f"--overhead-fit {text!r}: {missing}give the size ladder's run directory and the "
            "target size as LADDER_DIR@SIZE (e.g. docs/results/overhead-ladder@360M)"
        )
    n = scaling.target_size(size)
    x, low, high, what = overhead_ladder.overhead_at(Path(root), n)
    size = f"{n / 1e6:.0f}M" if n >= 10**6 else f"{n:,}"
    return GivenOverhead(x, low, high, size, "--overhead-fit", what, root)


def given(overhead: str, overhead_fit: str) -> GivenOverhead | None:
    """The overhead `--overhead` or `--overhead-fit` gives (at most one of them), or None."""
    if overhead and overhead_fit:
        raise UserError("give --overhead or --overhead-fit, not both")
    if overhead:
        return given_overhead(overhead)
    return fitted_overhead(overhead_fit) if overhead_fit else None


def _num(x: float, places: int) -> str:
    """`x` with `places` decimals, or as a power of ten past 1000 (an interval a fit with one
    degree of freedom gives can reach 1e14: printed, not hidden)."""
    return f"{x:.{places}f}" if abs(x) < 1000 else f"{x:.1e}"


def _given_lines(best: Verdict, given: GivenOverhead) -> list[str]:
    """What the answer is at a given overhead: its time ratio against the best synchronous
    configuration over its interval and the edge's range, and the call."""
    lo_f, hi_f = best.edge_factors
    g = given
    ratio = (g.x / best.speedup, g.low / (best.speedup * hi_f), g.high / (best.speedup * lo_f))
    call = (
        "async sooner" if ratio[2] < 1 else "sync sooner" if ratio[1] > 1 else "too close to call"
    )
    wide = not ratio[0] / TOO_WIDE <= ratio[1] <= ratio[2] <= ratio[0] * TOO_WIDE
    if call == "too close to call" and wide:  # not a near tie: the overhead is unknown
        call = "inconclusive (too wide)"
    elif g.source == "--overhead-fit" and g.low <= best.speedup <= g.high:
        # the fit's interval alone holds the flip point: the size, not the tie, decides
        call = "inconclusive at the target size (the fit's interval holds the flip point)"
    at = f" @ {g.size}" if g.size else ""
    head = (
        f"given overhead {g.x:.3f}x [{_num(g.low, 3)}, {_num(g.high, 3)}]{at} ({g.source}): "
        f"time to target {ratio[0]:.2f}x [{_num(ratio[1], 2)}, {_num(ratio[2], 2)}] (bound),"
    )
    lines = [f"{head} {call}"] if len(head) + len(call) < WIDTH else [head, f"  call: {call}"]
    return lines + ([f"  that overhead: {g.note}"] if g.note else [])


def _covers(v: Verdict | None) -> list[str]:
    """What the time-to-target intervals cover and what they are (a bound, or the seeds' CI),
    and the overhead's transfer to the target size with where its range comes from."""
    if v is None or v.interval_kind == "95% CI":
        return [
            "intervals: the seeds' 95% CI only (throughputs are point values, no size transfer)"
        ]
    terms = ["the seeds' 95% CI"]
    terms += ["MFU, link efficiency, overlap cost"] if v.edge_factors != (1.0, 1.0) else []
    terms += [f"model error +-{v.model_error:.0%}"] if v.model_error else []
    terms += ["size transfer"] if not v.transfer.none else []
    out = [f"bound: worst case of {', '.join(terms)} (stacked, not a 95% CI)"]
    if v.model_error:
        out.append(
            f"model error: the throughput model's held-out median |error| on published runs, "
            f"+-{v.model_error:.0%} on 2BW's edge (docs/verdict.md)"
        )
    if not v.transfer.none:
        out.append(f"size transfer of the overhead {v.transfer.text()}")
    return out


def decision_block(
    verdicts: Sequence[Verdict], title: str, given: GivenOverhead | None = None
) -> str:
    """The block (module docstring); a line longer than `WIDTH` wraps. `given`: an overhead from
    elsewhere (`given_overhead`), judged against the same best synchronous configuration.

    The block lists the fastest configurations, up to `SHOWN`, as many as leave it within
    `MAX_LINES` once wrapped (the rest are counted): what it says after the table (the flip
    point, the arms' edges, what the intervals cover) is never cut. With one configuration it
    may pass `MAX_LINES` rather than lose a line."""
    for shown in range(SHOWN, 0, -1):
        lines = _wrapped(_block(verdicts, title, given, shown))
        if len(lines) <= MAX_LINES:
            break
    return "\n".join(lines)


def _block(
    verdicts: Sequence[Verdict], title: str, given: GivenOverhead | None, shown: int
) -> list[str]:
    """`decision_block`'s lines, before wrapping, listing the `shown` fastest configurations."""
    headline = [v for v in verdicts if not v.at_length]
    judged = sorted(
        (v for v in headline if v.target is not None and len(v.target.seeds) >= 3), key=_key
    )
    lines = [f"decision: {title}"]
    best = next((v for v in judged if v.best_sync is not None), None)
    # the arm whose optimizer the best configuration's throughputs are costed with
    name = best.arm.label() if best is not None and best.arm is not None else ""
    arm, of = (f"{name} ", f" ({name})") if name else ("", "")
    if best is not None and best.best_sync is not None:
        sync = best.best_sync
        head = f"best synchronous{of}: {sync.shown()} ({sync.rate_text()} tok/s)"
        edge = f"2BW's throughput edge over it {best.speedup:.3f}x"
        fits = len(head) + len(edge) + 2 <= WIDTH  # a long configuration: two lines
        lines += [f"{head}; {edge}"] if fits else [head, f"  {edge}"]
    if not judged:
        lines.append("no configuration has the 3 seeds a verdict needs: every one is inconclusive")
    kind = judged[0].interval_kind if judged else ""
    head = (
        f"{'configuration':<22} {'verdict':<27} {f'time to target ({kind})':<22} seeds  "
        "token overhead (95% CI)"
    )
    lines += [head] if judged else []
    for v in judged[:shown]:
        assert v.target is not None
        overhead = v.target.describe().replace(" seeds short", " short")
        lines.append(
            f"{v.label[:22]:<22} {plain(v.verdict):<27} {v.ratio_all.text():<22} "
            f"{len(v.target.seeds):>5}  {overhead} @ {v.measured_on}"
        )
    if best is not None and math.isfinite(best.speedup):
        lo, hi = (best.speedup * f for f in best.edge_factors)
        span = f", {lo:.3f}-{hi:.3f}x over the assumptions" if (lo, hi) != (hi, hi) else ""
        at = f" at {best.transfer.target}" if best.transfer.target else ""
        if hi < 1:  # an overhead is at least 1: no size makes async sooner here
            lines.append(
                f"{arm}2BW's edge ({best.speedup:.3f}x{span}) is below 1: sync is sooner at any "
                f"overhead{at}"
            )
        else:
            lines.append(
                f"a {arm}token overhead{at} below 2BW's edge ({best.speedup:.3f}x{span}) makes "
                f"async sooner"
            )
        lines += _arm_lines(judged)
    if given is not None and best is not None and math.isfinite(best.speedup):
        lines += _given_lines(best, given)
    rest = len(headline) - min(len(judged), shown)
    if rest:
        lines.append(f"... {rest} more configuration(s) (fewer seeds, or past the first {shown})")
    longer = [plain(v.verdict) for v in verdicts if v.at_length]
    if longer:
        calls = ", ".join(f"{longer.count(c)} {c}" for c in sorted(set(longer)))
        lines.append(
            f"{len(longer)} longer lengths judged against sync at the same length ({calls}): "
            "verdict.md"
        )
    lines += _covers(best or (judged[0] if judged else None))
    return lines


def _arm_lines(judged: list[Verdict]) -> list[str]:
    """2BW's throughput edge of each arm, each costed with its own optimizer (the cluster
    model), and what its update takes a step on the best synchronous and the best 2BW
    configuration; none where the throughputs are not per arm."""
    first: dict = {}
    for v in judged:
        if v.arm is not None and math.isfinite(v.speedup):
            first.setdefault(v.arm, v)
    parts = []
    for arm, v in first.items():
        s, a = v.best_sync, v.async_row
        times = [x.update * 1e3 for x in (s, a) if x is not None]
        took = f" ({times[0]:.2f} / {times[1]:.2f} ms)" if len(times) == 2 else ""
        parts.append(f"{arm.label()} {v.speedup:.3f}x{took}")
    if not parts:
        return []
    return [
        "2BW's edge by arm, each costed with its optimizer (its update a step, best sync / 2BW): "
        + ", ".join(parts)
    ]


def _wrapped(lines: list[str]) -> list[str]:
    """Each line as it is when it fits in `WIDTH`, else wrapped at spaces onto indented
    continuation lines (never cut mid-word)."""
    out: list[str] = []
    for line in lines:
        if len(line) <= WIDTH:
            out.append(line)
            continue
        out += textwrap.wrap(
            line, WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False
        )
    return out
