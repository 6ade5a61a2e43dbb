"""Discrete-event timing of a pipeline schedule on a cost model.

Each rank runs its action list in order (schedule.py); an action starts when its rank is free
and its dependencies have finished, plus the point-to-point transfer time for an activation or
gradient that crosses ranks (latency + bytes / bandwidth; links never contend, sends never
block the sender). Nothing else is modelled: no kernel overlap, no data-parallel all-reduce.

Cost models: `uniform_costs` (per-stage times you give, in any unit; F = BI = BW = 1 by
default) or `analytic_costs` (a model's FLOPs from split_layers + block/head FLOPs, a device's
peak FLOP/s times an MFU; BI = BW = F, the zero-bubble paper's approximation; optimizer
memory-bound at ~28 bytes of traffic per parameter for fp32 AdamW).

Figures (`summarize`): makespan; bubble = idle share of R x makespan (optimizer time counts as
busy); throughput; steady-state step time (median gap between consecutive step completions)
and its bubble -- the figures that matter for schedules without a flush, whose fill and drain
are paid once per run; per stage the peak stashed microbatches, peak weight versions and
staleness, and per rank the peak memory (`sim.memory`; from the schedule's order alone).
"""

from __future__ import annotations

import csv
import functools
import io
import math
import statistics
from dataclasses import dataclass

from stalepipe.config import ConfigError, ModelConfig
from stalepipe.config.shapes import block_flops, block_params, head_flops, split_layers
from stalepipe.hardware import Device
from stalepipe.lab.sim.balance import rank_balanced_layers
from stalepipe.lab.sim.memory import RankMemory, memory_trace, rank_memory
from stalepipe.training.schedules.schedule import (
    Action,
    PipelineSchedule,
    dependencies,
    execution_order,
    observed_staleness,
    peak_activations,
    peak_versions,
)

# Activation bytes stashed per token per layer without recomputation, in units of dim:
# Korthikanti et al. 2022 ("Reducing Activation Recomputation"), 34 * s * b * h bytes per layer
# with flash attention (the 5 * a * s / h term for the score matrix is gone).
ACT_BYTES_PER_TOKEN_DIM = 34


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Per-stage durations of one microbatch (F, BI, BW) and of one update, plus p2p links.
    `tokens_per_microbatch` = 0 reports throughput in microbatches per time unit."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    optimizer: tuple[float, ...]
    p2p_latency: float = 0.0
    intra_node_bandwidth: float = math.inf
    inter_node_bandwidth: float = math.inf
    ranks_per_node: int = 8
    message_bytes: float = 0.0  # activation (= gradient) bytes per microbatch between stages
    tokens_per_microbatch: int = 0
    # Memory per stage (sim.memory), in `memory_unit`: "B" (bytes) or "unit" (uniform
    # costs: one rank's share of the weights, one microbatch's stash on it); 0 = unknown.
    weight_bytes: tuple[float, ...] = ()  # one weight version
    state_bytes: tuple[float, ...] = ()  # gradient accumulator + optimizer state, one copy
    activation_bytes: tuple[float, ...] = ()  # one stashed microbatch
    memory_unit: str = "B"
    time_unit: str = "unit"

    def __post_init__(self) -> None:
        n = len(self.forward)
        for name in ("backward_input", "backward_weight", "optimizer"):
            assert len(getattr(self, name)) == n, (name, n)
        for name in ("weight_bytes", "state_bytes", "activation_bytes"):
            if not getattr(self, name):
                object.__setattr__(self, name, (0.0,) * n)
            assert len(getattr(self, name)) == n, (name, n)
        assert self.memory_unit in ("B", "unit"), self.memory_unit

    @property
    def has_memory(self) -> bool:
        """Whether the model gives memory sizes (else memory figures are all 0)."""
        return any(self.weight_bytes) or any(self.activation_bytes)

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def duration(self, a: Action) -> float:
        s = a.stage
        return {
            "F": self.forward[s],
            "B": self.backward_input[s] + self.backward_weight[s],
            "BI": self.backward_input[s],
            "BW": self.backward_weight[s],
            "STEP": self.optimizer[s],
        }[a.kind]

    def transfer(self, src_rank: int, dst_rank: int) -> float:
        """Time to move one activation or gradient from `src_rank` to `dst_rank`."""
        if src_rank == dst_rank:
            return 0.0
        same_node = src_rank // self.ranks_per_node == dst_rank // self.ranks_per_node
        bw = self.intra_node_bandwidth if same_node else self.inter_node_bandwidth
        return self.p2p_latency + self.message_bytes / bw


