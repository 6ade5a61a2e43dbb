"""The logic of `stalepipe simulate`: build schedules, time them, print a table, draw a Gantt.

    stalepipe simulate --schedule 2bw --stages 8 --microbatches 16 --steps 4
    stalepipe simulate --compare gpipe,1f1b,zb-h1,2bw --stages 8 --microbatches 16 --steps 4 \\
        --model llama-10b --device h100 --plot out.png --csv out.csv

Without --model (and without --times) every stage costs F = BI = BW = 1 time unit, updates and
messages are free: the textbook setting where GPipe's bubble is (P-1)/(m+P-1).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from stalepipe.config import ConfigError, ModelConfig
from stalepipe.errors import UserError
from stalepipe.pipeline.devices import Device, get_device
from stalepipe.pipeline.generators import SCHEDULES, make_schedule
from stalepipe.pipeline.schedule import Schedule, validate
from stalepipe.pipeline.timing import (
    CostModel,
    SimResult,
    Timeline,
    analytic_costs,
    simulate,
    summarize,
    uniform_costs,
)
from stalepipe.presets import PRESETS

# Shapes for what-if simulations only (too large to train here); training presets live in
# presets.PRESETS and are accepted too.
SIM_MODELS: dict[str, ModelConfig] = {
    # ~10.9B parameters: a LLaMA-3-8B-style block (GQA 32/8 heads, SwiGLU 14336) at 48 layers,
    # GPT-2 vocabulary padded to 50304, untied head, 4096-token context.
    "llama-10b": ModelConfig(
        vocab_size=50304,
        dim=4096,
        num_layers=48,
        num_heads=32,
        num_kv_heads=8,
        ffn_dim=14336,
        max_seq_len=4096,
        rope_theta=500000.0,
        tie_embeddings=False,
    ),
}

TIME_KEYS = ("f", "b", "bi", "bw", "opt", "comm")
UNIT_COSTS = "costs: uniform F = BI = BW = 1 time unit per rank, free updates and messages"
LEGEND = (
    "bubble: idle share of P x makespan; steady: per step once the pipeline is full; "
    "stash/versions/staleness: range over stages"
)


def model_config(name: str) -> ModelConfig:
    """A model shape by name: SIM_MODELS or a training preset of presets.PRESETS."""
    if name in SIM_MODELS:
        return SIM_MODELS[name]
    if name in PRESETS:
        return PRESETS[name]().model
    names = ", ".join([*SIM_MODELS, *PRESETS])
    raise ConfigError(f"unknown --model {name!r}; choose from {names}")


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


def _given_costs(times: dict[str, list[float]], sched: Schedule) -> CostModel:
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


def format_table(rows: list[tuple[str, SimResult | str]], costs: CostModel) -> str:
    """One row per schedule; a string result is a refusal message."""
    tokens = costs.tokens_per_microbatch > 0
    mem = any(costs.weight_bytes)
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
    ] + (["max mem GB"] if mem else [])
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
        ] + ([f"{max(r.peak_memory) / 1e9:.1f}"] if mem else [])
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
    """Per-stage detail of one schedule: costs, stash, versions, staleness, memory."""
    c, sched = tl.costs, tl.schedule
    mem = any(c.weight_bytes)
    head = ["stage", "rank", "F", "BI", "BW", "opt", "stash", "versions", "tau"] + (
        ["mem GB"] if mem else []
    )
    table = [head]
    for s in range(sched.num_stages):
        row = [str(s), str(sched.rank_of(s))]
        row += [
            _fmt_time(x[s], c.time_unit)
            for x in (c.forward, c.backward_input, c.backward_weight, c.optimizer)
        ]
        row += [str(r.peak_activations[s]), str(r.peak_versions[s]), str(r.staleness[s])]
        row += [f"{r.peak_memory[s] / 1e9:.1f}"] if mem else []
        table.append(row)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in table)


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
    chunks: int = 2,
    compare: str | list[str] | None = None,
    model: str | None = None,
    device: str = "h100",
    mfu: float = 0.4,
    seq_len: int | None = None,
    microbatch_size: int = 1,
    times: str | None = None,
    sync_start: int = 0,
    sync_cooldown: float = 0.0,
    plot: str | None = None,
    csv: str | None = None,
    text: str | None = None,
) -> str:
    """Simulate `schedule` (or each of `compare`, comma-separated) on `stages` ranks with
    `microbatches` per step over `steps` steps; return the report text. Costs: analytic from
    `model` on `device` (MFU `mfu`, `microbatch_size` sequences of `seq_len` tokens), or
    `times` ("f=1,b=2,opt=0.1,comm=0.05", per stage "f=1:1:2"), or unit costs. Writes the Gantt
    chart to `plot`, the timed actions to `csv`, the schedules' text form to `text`. In a
    comparison, a schedule that refuses the sizes (e.g. 2bw with m < P-1) gets a row saying
    why; alone, it raises. Raises UserError (ConfigError) on bad input; writes nothing then."""
    _check_out(plot, (".png", ".svg", ".pdf"), "--plot")
    _check_out(csv, (".csv",), "--csv")
    _check_out(text, (".txt",), "--text")
    if model is not None and times is not None:
        raise ConfigError("give --model (analytic costs) or --times (given costs), not both")
    names = _schedule_names(schedule, compare)
    cfg = model_config(model) if model is not None else None
    dev = get_device(device) if cfg is not None else None
    given = parse_times(times) if times else {}

    def build(name: str) -> tuple[Schedule, CostModel]:
        sched = make_schedule(
            name,
            stages,
            microbatches,
            steps,
            num_chunks=chunks,
            sync_start=sync_start,
            sync_cooldown=sync_cooldown,
        )
        costs = _costs(sched, cfg, dev, given, mfu=mfu, seq_len=seq_len, mb_size=microbatch_size)
        return sched, costs

    rows, timelines, costs = _simulate_each(names, build)
    if cfg is not None:
        tokens = costs.tokens_per_microbatch
        what = (
            f"costs: {model} on {device} at MFU {mfu:.2f}, microbatch = {microbatch_size} x "
            f"{tokens // microbatch_size} = {tokens} tokens, global batch = "
            f"{microbatches * tokens} tokens; BI = BW = F; optimizer memory-bound"
        )
    else:
        what = f"costs: given ({times}), in time units" if given else UNIT_COSTS
    out = [
        f"stages (ranks) P={stages}, microbatches m={microbatches}, steps N={steps}",
        what,
        "",
        format_table(rows, costs),
    ]
    if len(names) == 1:
        out += ["", format_stages(timelines[0], summarize(timelines[0]))]
    out += ["", LEGEND]
    out += _write_outputs(timelines, plot, csv, text)
    return "\n".join(out)


def _costs(
    sched: Schedule,
    cfg: ModelConfig | None,
    dev: Device | None,
    given: dict[str, list[float]],
    *,
    mfu: float,
    seq_len: int | None,
    mb_size: int,
) -> CostModel:
    """Analytic costs of the model `cfg` on `dev`, else the given (--times) or unit costs."""
    if cfg is not None:
        return analytic_costs(
            cfg,
            sched.num_stages,
            dev,  # type: ignore[arg-type]
            mfu=mfu,
            seq_len=seq_len,
            microbatch_size=mb_size,
        )
    return _given_costs(given, sched)


def _schedule_names(schedule: str, compare: str | list[str] | None) -> list[str]:
    """The schedules to simulate: `compare` (comma-separated or a list), else `schedule`."""
    names = (
        (compare.split(",") if isinstance(compare, str) else list(compare))
        if compare
        else [schedule]
    )
    names = [n.strip() for n in names if n.strip()]
    for n in names:
        if n not in SCHEDULES:
            raise ConfigError(f"unknown schedule {n!r}; choose from {', '.join(SCHEDULES)}")
    return names


def _simulate_each(
    names: list[str], build: Callable[[str], tuple[Schedule, CostModel]]
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
        tl = simulate(sched, costs)
        timelines.append(tl)
        rows.append((n, summarize(tl)))
        costs_shown = costs_shown or costs
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
        from stalepipe.pipeline.gantt import plot_timelines

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
