"""`stalepipe verdict --cluster`: the throughputs of every way to train on a cluster
(`sim.parallel`), and the crossover map (docs/verdict.md, 'The cluster model').

The verdict compares the fastest fitting configuration of the asynchronous schedule (2BW, with
DP or FSDP across its replicas) with the fastest fitting synchronous one of any kind (DP, FSDP,
every pipeline schedule over P and m, hybrids), for one model, cluster, GPU count and global
batch, and for each arm with its own optimizer (`sim.optimizer`: a Muon arm's synchronous
configurations and its 2BW pay Newton-Schulz; an EF arm's 2BW keeps EF's buffer;
`arm_throughputs`). The map repeats that over GPU counts, global batches (so m) and inter-node
bandwidths, per drawn arm, and calls each cell with the verdict's rule (`verdict.rule.call`),
the token overhead's interval carried through.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from stalepipe.config.registry import PIPELINE_SCHEDULES
from stalepipe.config.shapes import count_params
from stalepipe.errors import UserError
from stalepipe.fileio import csv_text
from stalepipe.lab.analysis.plots import png_bytes, pyplot
from stalepipe.lab.sim.cluster import (
    MFU_RANGE,
    OVERLAP_COST_RANGE,
    assumption_corners,
    get_cluster,
    link_efficiency_range,
)
from stalepipe.lab.sim.efficiency import E_MAX, MODEL_ERROR, MODEL_ERROR_WORST, X_HALF
from stalepipe.lab.sim.optimizer import ADAMW, Arm, model_matrices, ns_mfu
from stalepipe.lab.sim.parallel import Workload, all_options, best, cluster_schedules
from stalepipe.lab.sim.replicas import KINDS, tp_choices
from stalepipe.lab.verdict.rule import Verdict, call, time_to_target, widen
from stalepipe.lab.verdict.throughput import ScheduleThroughput, Throughputs, model_shape
from stalepipe.training.delay.policies import PAPER_ASYNC, never_delays

ASYNC = PAPER_ASYNC  # the asynchronous schedule of the map (delay.policies)
MAP_GBPS = (12.5, 25.0, 50.0, 100.0, 200.0, 400.0, 800.0)
MAP_BATCH = (0.25, 0.5, 1.0, 2.0, 4.0)  # x the global batch
MAP_GPUS = (0.5, 1.0, 2.0, 4.0)  # x the GPU count
# Okabe-Ito's colour-blind-safe blue and orange, and a light grey
COLORS = {"async sooner": "#0072B2", "sync sooner": "#E69F00", "inconclusive": "#DDDDDD"}


@dataclass(frozen=True)
class Setting:
    """What the cluster verdict is for: a model, a cluster, N GPUs, a global batch."""

    model: str
    cfg: Any  # ModelConfig
    seq_len: int
    cluster: Any  # sim.cluster.Cluster
    gpus: int
    global_batch: int  # sequences
    mfu: float | None  # None: by shape (sim.efficiency)
    arm: Arm = ADAMW  # the optimizer the throughputs are costed with (`sim.optimizer`)

    def workload(self, gpus: int | None = None, batch: int | None = None) -> Any:
        return Workload(
            self.cfg,
            self.seq_len,
            batch or self.global_batch,
            gpus or self.gpus,
            self.mfu,
            arm=self.arm,
        )


def _batch(text: str | int | None, default: int, seq_len: int) -> int:
    """--global-batch: sequences ('256'), or tokens with a 'tok' suffix ('1Mtok', '262144tok')."""
    if text is None:
        return default
    s = str(text).strip().lower()
    try:
        if s.endswith("tok"):
            num = s[:-3]
            scale = {"k": 1e3, "m": 1e6, "g": 1e9}.get(num[-1:], 1.0)
            tokens = float(num[:-1] if scale != 1.0 else num) * scale
            if tokens % seq_len:
                raise ValueError
            return int(tokens // seq_len)
        return int(s)
    except ValueError:
        raise UserError(
            f"--global-batch {text!r}: give sequences (256) or tokens that divide into "
            f"{seq_len}-token sequences (e.g. {256 * seq_len}tok)"
        ) from None


def setting(
    model: str | None,
    cluster: str,
    gpus: int | None,
    global_batch: str | int | None,
    *,
    mfu: float | None = None,
    seq_len: int | None = None,
    inter_node_gbps: float | None = None,
) -> Setting:
    """The setting from the CLI's flags; one-line UserError (ConfigError) naming the fix."""
    c = get_cluster(cluster, inter_node_gbps)
    name = model or "smollm-360m"
    cfg, own_len, own_batch = model_shape(name)
    seq = seq_len or own_len
    n = int(c.gpus_per_node) * 4 if gpus is None else gpus
    g = int(c.gpus_per_node)
    if n < 1 or (n > g and n % g) or (n < g and g % n):
        fix = f"{g * max(1, round(n / g))}" if n > g else f"a divisor of {g}"
        raise UserError(
            f"--gpus {n} is not a whole number of {c.name} nodes ({g} GPUs each); use {fix}"
        )
    batch = _batch(global_batch, own_batch, seq)
    # a TP group shares its sequences (Llama 3's 405B: 2,048 sequences on 8,192 GPUs at TP 8);
    # CP is not searched to split a batch (sim.hybrid), so the largest TP degree sets the floor
    least = n // max(tp_choices(c, n))
    if batch < least:
        raise UserError(
            f"--global-batch {batch} sequences is too small for {n} GPUs: every configuration "
            f"needs a sequence per TP group of at most {n // least} GPUs (m >= P for a pipeline); "
            f"use --global-batch >= {least}"
        )
    return Setting(name, cfg, seq, c, n, batch, mfu)