def uniform_costs(
    num_stages: int,
    forward: float | list[float] = 1.0,
    backward_input: float | list[float] = 1.0,
    backward_weight: float | list[float] = 1.0,
    optimizer: float | list[float] = 0.0,
    *,
    weight: float = 1.0,
    activation: float = 1.0,
    **kw: object,
) -> CostModel:
    """A cost model from given times: a number for every stage, or one per stage. Memory in
    units: `weight` is one stage's weight version, `activation` one microbatch's stash on it
    (give 1/v each with v chunks per rank, so a rank's share is 1 unit)."""

    def per_stage(x: float | list[float], name: str) -> tuple[float, ...]:
        xs = [float(x)] * num_stages if isinstance(x, int | float) else [float(v) for v in x]
        if len(xs) != num_stages:
            raise ConfigError(f"{name} times: need 1 or {num_stages} values, got {len(xs)}")
        if any(v < 0 for v in xs):
            raise ConfigError(f"{name} times must be >= 0, got {xs}")
        return tuple(xs)

    return CostModel(
        forward=per_stage(forward, "forward"),
        backward_input=per_stage(backward_input, "backward_input"),
        backward_weight=per_stage(backward_weight, "backward_weight"),
        optimizer=per_stage(optimizer, "optimizer"),
        weight_bytes=(float(weight),) * num_stages,
        activation_bytes=(float(activation),) * num_stages,
        memory_unit="unit",
        **kw,  # type: ignore[arg-type]
    )


def stage_params(cfg: ModelConfig, layers: list[range]) -> list[int]:
    """Parameters owned by each stage (embedding on stage 0, untied head and norm on the last)."""
    emb = cfg.vocab_size * cfg.dim
    out = []
    for s, r in enumerate(layers):
        p = sum(block_params(cfg, i) for i in r)  # dense and MoE blocks may differ
        p += emb if s == 0 else 0
        if s == len(layers) - 1:
            p += cfg.dim + (0 if cfg.tie_embeddings else emb)
        out.append(p)
    return out


@functools.lru_cache(maxsize=1024)
def _split(
    cfg: ModelConfig, num_stages: int, seq_len: int, partition: str, ranks: tuple | None
) -> tuple[tuple[range, ...], tuple[int, ...], tuple[float, ...]]:
    """`analytic_costs`' stages (cached: the split depends on none of the device, MFU or
    microbatch): each stage's blocks, parameters and forward FLOPs per token."""
    if partition != "balanced":
        layers = split_layers(cfg, num_stages, seq_len, partition)
    elif ranks is not None and len(set(ranks)) < num_stages:
        assert len(ranks) == num_stages, (ranks, num_stages)
        layers = rank_balanced_layers(cfg, seq_len, ranks)
    else:
        layers = split_layers(cfg, num_stages, seq_len)
    flops = []
    for s, r in enumerate(layers):
        f = sum(block_flops(cfg, seq_len, i) for i in r)
        flops.append(f + (head_flops(cfg) if s == num_stages - 1 else 0))
    return tuple(layers), tuple(stage_params(cfg, layers)), tuple(flops)


