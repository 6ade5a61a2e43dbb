"""The logic of `stalepipe simulate`: build schedules, time them, print a table, draw a Gantt.

    stalepipe simulate --schedule 2bw --stages 8 --microbatches 16 --steps 4
    stalepipe simulate --compare gpipe,1f1b,zb-h1,2bw --stages 8 --microbatches 16 --steps 4 \\
        --model llama-10b --device h100 --plot out.png --csv out.csv

Without --model (and without --times) every stage costs F = BI = BW = 1 time unit, updates and
messages are free: the textbook setting where GPipe's bubble is (P-1)/(m+P-1).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stalepipe.config import ConfigError, ModelConfig
from stalepipe.config.registry import PIPELINE_SCHEDULES
from stalepipe.errors import UserError
from stalepipe.hardware import Device, get_device
from stalepipe.lab.sim.gantt import plot_timelines
from stalepipe.lab.sim.models import model_config
from stalepipe.lab.sim.table import LEGEND, format_stages, format_table
from stalepipe.lab.sim.timing import (
    CostModel,
    SimResult,
    Timeline,
    analytic_costs,
    simulate,
    summarize,
    uniform_costs,
)
from stalepipe.training.delay.policies import never_delays
from stalepipe.training.schedules.generators import make_schedule
from stalepipe.training.schedules.schedule import PipelineSchedule, validate

TIME_KEYS = ("f", "b", "bi", "bw", "opt", "comm")
UNIT_COSTS = "costs: uniform F = BI = BW = 1 time unit per rank, free updates and messages"


def parse_times(text: str) -> dict[str, list[float]]:
    """`f=1,b=2,opt=0.1` or per stage `f=1:1:1:1.5,...` -> {'f': [1.0], ...}."""
    out: dict[str, list[float]] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, val = part.partition("=")
        if not sep or key not in TIME_KEYS:
            raise ConfigError(
                f"--times entry {part!r}: use KEY=VALUE with KEY in {', '.join(TIME_KEYS)} "
                f"(e.g. f=1,b=2,opt=0.1; per stage f=1:1:1.5)"
            )
        try:
            out[key] = [float(v) for v in val.split(":")]
        except ValueError:
            raise ConfigError(f"--times {key}: numbers expected, got {val!r}") from None
    if "b" in out and ("bi" in out or "bw" in out):
        raise ConfigError("--times: give b (split evenly into bi and bw) or bi and bw, not both")
    return out


def _given_costs(times: dict[str, list[float]], sched: PipelineSchedule) -> CostModel:
    """Per-stage costs from --times. One number is one rank's whole share: with v chunks per
    rank each chunk costs a v-th of it. A list must have one value per model stage."""
    S, v = sched.num_stages, sched.num_chunks

    def get(key: str, default: float) -> float | list[float]:
        vals = times.get(key, [default])
        if len(vals) == 1:
            return vals[0] / v
        if len(vals) != S:
            raise ConfigError(
                f"--times {key}: {len(vals)} values, but {sched.name} has {S} stages "
                f"(give one number, or {S} values)"
            )
        return vals

    if "b" in times:  # a full backward, split evenly into input and weight gradient
        b = get("b", 0.0)
        bi = bw = b / 2 if isinstance(b, float) else [x / 2 for x in b]
    else:
        bi, bw = get("bi", 1.0), get("bw", 1.0)
    comm = times.get("comm", [0.0])
    if len(comm) != 1:
        raise ConfigError("--times comm takes one number (time per message between ranks)")
    return uniform_costs(
        S,
        forward=get("f", 1.0),
        backward_input=bi,
        backward_weight=bw,
        optimizer=get("opt", 0.0),
        p2p_latency=comm[0],
        weight=1 / v,  # a rank's share of the weights and of one microbatch's stash: 1 unit
        activation=1 / v,
    )


def _check_out(path: str | None, exts: tuple[str, ...], flag: str) -> None:
    if path is None:
        return
    if not path.lower().endswith(exts):
        raise UserError(f"{flag} file must end in {' or '.join(exts)}, got {path!r}")
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise UserError(f"{flag}: directory {parent!r} does not exist; create it first")


def simulate_main(
    *,
    schedule: str = "1f1b",
    stages: int = 4,
    microbatches: int = 8,
    steps: int = 1,
    chunks: int | None = None,
    compare: str | list[str] | None = None,
    model: str | None = None,
    device: str = "h100",
    mfu: float = 0.4,
    seq_len: int | None = None,
    microbatch_size: int = 1,
    partition: str = "balanced",
    times: str | None = None,
    sync_start: int = 0,
    sync_cooldown: float = 0.0,
    plot: str | None = None,
    csv: str | None = None,
    text: str | None = None,
) -> str:
    """Simulate `schedule` (or each of `compare`, comma-separated) on `stages` ranks with
    `microbatches` per step over `steps` steps; return the report text. Costs: analytic from
    `model` on `device` (MFU `mfu`, `microbatch_size` sequences of `seq_len` tokens, stages
    split by `partition`: balanced by cost, uniform, or blocks per stage "3,2,2,1"), or
    `times` ("f=1,b=2,opt=0.1,comm=0.05", per stage "f=1:1:2"), or unit costs. Writes the Gantt
    chart to `plot`, the timed actions to `csv`, the schedules' text form to `text`. In a
    comparison, a schedule that refuses the sizes (e.g. 2bw with m < P-1) gets a row saying
    why; alone, it raises. Raises UserError (ConfigError) on bad input; writes nothing then."""
    names, chunks = _checked_args(
        schedule, compare, chunks, model, times, partition, plot=plot, csv=csv, text=text
    )
    cfg = model_config(model) if model is not None else None
    dev = get_device(device) if cfg is not None else None
    given = parse_times(times) if times else {}

    def build(name: str) -> tuple[PipelineSchedule, list[CostModel]]:
        sched = make_schedule(
            name,
            stages,
            microbatches,
            steps,
            num_chunks=chunks,
            sync_start=sync_start,
            sync_cooldown=sync_cooldown,
        )
        mb, split = microbatch_size, partition
        return sched, model_costs(
            sched, cfg, dev, given, mfu=mfu, seq_len=seq_len, mb_size=mb, partition=split
        )

    rows, timelines, costs = _simulate_each(names, build)
    if cfg is not None:
        tokens = costs.tokens_per_microbatch
        what = (
            f"costs: {model} on {device} at MFU {mfu:.2f}, microbatch = {microbatch_size} x "
            f"{tokens // microbatch_size} = {tokens} tokens, global batch = "
            f"{microbatches * tokens} tokens; BI = BW = F; optimizer memory-bound; stages "
            f"split {partition}"
        )
    else:
        what = f"costs: given ({times}), in time units" if given else UNIT_COSTS
    limit = dev.memory_bytes if dev is not None else None
    out = [
        f"stages (ranks) P={stages}, microbatches m={microbatches}, steps N={steps}",
        what,
        "",
        format_table(rows, costs, limit),
    ]
    if len(names) == 1:
        out += ["", format_stages(timelines[0], summarize(timelines[0]))]
    ratios = ratio_lines([ScheduleRow.of(n, r, limit) for n, r in rows])
    out += ["", *ratios, LEGEND] if ratios else ["", LEGEND]
    out += _write_outputs(timelines, plot, csv, text)
    return "\n".join(out)


def _checked_args(
    schedule: str,
    compare: str | list[str] | None,
    chunks: int | None,
    model: str | None,
    times: str | None,
    partition: str,
    **outputs: str | None,
) -> tuple[list[str], int]:
    """simulate_main's argument checks: the schedule names to run and the chunk count.
    Raises ConfigError naming the fix."""
    plot, csv, text = outputs["plot"], outputs["csv"], outputs["text"]
    _check_out(plot, (".png", ".svg", ".pdf"), "--plot")
    _check_out(csv, (".csv",), "--csv")
    _check_out(text, (".txt",), "--text")
    if model is not None and times is not None:
        raise ConfigError("give --model (analytic costs) or --times (given costs), not both")
    if partition != "balanced" and model is None:
        raise ConfigError("--partition splits a --model's blocks; give --model, or drop it")
    names = _schedule_names(schedule, compare)
    if chunks is not None and all(PIPELINE_SCHEDULES[n].chunks is not None for n in names):
        raise ConfigError(
            f"--chunks is read by interleaved-1f1b only (zb-v, dualpipev and wpipe always hold "
            f"2 stages per rank), not by {', '.join(names)}; drop --chunks"
        )
    chunks = 2 if chunks is None else chunks
    return names, chunks


def model_costs(
    sched: PipelineSchedule,
    cfg: ModelConfig | None,
    dev: Device | None,
    given: dict[str, list[float]],
    *,
    mfu: float,
    seq_len: int | None,
    mb_size: int,
    partition: str = "balanced",
) -> list[CostModel]:
    """Analytic costs of the model `cfg` on `dev`, else the given (--times) or unit costs.
    With chunks, two analytic candidates: stages split by stage FLOPs and by rank FLOPs
    (`sim.balance`); the simulation keeps the faster, as a user would. A `partition` other
    than balanced (`pipeline.partition`'s uniform or "3,2,2,1") is taken as given."""
    if cfg is None:
        return [_given_costs(given, sched)]
    ranks = tuple(sched.rank_of(s) for s in range(sched.num_stages))
    splits = [None, ranks] if sched.num_chunks > 1 and partition == "balanced" else [None]
    return [
        analytic_costs(
            cfg,
            sched.num_stages,
            dev,  # type: ignore[arg-type]
            mfu=mfu,
            seq_len=seq_len,
            microbatch_size=mb_size,
            stage_ranks=split,
            partition=partition,
        )
        for split in splits
    ]


def _schedule_names(schedule: str, compare: str | list[str] | None) -> list[str]:
    """The schedules to simulate: `compare` (comma-separated or a list), else `schedule`."""
    names = (
        (compare.split(",") if isinstance(compare, str) else list(compare))
        if compare
        else [schedule]
    )
    names = [n.strip() for n in names if n.strip()]
    for n in names:
        if n not in PIPELINE_SCHEDULES:
            raise ConfigError(
                f"unknown schedule {n!r}; choose from {PIPELINE_SCHEDULES.choices(', ')}"
            )
    return names


def fastest(sched: PipelineSchedule, options: list[CostModel]) -> Timeline:
    """The timeline of `sched` under the cost model (of `options`, e.g. two stage splits)
    that gives the highest steady-state throughput; the first on a tie."""
    best: tuple[float, Timeline] | None = None
    for costs in options:
        tl = simulate(sched, costs)
        rate = summarize(tl).steady_throughput
        if best is None or rate > best[0]:
            best = (rate, tl)
    assert best is not None
    return best[1]


def _simulate_each(
    names: list[str], build: Callable[[str], tuple[PipelineSchedule, list[CostModel]]]
) -> tuple[list[tuple[str, SimResult | str]], list[Timeline], CostModel]:
    """Build and time each schedule: its table rows, the timelines, and the first schedule's
    costs (shown in the header). In a comparison, a schedule that refuses the sizes gets a row
    saying why; alone, it raises."""
    rows: list[tuple[str, SimResult | str]] = []
    timelines: list[Timeline] = []
    costs_shown: CostModel | None = None
    for n in names:
        try:
            sched, costs = build(n)
        except ConfigError as e:
            if len(names) == 1:
                raise
            rows.append((n, str(e)))
            continue
        validate(sched)
        tl = fastest(sched, costs)
        timelines.append(tl)
        rows.append((n, summarize(tl)))
        costs_shown = costs_shown or tl.costs
    if not timelines:
        raise ConfigError(
            "no schedule could be built for these sizes: " + "; ".join(f"{n}: {r}" for n, r in rows)
        )
    assert costs_shown is not None
    return rows, timelines, costs_shown


def _write_outputs(
    timelines: list[Timeline], plot: str | None, csv: str | None, text: str | None
) -> list[str]:
    """The Gantt chart, the timed actions and the schedules' text form, each where asked;
    returns the 'wrote ...' lines."""
    wrote = []
    if plot:
        plot_timelines(timelines, plot)
        wrote.append(f"wrote {plot}")
    if csv:
        with open(csv, "w") as f:
            for i, tl in enumerate(timelines):
                f.write(tl.to_csv(header=i == 0))
        wrote.append(f"wrote {csv}")
    if text:
        with open(text, "w") as f:
            f.write("".join(tl.schedule.to_text() for tl in timelines))
        wrote.append(f"wrote {text}")
    return wrote


# --------------------------------------------------------------------------------------------
# The comparison the verdict asks for
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduleRow:
    """One schedule of `compare_schedules`. Throughput and bubble are the steady-state ones
    (per step once the pipeline is full: what a long run pays; a flushing schedule pays its
    fill and drain every step, so for it they equal the one-step figures)."""

    name: str
    policy: str  # "sync" or the delay policy the schedule realises
    tokens_per_s: float  # 0 when refused
    bubble: float
    peak_memory: tuple[float, ...]  # bytes, per rank (weights x versions + state + stash)
    fits: bool  # the largest rank's peak <= the memory limit
    refused: str | None = None  # why the schedule cannot run these sizes, if it cannot
    result: SimResult | None = None  # every figure of the simulation

    @classmethod
    def of(cls, name: str, r: SimResult | str, memory_limit: float | None) -> ScheduleRow:
        """The row of schedule `name` from its simulation, or from its refusal message; it
        fits when its largest rank's peak is <= `memory_limit` (None or 0: no limit)."""
        if isinstance(r, str):
            return cls(name, PIPELINE_SCHEDULES[name].policy, 0.0, 1.0, (), False, r)
        fits = not memory_limit or max(r.peak_memory) <= memory_limit
        return cls(
            name, r.policy, r.steady_throughput, r.steady_bubble, r.peak_memory, fits, None, r
        )


def compare_schedules(
    model_cfg: ModelConfig,
    device: Device | str,
    num_stages: int,
    num_microbatches: int,
    microbatch_size: int = 1,
    seq_len: int | None = None,
    schedules: Sequence[str] | None = None,
    *,
    mfu: float = 0.4,
    num_steps: int = 4,
    memory_limit: float | None = None,
    sync_start: int = 0,
) -> list[ScheduleRow]:
    """Simulate each of `schedules` (default: every registered schedule, `PIPELINE_SCHEDULES`) for `model_cfg` on
    `num_stages` pipeline ranks P (the CLI's --stages; a schedule with chunks runs more model
    stages on them) of `device`, `num_microbatches` microbatches of `microbatch_size` x
    `seq_len` tokens per step, over `num_steps` steps (>= 3, so the steady state is seen).
    `memory_limit` (bytes) defaults to the device's memory; `sync_start` runs the first steps
    of the asynchronous schedules synchronously. A schedule that refuses the sizes
    gets a row with `refused` set. Raises ConfigError on bad sizes or an unknown schedule."""
    dev = get_device(device) if isinstance(device, str) else device
    if num_steps < 3:
        raise ConfigError(f"num_steps must be >= 3 for a steady state, got {num_steps}")
    limit = dev.memory_bytes if memory_limit is None else memory_limit
    names = _schedule_names(
        "", list(schedules) if schedules is not None else list(PIPELINE_SCHEDULES)
    )
    rows = []
    for name in names:
        try:
            sched = make_schedule(
                name, num_stages, num_microbatches, num_steps, sync_start=sync_start
            )
        except ConfigError as e:
            rows.append(ScheduleRow.of(name, str(e), limit))
            continue
        validate(sched)
        options = model_costs(
            sched, model_cfg, dev, {}, mfu=mfu, seq_len=seq_len, mb_size=microbatch_size
        )
        rows.append(ScheduleRow.of(name, summarize(fastest(sched, options)), limit))
    return rows


def best_sync(rows: Sequence[ScheduleRow]) -> ScheduleRow | None:
    """The fastest synchronous schedule of `rows` that runs these sizes and fits in memory
    (`best_sync` of docs/design.md, 'What we report'); None when none does."""
    ok = [r for r in rows if never_delays(r.policy) and r.refused is None and r.fits]
    return max(ok, key=lambda r: r.tokens_per_s, default=None)


def ratio_lines(rows: Sequence[ScheduleRow]) -> list[str]:
    """One line per asynchronous schedule: its steady throughput over `best_sync`'s."""
    best = best_sync(rows)
    if best is None:
        return []
    return [
        f"steady throughput {r.name} / best synchronous that fits ({best.name}): "
        f"{r.tokens_per_s / best.tokens_per_s:.3f}"
        for r in rows
        if not never_delays(r.policy) and r.refused is None
    ]