def check_modes(model: str | None, costs: str | None, cluster: str | None, *rest: object) -> None:
    """One source of throughputs; the flags of the other sources are errors, not no-ops."""
    stages, microbatches, gpus, batch, gbps = rest
    if costs is not None and (model is not None or cluster is not None):
        raise UserError(
            "--costs (measured throughputs) excludes --model and --cluster; give one of the two"
        )
    if cluster is None and model is None and costs is None:
        raise UserError(
            "give --cluster PRESET (every way to train on a cluster), --model "
            "PRESET (one pipeline) or --costs FILE (measured), one of the two"
        )
    if cluster is not None and (stages is not None or microbatches is not None):
        raise UserError(
            "with --cluster, P and m are swept by the cluster model; drop "
            "--stages and --microbatches"
        )
    if cluster is None and any(x is not None for x in (gpus, batch, gbps)):
        raise UserError(
            "--gpus, --global-batch and --inter-node-gbps describe a cluster; "
            "add --cluster PRESET (e.g. h100-ib)"
        )


def _row(o: Any, options: list[Any], stages: int | None = None) -> ScheduleThroughput:
    w = _window(o, options) if not never_delays(o.policy) else None
    return ScheduleThroughput(
        o.schedule,
        o.policy,
        o.tokens_per_s,
        o.bubble,
        (o.peak_memory,),
        o.fits,
        "simulated (cluster model)",
        "",
        o.label(),
        stages,
        w.tokens_per_s if w else math.nan,
        o.update,
    )


def _window(a: Any, options: list[Any]) -> Any:
    """The flushed rate of asynchronous option `a` in a sync window: its schedule's flushed
    order (`ScheduleSpec.flushed`: 1F1B for 2BW) on its P, replicas and sharing (else the
    fastest fitting one of that schedule)."""
    name = PIPELINE_SCHEDULES[a.schedule].flushed
    flushed = [o for o in options if o.schedule == name and o.fits]
    same = [
        o for o in flushed if (o.stages, o.replicas, o.across) == (a.stages, a.replicas, a.across)
    ]
    return max(same or flushed, key=lambda o: o.tokens_per_s, default=None)


def _best_row(mine: list[Any], options: list[Any], stages: int | None = None) -> ScheduleThroughput:
    """The fastest fitting of `mine`, else the one nearest to fitting (marked as not fitting)."""
    top = best(mine, mine[0].policy) or min(mine, key=lambda o: o.peak_memory)
    return _row(top, options, stages)