def analytic_costs(
    cfg: ModelConfig,
    num_stages: int,
    device: Device,
    *,
    mfu: float = 0.4,
    seq_len: int | None = None,
    microbatch_size: int = 1,
    optimizer_bytes_per_param: float = 28.0,
    param_bytes: float = 2.0,
    state_bytes_per_param: float = 16.0,
    stage_ranks: tuple[int, ...] | None = None,
    partition: str = "balanced",
) -> CostModel:
    """Seconds per microbatch from FLOPs: F = tokens * stage FLOPs / (peak * mfu), or the
    time to read the stage's weights from HBM when that is longer (a roofline); BI = BW = F
    (backward = 2 x forward); optimizer = params * bytes moved / HBM bandwidth; messages are
    bf16 hidden states (tokens * dim * 2 bytes). Stages as in `split_layers`, or, given the
    rank of every stage (`stage_ranks`, a schedule with chunks), balanced per rank
    (`sim.balance`); `partition` `uniform` or "3,2,2,1" (blocks per stage, as
    `pipeline.partition`) splits as given instead.

    Memory, in bytes, mixed-precision AdamW as Megatron-LM keeps it: `param_bytes` (bf16) per
    parameter per weight version (a stashed version is another bf16 copy), plus
    `state_bytes_per_param` once (fp32 gradient accumulator 4 + fp32 master weights 4 + Adam
    moments 8 = 16; 18 bytes a parameter in all with one version); activations
    `ACT_BYTES_PER_TOKEN_DIM` per token per layer per dim. Not counted: the logits and loss
    buffers of the last stage, communication buffers, the CUDA context, fragmentation."""
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu must be in (0, 1], got {mfu}")
    if microbatch_size < 1:
        raise ConfigError(f"--microbatch-size must be >= 1, got {microbatch_size}")
    seq_len = seq_len or cfg.max_seq_len
    ranks = None if stage_ranks is None else tuple(stage_ranks)
    layers, params, stage_flops = _split(cfg, num_stages, seq_len, partition, ranks)
    tokens = microbatch_size * seq_len
    speed = device.peak_flops * mfu
    fwd = []
    for s, flops in enumerate(stage_flops):
        # the roofline: compute, or reading the stage's weights (short microbatches)
        fwd.append(max(tokens * flops / speed, params[s] * param_bytes / device.hbm_bandwidth))
    return CostModel(
        forward=tuple(fwd),
        backward_input=tuple(fwd),
        backward_weight=tuple(fwd),
        optimizer=tuple(p * optimizer_bytes_per_param / device.hbm_bandwidth for p in params),
        p2p_latency=device.p2p_latency,
        intra_node_bandwidth=device.intra_node_bandwidth,
        inter_node_bandwidth=device.inter_node_bandwidth,
        ranks_per_node=device.gpus_per_node,
        message_bytes=tokens * cfg.dim * 2.0,
        tokens_per_microbatch=tokens,
        weight_bytes=tuple(p * param_bytes for p in params),
        state_bytes=tuple(p * state_bytes_per_param for p in params),
        activation_bytes=tuple(len(r) * tokens * cfg.dim * ACT_BYTES_PER_TOKEN_DIM for r in layers),
        time_unit="s",
    )


