"""The decision block `stalepipe verdict` prints by default (issue 40): what a team acts on, in
at most `MAX_LINES` lines of at most `WIDTH` characters; the tables go to verdict.md and
verdict.csv (and to stdout with `--verbose`).

Per configuration with a verdict (3 seeds or more), the fastest first: its verdict ("too close
to call" where the time ratio's interval holds 1), the time to sync's final loss against the
best synchronous configuration with its interval (over the seeds and, with the cluster model,
the ends of its assumptions' ranges), the token overhead and the model size it was measured
on; then the overhead at which the answer flips (2BW's throughput edge, with its range: a lower
overhead makes async sooner) and what the intervals cover.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from stalepipe.verdict.rule import Verdict

MAX_LINES, WIDTH = 20, 120
SHOWN = 10  # configurations listed; the rest are counted


def plain(verdict: str) -> str:
    """The verdict's words for a decision: an interval holding 1 is too close to call."""
    if verdict.startswith("inconclusive (interval holds 1"):
        return "too close to call"
    return verdict.split(" (")[0]


def _key(v: Verdict) -> float:
    return v.ratio.value if math.isfinite(v.ratio.value) else math.inf


def given_overhead(text: str) -> tuple[float, float, float, str]:
    """`--overhead X,LOW,HIGH[@SIZE]`: a token overhead with its interval from elsewhere (the
    size ladder's fit at the target model, `benchmarks/studies/ladder_fit.py`; the paper's), and the
    model size it is for. One-line UserError naming the form otherwise."""
    from stalepipe.errors import UserError

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
    return x, low, high, size.strip()


def _given_line(best: Verdict, given: tuple[float, float, float, str]) -> str:
    """What the answer is at a given overhead: its time ratio against the best synchronous
    configuration over its interval and the edge's range, and the call."""
    x, low, high, size = given
    lo_f, hi_f = best.edge_factors
    ratio = (x / best.speedup, low / (best.speedup * hi_f), high / (best.speedup * lo_f))
    call = (
        "async sooner" if ratio[2] < 1 else "sync sooner" if ratio[1] > 1 else "too close to call"
    )
    at = f" @ {size}" if size else ""
    return (
        f"at the given overhead {x:.2f}x [{low:.2f}, {high:.2f}]{at} (--overhead): time to target "
        f"{ratio[0]:.2f}x [{ratio[1]:.2f}, {ratio[2]:.2f}], {call}"
    )


def decision_block(
    verdicts: Sequence[Verdict], title: str, given: tuple[float, float, float, str] | None = None
) -> str:
    """The block (module docstring); every line cut to `WIDTH`. `given`: an overhead from
    elsewhere (`given_overhead`), judged against the same best synchronous configuration."""
    judged = sorted(
        (v for v in verdicts if v.target is not None and len(v.target.seeds) >= 3), key=_key
    )
    lines = [f"decision: {title}"]
    best = next((v for v in judged if v.best_sync is not None), None)
    if best is not None and best.best_sync is not None:
        lines.append(
            f"best synchronous: {best.best_sync.shown()} ({best.best_sync.rate_text()} tok/s); "
            f"2BW's throughput edge over it {best.speedup:.3f}x"
        )
    if not judged:
        lines.append("no configuration has the 3 seeds a verdict needs: every one is inconclusive")
    head = f"{'configuration':<22} {'verdict':<17} {'time to target':<19} token overhead"
    lines += [head] if judged else []
    for v in judged[:SHOWN]:
        assert v.target is not None
        lines.append(
            f"{v.label[:22]:<22} {plain(v.verdict):<17} {v.ratio_all.text():<19} {v.target.describe()} "
            f"@ {v.measured_on} ({len(v.target.seeds)} seeds)"
        )
    if best is not None and math.isfinite(best.speedup):
        lo, hi = (best.speedup * f for f in best.edge_factors)
        span = f", {lo:.3f}-{hi:.3f}x over the assumptions" if (lo, hi) != (hi, hi) else ""
        lines.append(
            f"a token overhead below 2BW's edge ({best.speedup:.3f}x{span}) makes async sooner"
        )
    if given is not None and best is not None and math.isfinite(best.speedup):
        lines.append(_given_line(best, given))
    rest = len(verdicts) - min(len(judged), SHOWN)
    if rest:
        lines.append(f"... {rest} more configuration(s) (fewer seeds, or past the first {SHOWN})")
    ranged = best is not None and best.edge_factors != (1.0, 1.0)
    lines.append(
        "intervals cover the seeds, and MFU, link efficiency and overlap cost over their ranges "
        "(docs/verdict.md)"
        if ranged
        else "intervals cover the seeds only: the throughputs are point values"
    )
    return "\n".join(line[:WIDTH] for line in lines[:MAX_LINES])