def throughputs(s: Setting) -> tuple[Throughputs, list[Any]]:
    """One row per kind of synchronous contender (dp, zero1, zero2, fsdp, hsdp, each pipeline
    schedule, its best configuration over TP, P, D, placement), 2BW's best over P, PipeDream's best at each P (its
    delay grows with P: a run is judged at its own P), and every option timed."""
    asyncs = cluster_schedules(sync=False)  # 2bw, pipedream: the registry's, in its order
    options = all_options(s.workload(), s.cluster, asyncs)
    rows = []
    for name in (*KINDS, *cluster_schedules(sync=True), ASYNC):
        mine = [o for o in options if o.schedule == name]
        if mine:
            rows.append(_best_row(mine, options))
    for name in (n for n in asyncs if n != ASYNC):
        for p in sorted({o.stages for o in options if o.schedule == name}):
            rows.append(
                _best_row([o for o in options if (o.schedule, o.stages) == (name, p)], options, p)
            )
    a = best(options, ASYNC)
    window = _window(a, options) if a else None
    c = s.cluster
    left = [o for o in options if not o.fits]
    lines = [
        f"throughput and memory: simulated, cluster model (sim/parallel.py): {s.model} "
        f"({s.seq_len}-token sequences) on {s.gpus} GPUs of {c.describe()}; global batch "
        f"{s.global_batch} sequences = {s.global_batch * s.seq_len} tokens per step; MFU "
        f"{mfu_text(s)}; {len(options)} configurations, the best of each "
        "kind shown (docs/verdict.md, 'The cluster model', states the assumptions)",
        f"left out, over {c.memory_gb:g} GB per GPU ({len(left)}): "
        + (", ".join(f"{o.label()} ({o.peak_memory / 1e9:.0f} GB)" for o in left[:12]) or "none")
        + (f", and {len(left) - 12} more" if len(left) > 12 else ""),
    ]
    low, high = edge_range(s.workload(), c, options)
    lines.append(assumptions_line(s, low, high, edge(options)))
    lines.insert(1, optimizer_line(s, best(options), a))
    low, high = with_model_error(low, high)
    short = f"{s.model} on {s.gpus} x {c.name}, global batch {s.global_batch} (cluster model)"
    rate = window.tokens_per_s if window else math.nan
    target = count_params(s.cfg)["non_embedding"]
    tp = Throughputs(rows, rate, a and a.stages, lines, short, (low, high), target, MODEL_ERROR)
    tp.arm = s.arm
    return tp, options


def arm_throughputs(s: Setting, arms: list[Arm]) -> dict[Arm, Throughputs]:
    """`throughputs` for each arm (in order), each costed with its own optimizer."""
    return {arm: throughputs(dataclasses.replace(s, arm=arm))[0] for arm in arms}


def arm_lines(tps: dict[Arm, Throughputs]) -> list[str]:
    """The 'inputs' lines of throughputs per arm: the cluster model's (its first arm's) once,
    then each arm's own (optimizer, left out, assumptions and edge), named by the arm."""
    first = next(iter(tps.values()))
    if len(tps) == 1:
        return first.describe()
    head = re.sub(
        r"\d+ configurations, the best", "each arm's configurations, the best", first.lines[0]
    )
    out = [head]
    for arm, tp in tps.items():
        out += [f"{arm.label()}: {line}" for line in tp.lines[1:]]
    return out


def optimizer_line(s: Setting, sync: Any, a: Any) -> str:
    """The 'inputs' line of the arm's optimizer (`sim.optimizer`): what its update costs, and
    what it takes a step on the best synchronous and the best 2BW configurations."""
    arm = s.arm
    if arm.muon:
        mats = model_matrices(s.cfg, arm.ns_steps)
        what = (
            f"Muon ({arm.ns_steps} Newton-Schulz steps on the {mats.params / 1e6:.0f}M matrix "
            f"parameters: {mats.flops / 1e12:.3g} TFLOP a step at MFU "
            f"{ns_mfu(s.cfg, s.mfu):.2f}, replicated or sharded over the replicas, the faster; "
            f"24 HBM bytes and 4 B of state a matrix parameter) with AdamW on the rest "
            f"(28 HBM bytes, 8 B of state a parameter)"
        )
    else:
        what = "AdamW (28 HBM bytes and 8 B of state a parameter)"
    ef = "; error feedback on 2BW (4 B a parameter, 8 HBM bytes)" if arm.ef else ""

    def took(o: Any) -> str:
        return f"{o.update * 1e3:.2f} ms ({o.label()})" if o else "none fits"

    return (
        f"optimizer: {what}{ef} (sim/optimizer.py); its update a step: best synchronous "
        f"{took(sync)}, best 2BW {took(a)}"
    )


def mfu_text(s: Setting) -> str:
    """How the compute efficiency is set: the user's one MFU, or the calibrated curve."""
    if s.mfu is not None:
        return f"{s.mfu:.2f} for every configuration (--mfu)"
    return (
        f"by matmul size, {E_MAX:.3f} x / (x + {X_HALF:.3g}) with x a block's FLOPs per "
        f"microbatch and GPU (sim/efficiency.py, fitted on Narayanan et al. Table 1)"
    )


