"""The decision block `stalepipe verdict` prints by default (issue 40): what a team acts on, in
at most `MAX_LINES` lines of at most `WIDTH` characters; the tables go to verdict.md and
verdict.csv (and to stdout with `--verbose`).

Per configuration with a verdict (3 seeds or more), the fastest first: its verdict ("too close
to call" where the time ratio's interval holds 1), the time to sync's final loss against the
best synchronous configuration with its interval, the token overhead and the model size it was
measured on; then the overhead at which the answer flips (2BW's throughput edge: a lower
overhead makes async sooner) and what the intervals do not cover.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from stalepipe.analysis.verdict_rule import Verdict

MAX_LINES, WIDTH = 20, 120
SHOWN = 10  # configurations listed; the rest are counted


def plain(verdict: str) -> str:
    """The verdict's words for a decision: an interval holding 1 is too close to call."""
    if verdict.startswith("inconclusive (interval holds 1"):
        return "too close to call"
    return verdict.split(" (")[0]


def _ratio(v: Verdict) -> str:
    r = v.ratio
    if not math.isfinite(r.value):
        return "-"
    ci = f" [{r.low:.2f}, {r.high:.2f}]" if math.isfinite(r.low) else ""
    return f"{r.value:.2f}x{ci}"


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
            f"{v.label[:22]:<22} {plain(v.verdict):<17} {_ratio(v):<19} {v.target.describe()} "
            f"@ {v.measured_on} ({len(v.target.seeds)} seeds)"
        )
    if best is not None and math.isfinite(best.speedup):
        lines.append(f"a token overhead below 2BW's edge ({best.speedup:.3f}x) makes async sooner")
    rest = len(verdicts) - min(len(judged), SHOWN)
    if rest:
        lines.append(f"... {rest} more configuration(s) (fewer seeds, or past the first {SHOWN})")
    lines.append(
        "intervals cover the seeds only: the cluster model's link speeds, MFU and overlap are "
        "fixed assumptions (docs/verdict.md)"
    )
    return "\n".join(line[:WIDTH] for line in lines[:MAX_LINES])
