"""The verdict's rule (docs/design.md, 'What we report'): the time-to-target ratio of one
delayed configuration against a synchronous schedule, and the call it makes, from the token
overhead at sync's final loss (`analysis.targets`) or over the band (`analysis.overhead`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalepipe.config import ModelConfig
from stalepipe.config.shapes import count_params
from stalepipe.lab.analysis.overhead import Overhead
from stalepipe.lab.analysis.results import Row
from stalepipe.lab.analysis.targets import TargetOverhead
from stalepipe.lab.verdict.throughput import ScheduleThroughput

# The rule printed beside every verdict (docs/design.md, 'What we report': the target is sync's
# final loss; intervals over seeds; fewer than 3 seeds is inconclusive).
RULE = (
    "rule: the target is the synchronous arm's final val loss (per seed); 'async sooner' when "
    "the 95% interval of the time-to-target ratio lies below 1, 'sync sooner' when above 1, "
    "when the delayed arm has a quality floor, or when it is still short of the target at a "
    "token multiple that alone outweighs the throughput edge; otherwise, or with fewer than "
    "3 seeds, 'inconclusive'"
)


# The overhead's transfer from the model its runs trained to the throughputs' model (issue 52,
# item 4). Without a fit (`--overhead-fit`), ln o may move by up to TRANSFER_SLOPE per e-fold of
# non-embedding parameters either way: the overhead ladder's registered "flat within +-0.05"
# margin (docs/RESULTS.md, 'Overhead ladder', written before its runs), an assumption stated
# and printed, not a measurement: the ladder has not confirmed it.
TRANSFER_SLOPE = 0.05
CI = "95% CI"  # the seeds' interval alone: no other term enters
BOUND = "bound"  # worst case of the seeds' 95% CI, the assumptions' corners and the transfer


@dataclass(frozen=True)
class Transfer:
    """The factor range the token overhead may take moving from the measured model to the
    throughputs' model, and where it comes from; (1, 1): none applied (same model, or unknown)."""

    low: float = 1.0
    high: float = 1.0
    measured: str = ""  # "0.43M"
    target: str = ""  # "362M"
    source: str = ""  # what the range is (printed)

    @property
    def none(self) -> bool:
        return (self.low, self.high) == (1.0, 1.0)

    def text(self) -> str:
        """'0.43M -> 362M x0.72-1.39 (default: ...)', '' when none applied."""
        if self.none:
            return ""
        return (
            f"{self.measured} -> {self.target}: x{self.low:.2f}-{_short(self.high)} ({self.source})"
        )


def _short(x: float) -> str:
    return f"{x:.2f}" if x < 1000 else f"{x:.1e}"


def default_transfer(measured_n: float, target_n: float, measured: str, target: str) -> Transfer:
    """`TRANSFER_SLOPE` over the e-folds between `measured_n` and `target_n` non-embedding
    parameters (no range when either is unknown or they are equal)."""
    if not (measured_n > 0 and target_n > 0) or measured_n == target_n:
        return Transfer()
    e = TRANSFER_SLOPE * abs(math.log(target_n / measured_n))
    how = f"default: ln o +-{TRANSFER_SLOPE} per e-fold of size, docs/verdict.md"
    return Transfer(math.exp(-e), math.exp(e), measured, target, how)


@dataclass(frozen=True)
class Ratio:
    """Time to target of the async schedule over one synchronous schedule, with its interval."""

    value: float
    low: float
    high: float

    def text(self) -> str:
        """'1.05x [0.99, 1.11]', '1.05x' without an interval, '-' without a value."""
        if not math.isfinite(self.value):
            return "-"
        ci = f" [{self.low:.2f}, {self.high:.2f}]" if math.isfinite(self.low) else ""
        return f"{self.value:.2f}x{ci}"