def with_model_error(low: float, high: float) -> tuple[float, float]:
    """The edge's factors over the assumptions widened by the throughput model's held-out
    error (`MODEL_ERROR`, docs/verdict.md): the edge anywhere in [1 - e, 1 + e] x its value."""
    return low * (1 - MODEL_ERROR), high * (1 + MODEL_ERROR)


def edge(options: list[Any]) -> float:
    """2BW's throughput edge: its fastest fitting option over the fastest synchronous one."""
    a, s = best(options, ASYNC), best(options)
    return a.tokens_per_s / s.tokens_per_s if a and s else math.nan


def edge_range(w: Any, c: Any, options: list[Any]) -> tuple[float, float]:
    """The edge's lowest and highest value over the corners of the assumptions' ranges
    (`sim.cluster.assumption_corners`), over its value at the central ones (`options`)."""
    central = edge(options)
    if not math.isfinite(central):
        return 1.0, 1.0
    edges = [edge(all_options(wc, cc, best_only=True)) for wc, cc in assumption_corners(w, c)]
    edges = [e for e in edges if math.isfinite(e)]
    return min([central, *edges]) / central, max([central, *edges]) / central


def assumptions_line(s: Setting, low: float, high: float, central: float) -> str:
    """The 'inputs' line naming each assumption's central value and range, and the edge's."""
    m = "-".join(f"{f:.2f}" for f in MFU_RANGE)
    mfu = f"{s.mfu:.2f} (x{m})" if s.mfu is not None else f"by shape (x{m})"
    eff = "-".join(f"{x:.2f}" for x in link_efficiency_range(s.cluster))
    cost = "-".join(f"{x:.2f}" for x in OVERLAP_COST_RANGE)
    e = MODEL_ERROR
    return (
        f"assumptions (central, range): MFU {mfu}, link efficiency "
        f"{s.cluster.link_efficiency:.2f} ({eff}), overlap cost {s.workload().overlap_cost:.2f} "
        f"({cost}); 2BW's "
        f"edge {central:.3f}x, {central * low:.3f}-{central * high:.3f}x over their corners; "
        f"model error +-{e:.1%} (held-out median, worst {MODEL_ERROR_WORST:.0%}: "
        f"benchmarks/validation/cluster_published.py): "
        f"{central * low * (1 - e):.3f}-{central * high * (1 + e):.3f}x"
    )


@dataclass(frozen=True)
class Cell:
    """One point of the map: the best asynchronous and synchronous configurations."""

    gpus: int
    global_batch: int
    inter_gbps: float
    async_option: Any  # sim.parallel.Option or None
    sync_option: Any
    edge_factors: tuple[float, float] = (1.0, 1.0)  # over the assumptions (`edge_range`)
    arm: Arm = ADAMW  # the optimizer both are costed with

    @property
    def speedup(self) -> float:
        if self.async_option is None or self.sync_option is None:
            return math.nan
        return self.async_option.tokens_per_s / self.sync_option.tokens_per_s


def crossover_map(
    s: Setting, workers: int | None = None, arms: list[Arm] | None = None
) -> list[Cell]:
    """The best async and sync configurations at every (GPU count, global batch, inter-node
    bandwidth) of the map around the setting, each with its edge over the assumptions' corners,
    for each of `arms` (default the setting's: each arm costed with its optimizer); a cell
    where the batch is below the GPU count, or the GPU count is not whole nodes, is left out.
    The (arm, GPU count, batch) rows run in `workers` processes (default: the CPUs, at most 8;
    forked, so the pipeline timings cached so far come along)."""
    g = int(s.cluster.gpus_per_node)
    gpus = sorted(
        {n for f in MAP_GPUS if (n := int(s.gpus * f)) >= 1 and (n % g == 0 or g % n == 0)}
    )
    batches = sorted({int(s.global_batch * f) for f in MAP_BATCH})
    # a row holds every arm: the arms sharing a synchronous optimizer share its timings
    # (`sim.parallel.all_options`' cache) in one process
    rows = [(s, tuple(arms or (s.arm,)), n, b) for n in gpus for b in batches if b >= n]
    workers = min(workers or os.cpu_count() or 1, 8, len(rows))
    # What this process holds (a test session's, a notebook's) is frozen out of the map's
    # garbage collections, and each row freezes what it cached (`_map_row`): each collection
    # would otherwise walk it all again (a tenth of the map's CPU in one process) and, in a
    # forked child, copy its pages (copy-on-write: a fifth more CPU under a loaded heap, issue
    # 54). The collector gets them all back after the map.
    gc.freeze()
    try:
        if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            cells = [c for row in rows for c in _map_row(row)]
        else:
            ctx = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
                cells = [c for cells in pool.map(_map_row, rows) for c in cells]
    finally:
        gc.unfreeze()
    order = {arm: i for i, arm in enumerate(arms or (s.arm,))}
    return sorted(cells, key=lambda c: order[c.arm])  # stable: each arm's in the map's order