# --------------------------------------------------------------------------------------------
# Simulation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One timed action."""

    rank: int
    index: int  # position in the rank's list
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    schedule: PipelineSchedule
    costs: CostModel
    events: tuple[Event, ...]

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.events), default=0.0)

    def to_csv(self, path: str | None = None, *, header: bool = True) -> str:
        """One row per action with its start and end time, and what its rank holds after it:
        `weight_mem` (live versions + optimizer state) and `act_mem` (stashes), in the cost
        model's memory unit (`mem_unit`: B or unit; 0 when the model gives no sizes)."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        if header:
            w.writerow(
                [
                    "schedule",
                    "rank",
                    "index",
                    "kind",
                    "stage",
                    "chunk",
                    "step",
                    "microbatch",
                    "version",
                    "start",
                    "end",
                    "weight_mem",
                    "act_mem",
                    "mem_unit",
                ]
            )
        sched, c = self.schedule, self.costs
        sizes = (c.weight_bytes, c.state_bytes, c.activation_bytes)
        traces = [memory_trace(sched, r, *sizes) for r in range(sched.num_ranks)]
        for e in self.events:
            a = e.action
            held = traces[e.rank][e.index]
            w.writerow(
                [sched.name, e.rank, e.index, a.kind, a.stage, sched.chunk_of(a.stage), a.step]
                + [a.microbatch, a.shown, f"{e.start:.9g}", f"{e.end:.9g}"]
                + [f"{held[0]:.6g}", f"{held[1]:.6g}", c.memory_unit]
            )
        if path is not None:
            with open(path, "w") as f:
                f.write(buf.getvalue())
        return buf.getvalue()


def simulate(sched: PipelineSchedule, costs: CostModel) -> Timeline:
    """Time every action of `sched` under `costs` (see the module docstring for the rules)."""
    if costs.num_stages != sched.num_stages:
        raise ConfigError(
            f"cost model has {costs.num_stages} stages, schedule {sched.name!r} has "
            f"{sched.num_stages}"
        )
    # Any order that runs each action after its dependencies gives the same times: an
    # action starts when its rank is free and its inputs have arrived.
    end: dict[tuple, float] = {}
    free = [0.0] * sched.num_ranks
    index = [0] * sched.num_ranks
    events: list[Event] = []
    for r, a in execution_order(sched):
        start = free[r]
        for key, msg in dependencies(sched, a):
            arrive = end[key]
            if msg is not None:
                arrive += costs.transfer(sched.rank_of(key[1]), r)
            start = max(start, arrive)
        end[a.key] = free[r] = start + costs.duration(a)
        events.append(Event(r, index[r], a, start, free[r]))
        index[r] += 1
    events.sort(key=lambda e: (e.rank, e.index))
    return Timeline(sched, costs, tuple(events))


@dataclass(frozen=True)
class SimResult:
    """What `summarize` reports for one simulated schedule. Times in the cost model's unit."""

    name: str
    policy: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    num_steps: int
    makespan: float
    bubble: float
    throughput: float  # tokens (or microbatches if the cost model has no tokens) per unit
    step_time: float  # steady-state time per optimizer step
    steady_bubble: float
    steady_throughput: float
    peak_activations: tuple[int, ...]  # per stage
    peak_versions: tuple[int, ...]  # per stage
    staleness: tuple[int, ...]  # per stage, largest step - version
    rank_memory: tuple[RankMemory, ...]  # per rank: peaks of weights, activations, total
    memory_unit: str  # "B" or "unit" (the cost model's)

    @property
    def peak_memory(self) -> tuple[float, ...]:
        """Per rank, the most it holds at once (weights + optimizer state + activations)."""
        return tuple(m.total for m in self.rank_memory)


def summarize(tl: Timeline) -> SimResult:
    """Makespan, bubble, throughput, steady state, and per-stage memory and staleness."""
    sched, costs = tl.schedule, tl.costs
    R, makespan = sched.num_ranks, tl.makespan
    busy = sum(e.end - e.start for e in tl.events)
    bubble = 1.0 - busy / (R * makespan) if makespan > 0 else 0.0
    per_mb = costs.tokens_per_microbatch or 1
    work = sched.num_steps * sched.num_microbatches * per_mb
    done = [0.0] * sched.num_steps
    for e in tl.events:
        if e.action.kind == "STEP":
            done[e.action.step] = max(done[e.action.step], e.end)
    gaps = [b - a for a, b in zip(done, done[1:])]
    step_time = statistics.median(gaps) if gaps else makespan
    busy_step = busy / sched.num_steps
    steady_bubble = 1.0 - busy_step / (R * step_time) if step_time > 0 else 0.0
    acts, vers = peak_activations(sched), peak_versions(sched)
    mem = rank_memory(sched, costs.weight_bytes, costs.state_bytes, costs.activation_bytes)
    return SimResult(
        name=sched.name,
        policy=sched.policy,
        num_ranks=R,
        num_stages=sched.num_stages,
        num_microbatches=sched.num_microbatches,
        num_steps=sched.num_steps,
        makespan=makespan,
        bubble=max(bubble, 0.0),
        throughput=work / makespan if makespan > 0 else 0.0,
        step_time=step_time,
        steady_bubble=max(steady_bubble, 0.0),
        steady_throughput=sched.num_microbatches * per_mb / step_time if step_time else 0.0,
        peak_activations=tuple(acts),
        peak_versions=tuple(vers),
        staleness=tuple(observed_staleness(sched)),
        rank_memory=mem,
        memory_unit=costs.memory_unit,
    )
