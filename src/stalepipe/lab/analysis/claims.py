"""The rule that labels the paper's qualitative claims, and what every claim function shares.

A claim function takes the rows of `results.build_rows` and returns `Finding`s: none when the
configurations it needs are absent, several when it checks one series or one configuration
each (momentum per optimizer, EF per optimizer). A finding says what was measured (does the
claimed effect hold in direction and size), its test's p-value (paired by seed where seeds
pair) and what could make it unreadable. `label` then corrects the p-values of one table
together (Holm-Bonferroni) and applies `RULE`, the written rule docs/RESULTS.md states.

Each claim function lives in the module of the study that owns it (`studies/optimizers.py`,
`studies/mitigations.py`, ...), which names it in its `Study.claims`; `report.claims` runs
every claim some study declares (`studies/registry.py:declared_claims`), in the studies'
order, on whatever rows exist. Here: the findings, the rule, and the helpers the claims share
(per-seed gaps, the regime check of the arms a claim reads, the scale a miss states, the
paper's size of a share).

The studies import this module, and `stalepipe --help` imports the studies: `results` and
`plots` (numpy and the records' readers, a tenth of a second) are imported inside the
functions that need them, here and in the claims.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from stalepipe.config import ModelConfig
from stalepipe.config.shapes import count_params
from stalepipe.lab.analysis import stats
from stalepipe.lab.analysis.regime import UNREAD, regime_check
from stalepipe.lab.analysis.stats import fmt_p

if TYPE_CHECKING:
    from stalepipe.lab.analysis.results import Row

ALPHA = 0.05
HEADLINE_SEEDS = 5  # the paper's headline claims: AdamW's gap >> Muon's; EF recovers most
SEEDS = 3  # every other claim
# A size label is refused where the share's 95 % interval is more than this many times as wide
# as the paper's range (issue 51; chosen after the data, docs/RESULTS.md names what it changes)
SIZE_WIDTH_FACTOR = 2.0

RULE = (
    "Labels: **inconclusive** when a claim cannot be read (too few points or seeds: "
    f"{HEADLINE_SEEDS} for the headline claims, {SEEDS} for the others), its test is not "
    f"significant after Holm-Bonferroni over the table (corrected p >= {ALPHA}), or a regime "
    "check of an arm it reads cannot be read (**inconclusive (unread ...)**: the runs' token "
    "data not found; an unread check is never a pass), or the measured effect misses the "
    "claim but a confound is named (**inconclusive (misses the claim, confounded ...)**); else "
    "**not reproduced** when the measured effect misses the claim's direction or size, with "
    "the scale it was measured at; else **partly** when an arm it reads fails a regime check "
    "(or a confound is named); else **reproduced**. Where the paper gives a size (EF's "
    "recovered share), the label names the direction and the size apart, the size by the "
    "rule written before the size ladder's runs: **consistent with** the paper's range where "
    "that range lies inside the 95 % interval (or the interval inside the range), **not "
    "reproduced** where the interval misses it, **inconclusive** where it holds only part of "
    f"it or is more than {SIZE_WIDTH_FACTOR:g}x as wide as the range. Tests are "
    "paired by seed where the seeds pair (same data order and initialisation), Welch's "
    "otherwise."
)


class Finding(NamedTuple):
    """One claim as measured, before the table's correction and labels."""

    claim: str
    holds: bool  # the claimed direction and size, as measured
    p: float  # its test, two-sided, uncorrected
    evidence: str
    seeds: int  # fewest seeds the test reads
    need: int = SEEDS
    why: str = ""  # why it cannot be read at all (e.g. "2 depths")
    partly: str = ""  # the regime check an arm it reads fails (or an unread one)
    size: str = ""  # where the paper gives a size: whether it reproduces, apart from direction
    confound: str = ""  # a named confound: partly where it holds, inconclusive where it misses
    scale: str = ""  # what it was measured at, stated beside "not reproduced" (`scale_of`)


class Claim(NamedTuple):
    """A labelled claim: (claim, verdict, evidence) first, so it reads as the old triple."""

    claim: str
    verdict: str
    evidence: str
    p: float = math.nan
    p_holm: float = math.nan


ClaimCheck = Callable[[list["Row"]], list[Finding]]