def _map_row(row: tuple[Setting, tuple[Arm, ...], int, int]) -> list[Cell]:
    """The map's cells of one GPU count and global batch, at every inter-node bandwidth, for
    each arm."""
    s, arms, n, b = row
    cells = []
    for arm in arms:
        w = dataclasses.replace(s.workload(n, b), arm=arm)
        for bw in sorted({*MAP_GBPS, s.cluster.inter_node_gbps}):
            c = dataclasses.replace(s.cluster, inter_node_gbps=bw)
            opts = all_options(w, c, best_only=True)
            factors = with_model_error(*edge_range(w, c, opts))
            cells.append(Cell(n, b, bw, best(opts, ASYNC), best(opts), factors, arm))
    gc.freeze()  # what the row cached: out of the next rows' collections (`crossover_map`)
    return cells


def arm_cells(v: Verdict, cells: list[Cell]) -> list[Cell]:
    """The cells costed with `v`'s arm's optimizer (all of them where `v` has no arm)."""
    mine = [c for c in cells if c.arm == v.arm]
    return mine if v.arm is not None else cells


def cell_verdict(v: Verdict, c: Cell) -> str:
    """The rule's call for one delayed configuration at one cell, over the seeds and the
    assumptions' ranges, shortened to its kind."""
    if not math.isfinite(c.speedup):
        return "inconclusive"
    target = v.target if v.target is not None else v.overhead
    ratio = widen(time_to_target(target, c.speedup), *c.edge_factors, v.transfer, c.speedup)
    verdict = call(target, ratio, c.speedup * c.edge_factors[1] / v.transfer.low)
    return next((k for k in COLORS if verdict.startswith(k)), "inconclusive")


def headline(verdicts: list[Verdict], most: int = 3) -> list[Verdict]:
    """The delayed configurations the map draws: those with a measured overhead at sync's
    final loss and its interval (2 seeds or more), those with the seeds for a verdict (3)
    first, then lowest first (at most `most`); else the first configuration. A one-seed run
    has no interval to carry through the map, so it is never drawn over a measured one. The
    map is 2BW's: other schedules' configurations are not drawn, nor longer lengths (`at_length`)."""
    verdicts = [v for v in verdicts if v.schedule == ASYNC]
    verdicts = [v for v in verdicts if not v.at_length] or verdicts
    measured = [
        v for v in verdicts if v.target is not None and math.isfinite(v.target.interval()[1])
    ]

    def key(v: Verdict) -> tuple[bool, float]:
        return len(v.target.seeds) < 3, v.target.interval()[0]

    return sorted(measured, key=key)[:most] or verdicts[:1]


def map_csv(cells: list[Cell], shown: list[Verdict]) -> str:
    """verdict_map.csv's text, one row per cell and arm (the optimizer both configurations are
    costed with): the two best configurations, their rates, the edge (central, and its lowest
    and highest over the assumptions' corners), and each drawn verdict of that arm (empty for
    another arm's)."""
    header = ["arm", "gpus", "global_batch", "inter_node_gbps", "async_config", "async_tokens_per_s",
              "sync_config", "sync_tokens_per_s", "speedup", "speedup_low", "speedup_high",
              *(v.label for v in shown)]  # fmt: skip
    rows: list[list[Any]] = [header]
    for c in cells:
        a, s = c.async_option, c.sync_option
        rows.append(
            [
                c.arm.label(),
                c.gpus,
                c.global_batch,
                c.inter_gbps,
                a.label() if a else "none fits",
                a.tokens_per_s if a else "",
                s.label() if s else "none fits",
                s.tokens_per_s if s else "",
                c.speedup,
                c.speedup * c.edge_factors[0],
                c.speedup * c.edge_factors[1],
                *(cell_verdict(v, c) if v.arm in (None, c.arm) else "" for v in shown),
            ]
        )
    return csv_text(rows)