@dataclass(frozen=True)
class Estimate:
    """A token overhead as the verdict reads it: at sync's final loss (`targets`), or over the
    band (`overhead`, the older reading; the tests' synthetic taxes)."""

    status: str  # "tax" (a multiplier), "floor", "short" (a lower bound), or why not read
    value: float
    low: float
    high: float
    seeds: int
    bound: float = math.nan  # "short" in every seed: the multiple they were all still short at
    text: str = ""

    @staticmethod
    def of(x: Overhead | TargetOverhead) -> Estimate:
        nan = math.nan
        if isinstance(x, Overhead):
            values = (x.estimate, x.ci_low, x.ci_high)
            return Estimate(x.status, *values, x.num_seeds, text=x.describe())
        n, text = len(x.seeds), x.describe()
        if not n or x.in_warmup:
            return Estimate("in warmup" if n else "no pairs", nan, nan, nan, n, text=text)
        if x.missed:  # a bound speaks for the arm only when every seed is short
            bound = x.bound if x.missed == n else nan
            return Estimate("short", nan, nan, nan, n, bound, text)
        est, low, high = x.interval()
        return Estimate("tax", est, low, high, n, text=text)


def time_to_target(overhead: Overhead | TargetOverhead, speedup: float) -> Ratio:
    """token overhead / (throughput_async / throughput_sync), the overhead's interval carried
    through (the speedup is a constant); nan without a multiplier (floor, short, no band)."""
    e = Estimate.of(overhead)
    if e.status != "tax" or not speedup > 0:
        return Ratio(math.nan, math.nan, math.nan)
    return Ratio(e.value / speedup, e.low / speedup, e.high / speedup)


def call(overhead: Overhead | TargetOverhead, ratio: Ratio, speedup: float = math.nan) -> str:
    """The verdict on one configuration, by RULE (`speedup`: async over the best sync)."""
    e = Estimate.of(overhead)
    if e.seeds < 3 and e.status in ("tax", "short", "floor"):
        return f"inconclusive ({e.seeds} seed{'s' * (e.seeds != 1)} < 3)"
    if e.status == "floor":
        return "sync sooner (quality floor)"
    if e.status == "short":
        at = e.bound / speedup if speedup > 0 else math.nan
        if at >= 1:  # every seed short at a multiple that alone outweighs the edge
            return f"sync sooner (short of sync's final loss at {e.bound:.2f}x its tokens)"
        return (
            f"inconclusive ({e.text}; run each short seed complete at longer lengths: stalepipe "
            "sweep STUDY --lengths 1.1,1.2,1.35,1.5)"
        )
    if e.status != "tax":
        return f"inconclusive ({e.text})"
    if ratio.high < 1:
        return "async sooner"
    if ratio.low > 1:
        return "sync sooner"
    return "too close to call (interval holds 1)"


@dataclass
class Verdict:
    """One delayed configuration: its token overhead and its time to target per sync schedule."""

    label: str
    baseline: str
    schedule: str  # the asynchronous schedule realising its delay policy
    overhead: Overhead  # over the band of sync's losses (secondary)
    sync_window_share: float  # share of steps in a sync window (run at the flushed rate)
    async_tokens_per_s: float  # with the sync windows
    best_sync: ScheduleThroughput | None
    ratios: dict[str, Ratio] = field(default_factory=dict)  # per sync schedule
    verdict: str = ""
    target: TargetOverhead | None = None  # at sync's final loss: what the verdict reads
    measured_on: str = ""  # the parameters of the model its runs trained ("0.43M")
    async_row: ScheduleThroughput | None = None  # the row of `schedule` its rate is read off
    edge_factors: tuple[float, float] = (1.0, 1.0)  # `Throughputs.edge_factors`
    transfer: Transfer = Transfer()  # the overhead's move to the throughputs' model size
    model_error: float = 0.0  # `Throughputs.model_error`, already in `edge_factors` (printed)
    # the same configuration planned longer, judged against sync at the same length
    # (a lengths sweep's like-for-like row: in the tables, not the decision block)
    at_length: bool = False
    # the throughputs it was judged on: its arm's (the cluster model costs each arm's own
    # optimizer, `Throughputs.arm`), else the one set every configuration shares
    throughputs: Any = None

    @property
    def arm(self) -> Any:
        """The arm whose optimizer its throughputs are costed with (`sim.optimizer.Arm`; None
        where they are not per arm)."""
        return getattr(self.throughputs, "arm", None)

    @property
    def speedup(self) -> float:
        if self.best_sync is None:
            return math.nan
        return self.async_tokens_per_s / self.best_sync.tokens_per_s

    @property
    def ratio(self) -> Ratio:
        """Against the best synchronous schedule that fits; interval over the seeds."""
        nan = Ratio(math.nan, math.nan, math.nan)
        return self.ratios.get(self.best_sync.name, nan) if self.best_sync else nan

    def status(self) -> str:
        """What a figure writes where the configuration has no ratio: the final-loss reading."""
        return self.target.describe() if self.target else self.overhead.status

    @property
    def ratio_all(self) -> Ratio:
        """`ratio` with its interval over the seeds, the assumptions' ranges and the transfer:
        the lowest overhead at the highest edge, the highest at the lowest (what the verdict
        calls on; labelled `interval_kind`)."""
        return widen(self.ratio, *self.edge_factors, self.transfer, self.speedup)

    def ratio_against(self, s: ScheduleThroughput) -> Ratio:
        """`ratio_all`'s interval against synchronous schedule `s` instead of the best one (the
        per-schedule tables and the CSV print it)."""
        speedup = self.async_tokens_per_s / s.tokens_per_s if s.tokens_per_s > 0 else math.nan
        return widen(self.ratios[s.name], *self.edge_factors, self.transfer, speedup)

    @property
    def interval_kind(self) -> str:
        """The one label of `ratio_all`: the seeds' 95% CI when nothing else enters it, else a
        worst-case bound (the corners are stacked, not combined into a 95 % interval)."""
        return CI if self.edge_factors == (1.0, 1.0) and self.transfer.none else BOUND


