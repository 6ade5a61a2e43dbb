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


def decision_block(verdicts: Sequence[Verdict], title: str) -> str:
    """The block (module docstring); every line cut to `WIDTH`."""
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