def map_plot(cells: list[Cell], shown: list[Verdict], title: str) -> bytes:
    """verdict.png: one row of panels per drawn configuration, one panel per GPU count; x the
    global batch (m = batch / replicas), y the inter-node bandwidth; each cell coloured by the
    rule's call and labelled with the throughput edge async / best sync."""
    plt = pyplot()
    gpus = sorted({c.gpus for c in cells})
    batches = sorted({c.global_batch for c in cells})
    gbps = sorted({c.inter_gbps for c in cells})
    fig, axes = plt.subplots(
        len(shown), len(gpus), squeeze=False, figsize=(3.3 * len(gpus), 2.9 * len(shown) + 0.8)
    )
    for i, v in enumerate(shown):
        for j, n in enumerate(gpus):
            ax = axes[i][j]
            for c in (c for c in arm_cells(v, cells) if c.gpus == n):
                x, y = batches.index(c.global_batch), gbps.index(c.inter_gbps)
                kind = cell_verdict(v, c)
                ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, color=COLORS[kind], lw=0))
                ink = "white" if kind == "async sooner" else "black"
                ax.text(x, y, f"{c.speedup:.2f}", ha="center", va="center", fontsize=6, color=ink)
            ax.set_xlim(-0.5, len(batches) - 0.5)
            ax.set_ylim(-0.5, len(gbps) - 0.5)
            ax.set_xticks(range(len(batches)), [str(b) for b in batches], fontsize=7)
            ax.set_yticks(range(len(gbps)), [f"{g:g}" for g in gbps], fontsize=7)
            arm = f" ({v.arm.label()})" if v.arm is not None else ""
            ax.set_title(f"{v.label}{arm}: {n} GPUs", fontsize=8)
            if i == len(shown) - 1:
                ax.set_xlabel("global batch (sequences)", fontsize=7)
            if j == 0:
                ax.set_ylabel("inter-node Gb/s per GPU", fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=col) for col in COLORS.values()]
    labels = [*COLORS]
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(
        f"{title}\ncell text: throughput 2bw / best synchronous; colour: time to sync's final "
        "loss by the verdict's rule over the seeds and the assumptions' ranges; no cell: fewer "
        "sequences than GPUs",
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    return png_bytes(fig)


def map_summary(cells: list[Cell], shown: list[Verdict]) -> str:
    """The 'inputs' line that says what the map covers, how often each call comes out and where
    async is sooner (`where_sooner`)."""
    counts = []
    for v in shown:
        calls = [(c.gpus, c.global_batch, cell_verdict(v, c)) for c in arm_cells(v, cells)]
        kinds = [k for *_, k in calls]
        tally = ", ".join(f"{kinds.count(k)} {k}" for k in COLORS)
        counts.append(f"{v.label}: {tally} (async sooner at {where_sooner(calls)})")
    gpus = sorted({c.gpus for c in cells})
    batches = sorted({c.global_batch for c in cells})
    gbps = sorted({c.inter_gbps for c in cells})
    arms = list(dict.fromkeys(c.arm for c in cells))
    each = f" for each of {len(arms)} arms' optimizers" if len(arms) > 1 else ""
    return (
        f"crossover map (verdict.png, verdict_map.csv): {len(cells) // max(1, len(arms))} cells{each}, "
        f"GPUs {gpus}, global "
        f"batch {batches} sequences, inter-node {[f'{g:g}' for g in gbps]} Gb/s per GPU; "
        + "; ".join(counts)
    )


def where_sooner(calls: list[tuple[int, int, str]]) -> str:
    """Where the map calls async sooner, from (GPU count, global batch, call) per cell: each GPU
    count with the sequences per GPU of its async-sooner cells (at some link speed), e.g. '32
    GPUs x 2, 64 GPUs x 1-16 sequences a GPU'; 'nowhere' when none. The README's sentence is
    this text (tests/verdict/test_verdict_numbers.py)."""
    per: dict[int, set[int]] = {}
    for gpus, batch, kind in calls:
        if kind == "async sooner":
            per.setdefault(gpus, set()).add(batch // gpus)
    if not per:
        return "nowhere"
    parts = []
    for gpus, each in sorted(per.items()):
        lo, hi = min(each), max(each)
        parts.append(f"{gpus} GPUs x {lo}" + (f"-{hi}" if hi > lo else ""))
    return ", ".join(parts) + " sequences a GPU"