def widen(
    r: Ratio, low: float, high: float, transfer: Transfer = Transfer(), speedup: float = math.inf
) -> Ratio:
    """A time-to-target ratio's interval with the throughput edge anywhere in [low, high] x its
    central value (`speedup`) and the overhead anywhere in the transfer's range: a worst-case
    bound. The transfer never takes the overhead below 1 (a ratio of 1 / speedup): the estimator
    reads a delayed run already at sync's loss as 1.0, so a smaller overhead is not a value the
    measurement can have, at any size."""
    floor = 1 / speedup if speedup > 0 else 0.0
    return Ratio(r.value, max(r.low * transfer.low, floor) / high, r.high * transfer.high / low)


def at_size(v: Verdict, verdict: str) -> str:
    """`verdict`, or where the interval holds 1 and the transfer alone spans the flip point
    (the overhead's point times the transfer's range holds 1 x the edge), 'inconclusive at the
    target size' with the overheads that would decide it (issue 52, item 4)."""
    t, r = v.transfer, v.ratio
    if not verdict.startswith("too close to call (interval holds 1") or not math.isfinite(r.value):
        return verdict
    floor = 1 / v.speedup if v.speedup > 0 else 0.0  # an overhead of 1 (`widen`)
    if not max(r.value * t.low, floor) < 1 < r.value * t.high:
        return verdict
    lo, hi = (v.speedup * f for f in v.edge_factors)
    return (
        f"inconclusive at the target size (async sooner if its overhead at {t.target} is below "
        f"{lo:.3f}x, sync sooner above {hi:.3f}x)"
    )


def model_params(config: dict[str, object]) -> dict[str, int]:
    """`config.shapes.count_params` of a run's model, from its flattened config."""
    fields = {k[6:]: v for k, v in config.items() if k.startswith("model.")}
    known = {k: v for k, v in fields.items() if k in ModelConfig.__dataclass_fields__}
    return count_params(ModelConfig(**known))


def model_size(config: dict[str, object]) -> str:
    """The parameter count of a run's model, from its flattened config ("0.43M")."""
    return f"{model_params(config)['total'] / 1e6:.2f}M"


def size_text(n: float) -> str:
    """A non-embedding parameter count as the transfer prints it ('0.41M', '315M', '70.0B')."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"


def overhead_source(sweep_dir: Path, rows: list[Row]) -> str:
    """The 'measured' input line: which runs, engine, model shape and P the overhead is from."""
    runs = [r for row in rows for r in row.runs if r.status == "finished"]

    def values(key: str, default: object) -> str:
        return "/".join(sorted({str(r.config.get(key, default)) for r in runs}))

    return (
        f"token overhead: measured, val curves of {len(runs)} finished runs in {sweep_dir} "
        f"(engine {values('pipeline.engine', 'emulate')}, model {values('model.num_layers', '?')} "
        f"layers x dim {values('model.dim', '?')}, P={values('pipeline.num_stages', 1)}); "
        "carried to the throughputs' P as measured, and to their model with the size transfer "
        "below (a term of the interval)"
    )