def label(findings: list[Finding]) -> list[Claim]:
    """`RULE` applied to one table's findings, their p-values corrected together."""
    adjusted = stats.holm([f.p if not f.why and f.seeds >= f.need else math.nan for f in findings])
    out = []
    for f, q in zip(findings, adjusted):
        if f.why:
            verdict = f"inconclusive ({f.why})"
        elif f.seeds < f.need:
            verdict = f"inconclusive ({f.seeds} seed{'s' * (f.seeds != 1)} < {f.need})"
        elif not q < ALPHA:
            verdict = f"inconclusive (Holm p {fmt_p(q)})"
        elif f.partly.startswith(UNREAD):  # prepare the runs' data (`stalepipe data prepare`)
            verdict = f"inconclusive ({f.partly})"
        elif not f.holds and f.confound:  # a confounded miss says nothing either way
            verdict = f"inconclusive (misses the claim, confounded: {f.confound})"
        elif not f.holds:
            verdict = f"not reproduced ({f.scale})" if f.scale else "not reproduced"
        elif f.partly or f.confound:
            verdict = f"partly ({'; '.join(x for x in (f.partly, f.confound) if x)})"
        else:
            verdict = "reproduced"
        readable = not f.why and f.seeds >= f.need and not f.partly.startswith(UNREAD)
        if f.size and readable:  # the size is read whether or not the direction's test is
            verdict = f"direction {verdict}; size {f.size}"
        p_text = f"p {fmt_p(f.p)}, Holm {fmt_p(q)}" if math.isfinite(q) else f"p {fmt_p(f.p)}"
        tail = f" [{p_text}]" if math.isfinite(f.p) else ""
        out.append(Claim(f.claim, verdict, f"{f.evidence}{tail}", f.p, q))
    return out


def seed_gaps(row: Row) -> dict[int, float]:
    """Seed -> the row's final val loss minus its baseline's at that seed."""
    # here, not at the top: results reads run directories (targets, records, rundir.status),
    # and `sweep --help` imports this module through the studies
    from stalepipe.lab.analysis.results import seed_values

    if row.baseline is None:
        return {}
    mine, base = seed_values(row), seed_values(row.baseline)
    return {s: mine[s] - base[s] for s in mine.keys() & base.keys()}


# The share of the gap the paper's EF recovers, where it gives one (Zmushko et al., 2026)
PAPER_EF_SHARE = {"adamw": (0.85, 0.90), "muon": (0.50, 0.70)}


def paper_size(optimizer: str, low: float, high: float, scale: str = "") -> str:
    """The share's 95 % interval against the paper's range for `optimizer` ('' without one), by
    the rule the size ladder registered before its runs: the paper's range inside the interval.
    From 2026-12-05 01:42 UTC (after the ladder's widths 32-64 had data) until issue 51 the code
    read it as "meets" (any overlap); docs/RESULTS.md names what that changed. Consistent where
    the range lies inside the interval (or the interval inside the range); not reproduced where
    the two do not meet, with `scale`; inconclusive where the interval holds only part of the
    range, or is more than SIZE_WIDTH_FACTOR times as wide as it."""
    if optimizer not in PAPER_EF_SHARE:
        return ""
    a, b = PAPER_EF_SHARE[optimizer]
    paper = f"the paper's {a:.0%}-{b:.0%}"
    if not (math.isfinite(low) and math.isfinite(high)):
        return f"inconclusive (no interval to hold against {paper})"
    if high < a or low > b:
        return f"not reproduced (interval misses {paper}{'; ' + scale if scale else ''})"
    wide = (high - low) / (b - a)
    if wide > SIZE_WIDTH_FACTOR + 1e-9:  # (a ratio of rounded shares)
        return f"inconclusive (interval {wide:.1f}x as wide as {paper}, > {SIZE_WIDTH_FACTOR:g}x)"
    if low <= a and b <= high or a <= low and high <= b:
        return f"consistent with {paper}"
    return f"inconclusive (interval holds only part of {paper})"


def scale_of(row: Row) -> str:
    """'measured at 0.43M parameters and 2.5M tokens': the model size (all parameters) and
    tokens of `row`'s runs, which a "not reproduced" states ('' where its config lacks them)."""
    c = row.config
    try:
        model = ModelConfig(**{k[6:]: v for k, v in c.items() if k.startswith("model.")})
        params = count_params(model)["total"]
        tokens = int(c["train.num_steps"]) * int(c["train.batch_size"]) * int(c["data.seq_len"])
    except (KeyError, TypeError, ValueError):
        return ""
    return f"measured at {_si(params)} parameters and {_si(tokens)} tokens"


def _si(x: float) -> str:
    """430944 -> '0.43M', 4096 -> '4.1k'."""
    return f"{x / 1e6:.2g}M" if x >= 1e5 else f"{x / 1e3:.2g}k" if x >= 1e3 else f"{x:g}"


def regime_failure(*rows: Row) -> str:
    """The regime check an arm the claim reads fails, named with the arm ('' if none): an unread
    one first, whichever arm it is in, so that one arm failing does not hide another's unread
    check (the label is then "inconclusive (unread)", not "partly")."""
    fails = [(why, r.label) for r in rows if (why := regime_check(r))]
    fails.sort(key=lambda f: not f[0].startswith(UNREAD))  # stable: else the first arm's
    return f"{fails[0][0]} for {fails[0][1]}" if fails else ""
