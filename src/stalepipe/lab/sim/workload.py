"""The cluster model's shared parts (docs/verdict.md, 'The cluster model'; `sim.parallel` states
the model): what is trained (`Workload`), one configuration (`Option`), the FSDP units, and one
pipeline replica's simulated steady step (`pipeline_timing`), which `sim.replicas` (the data-
parallel family) and `sim.hybrid` (pipelines of replicas) build on."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from stalepipe.config import ConfigError, ModelConfig
from stalepipe.config.registry import PIPELINE_SCHEDULES
from stalepipe.config.shapes import block_flops, block_params, head_flops
from stalepipe.hardware import Device
from stalepipe.lab.sim.efficiency import shape_mfu
from stalepipe.lab.sim.memory import RankMemory, rank_memory
from stalepipe.lab.sim.optimizer import (
    ADAMW,
    ELEMENTWISE,
    Arm,
    Matrices,
    Update,
    layers_matrices,
)
from stalepipe.lab.sim.simulate import model_costs
from stalepipe.lab.sim.steady import Plan, Steady, plan
from stalepipe.lab.sim.timing import CostModel, _split
from stalepipe.training.delay.policies import never_delays, parse_policy

PARAM_BYTES = 2.0  # bf16 weights: one version, and what FSDP gathers
STATE_BYTES = 16.0  # fp32 grad accumulator 4 + fp32 master 4 + AdamW moments 8 (timing.py)
GRAD_BYTES = 4.0  # gradients are reduced in fp32 (torchtitan's default reduce dtype)
# the optimizer's own: per arm, `sim.optimizer` (AdamW's 28 HBM bytes a parameter, Muon's
# Newton-Schulz, EF's buffer)
MAX_SIM_MICROBATCHES = 16
SIM_STEPS = 3


def cluster_schedules(sync: bool) -> tuple[str, ...]:
    """The registered pipeline schedules the cluster model compares (`ScheduleSpec.cluster`),
    the synchronous ones or the others, in the registry's order: a schedule registered later
    is compared with no change here."""
    return tuple(
        name
        for name, spec in PIPELINE_SCHEDULES.items()
        if spec.cluster and never_delays(spec.policy) == sync
    )


@dataclass(frozen=True)
class Workload:
    """What is trained: a model shape, its sequence length, the global batch (sequences per
    optimizer step) and the number of GPUs, at a model FLOPs utilisation `mfu` (the compute
    roof; `compute_time` adds the memory roof; None: by shape, `sim.efficiency`), times
    `mfu_scale` (the assumptions' corners), with communication that slows the compute it
    hides behind by `overlap_cost` of its own time (`sim.cluster.OVERLAP_COST_RANGE`), trained
    by `arm`'s optimizer (`sim.optimizer`; error feedback on its asynchronous schedules)."""

    cfg: ModelConfig
    seq_len: int
    global_batch: int
    num_gpus: int
    mfu: float | None = 0.4
    overlap_cost: float = 0.05
    mfu_scale: float = 1.0
    arm: Arm = ADAMW

    def mfu_at(self, tokens: float, tp: int = 1) -> float:
        """The MFU of a microbatch of `tokens` split `tp` ways: the given one, or the
        calibrated curve's (`sim.efficiency.shape_mfu`), times `mfu_scale`, at most 1."""
        base = shape_mfu(self.cfg, self.seq_len, tokens, tp) if self.mfu is None else self.mfu
        return base if self.mfu_scale == 1.0 else min(1.0, base * self.mfu_scale)


@dataclass(frozen=True)
class Option:
    """One configuration: how it trains, its steady step and memory on the largest rank."""

    schedule: str  # "dp", "fsdp" or a pipeline schedule
    policy: str  # "sync" or the delay policy the schedule realises
    stages: int  # P (1 without a pipeline)
    replicas: int  # D
    across: str  # how replicas share gradients: "dp" or "fsdp"
    microbatches: int  # per replica per step
    microbatch_size: int  # sequences
    placement: str  # "" (one node, or no pipeline), "stages in a node", "replicas in a node"
    step_time: float  # seconds
    exposed_comm: float  # seconds of the step spent on gradient / weight traffic alone
    bubble: float
    peak_memory: float  # bytes, the largest rank
    memory_limit: float
    tokens_per_s: float
    tp: int = 1  # tensor-parallel degree inside a node (`sim.replicas`)
    recompute: str = "none"  # activation recomputation: none, selective, full
    ep: int = 1  # expert-parallel degree (MoE, `sim.replicas`, `sim.hybrid`)
    cp: int = 1  # context-parallel degree: each sequence over `cp` GPUs (`sim.replicas`)
    ns: str = ""  # where Muon's Newton-Schulz runs (`sim.optimizer.PLACEMENTS`; "": no NS)
    update: float = 0.0  # seconds a step the optimizer takes on the critical rank (NS included)

    @property
    def fits(self) -> bool:
        return self.peak_memory <= self.memory_limit

    @property
    def kind(self) -> str:
        """'dp', 'zero1', 'zero2', 'fsdp', 'hsdp', 'pp' (one replica) or 'hybrid'."""
        if self.stages == 1:
            return self.schedule
        return "pp" if self.replicas == 1 else "hybrid"

    def label(self) -> str:
        """E.g. 'fsdp x16 (microbatch 4)', 'fsdp x32 x tp 8 (microbatch 2, full AC)' or
        '1f1b P=4 x fsdp 4 (stages in a node), m=8 (microbatch 4)'."""
        tp = f" x tp {self.tp}" if self.tp > 1 else ""
        tp += f" x ep {self.ep}" if self.ep > 1 else ""
        tp += f" x cp {self.cp}" if self.cp > 1 else ""
        ac = f", {self.recompute} AC" if self.recompute != "none" else ""
        ac += f", NS {self.ns}" if self.ns else ""
        if self.stages == 1:
            return f"{self.schedule} x{self.replicas}{tp} (microbatch {self.microbatch_size}{ac})"
        rep = f" x {self.across} {self.replicas}" if self.replicas * self.cp > 1 else ""
        where = f" ({self.placement})" if self.placement else ""
        each = ", an update each" if parse_policy(self.policy).per_microbatch else ""
        mb = f"microbatch {self.microbatch_size}{each}{ac}"
        return f"{self.schedule} P={self.stages}{rep}{tp}{where}, m={self.microbatches} ({mb})"


@functools.lru_cache(maxsize=256)
def _units(cfg: ModelConfig, seq_len: int) -> tuple[tuple[int, int], ...]:
    """(parameters, forward FLOPs per token) of each FSDP unit: the blocks, the embedding
    folded into the first, the final norm and untied head into the last (cached: every
    data-parallel configuration asks)."""
    out = [(block_params(cfg, i), block_flops(cfg, seq_len, i)) for i in range(cfg.num_layers)]
    emb = cfg.vocab_size * cfg.dim
    out[0] = (out[0][0] + emb, out[0][1])
    head = cfg.dim + (0 if cfg.tie_embeddings else emb)
    out[-1] = (out[-1][0] + head, out[-1][1] + head_flops(cfg))
    return tuple(out)


@dataclass(frozen=True)
class PipeTiming:
    """One pipeline replica's steady step, as the replicas' gradient traffic needs it."""

    step_time: float
    bubble: float
    memory: tuple[float, ...]  # per rank peak, bytes
    state: tuple[float, ...]  # per rank optimizer state + gradient accumulator (+ EF), bytes
    params: tuple[float, ...]  # per rank parameters
    optimizer: tuple[float, ...]  # per rank update time (as simulated: `sim.optimizer.Update`)
    gap: tuple[float, ...]  # per rank: next step's first forward - this step's last backward
    forward: tuple[float, ...]  # per rank: one microbatch's forward, s
    backward: tuple[float, ...]  # per rank: one microbatch's backward (BI + BW), s
    weights: tuple[float, ...] = ()  # per rank peak of weight versions + state, bytes
    stashed: tuple[float, ...] = ()  # per rank most microbatch stashes held at once
    chunks: tuple[int, ...] = ()  # per rank stages held (2 for interleaved and V schedules)
    last: int = -1  # the rank holding the last stage (the logits)
    matrices: tuple[Matrices, ...] = ()  # per rank what Muon's Newton-Schulz works on

    @staticmethod
    def blend(a: PipeTiming, b: PipeTiming, t: float) -> PipeTiming:
        """a + t (b - a) for the step time, the ranks' busy time (so the bubble), memory and
        stashes (linear extrapolation in m)."""
        mem = tuple(x + t * (y - x) for x, y in zip(a.memory, b.memory))
        stashed = tuple(x + t * (y - x) for x, y in zip(a.stashed, b.stashed))
        step = a.step_time + t * (b.step_time - a.step_time)
        busy_a, busy_b = (1 - a.bubble) * a.step_time, (1 - b.bubble) * b.step_time
        bubble = 1 - (busy_a + t * (busy_b - busy_a)) / step
        return dataclasses.replace(b, step_time=step, bubble=bubble, memory=mem, stashed=stashed)


@functools.lru_cache(maxsize=65536)
def pipeline_timing(
    cfg: ModelConfig,
    seq_len: int,
    mfu: float,
    dev: Device,
    schedule: str,
    stages: int,
    m: int,
    opt_share: float = 1.0,
    mb: int = 1,
    update: Update = ELEMENTWISE,
    state: Arm | None = None,
) -> PipeTiming:
    """The simulated steady step of one replica (cached; `dev.gpus_per_node` is the stages
    per node), of the two stage splits the faster (`simulate.model_costs`), each rank updating
    `opt_share` of its stages' parameters elementwise (1/D under FSDP) as `update` says (its
    arm's optimizer, and Muon's Newton-Schulz where it sits in the step), holding the state of
    `state` (default `update`'s arm; EF's buffer included), `m` microbatches of `mb` sequences
    a step (`mfu` is the one for that microbatch's shape). Raises ConfigError when the
    schedule refuses these sizes."""
    half = max(MAX_SIM_MICROBATCHES // 2, 2 * stages)  # past the V schedules' m >= 2P
    if m > 2 * half:
        args = (cfg, seq_len, mfu, dev, schedule, stages)
        a = pipeline_timing(*args, half, opt_share, mb, update, state)
        b = pipeline_timing(*args, 2 * half, opt_share, mb, update, state)
        return PipeTiming.blend(a, b, (m - half) / half)
    kept = update.arm if state is None else state
    p = plan(schedule, stages, m, SIM_STEPS)
    links = dict(
        intra_node_bandwidth=dev.intra_node_bandwidth,
        inter_node_bandwidth=dev.inter_node_bandwidth,
        ranks_per_node=dev.gpus_per_node,
        p2p_latency=dev.p2p_latency,
    )
    compute = (cfg, seq_len, mfu, dev.peak_flops, dev.hbm_bandwidth, mb)
    options = []
    for split, (c, mats, params) in enumerate(_splits(p, *compute, kept.ns_steps)):
        opt = tuple(update.time(n, x, dev.hbm_bandwidth, opt_share) for n, x in zip(params, mats))
        c = dataclasses.replace(c, optimizer=opt, **links)  # the timing: arm-free state
        options.append((split, opt, _steady(p, c)))
    split, opt, t = min(options, key=lambda sot: sot[2].step_time)
    r = _ranks(p, *compute, kept, split)
    return PipeTiming(
        t.step_time,
        1 - sum(t.busy) / (len(t.busy) * t.step_time),
        r.memory,
        r.state,
        r.params,
        tuple(sum(opt[s] for s in stages) for stages in r.stages),
        t.gap,
        r.forward,
        r.backward,
        r.weights,
        r.stashed,
        r.chunks,
        r.last,
        r.matrices,
    )


@functools.lru_cache(maxsize=65536)
def busy_bound(
    cfg: ModelConfig, seq_len: int, mfu: float, dev: Device, schedule: str, stages: int, m: int,
    mb: int = 1,
) -> float:  # fmt: skip
    """A lower bound on `pipeline_timing`'s step time for these arguments (any update, share
    and state), without simulating it: of the stage splits the least, of the ranks the most
    a rank computes in a step, its m forwards and backwards of each stage it holds, at the
    cost model's durations. Every rank runs each of its actions once a step, one at a time,
    so a steady step is at least its busiest rank's work; what the bound leaves out, the
    update, the transfers and the idle time (bubble), is non-negative. 0.0 (no bound) where
    the step is extrapolated rather than simulated (past `MAX_SIM_MICROBATCHES` and 4P: the
    extrapolation need not stay above the work), for a schedule that updates after every
    microbatch (PipeDream: its steady step is one update's, not m microbatches') and where the
    schedule refuses the sizes (cached: every sharing, placement and link of a pipeline asks)."""
    each = parse_policy(PIPELINE_SCHEDULES[schedule].policy).per_microbatch
    if each or m > 2 * max(MAX_SIM_MICROBATCHES // 2, 2 * stages):
        return 0.0
    compute = (cfg, seq_len, mfu, dev.peak_flops, dev.hbm_bandwidth, mb)
    try:  # refused: the schedule's sizes, or more stages than the model has layers (V: 2P)
        p = plan(schedule, stages, m, SIM_STEPS)
        splits = _splits(p, *compute, ADAMW.ns_steps)
    except ConfigError:
        return 0.0
    return min(
        m * max(sum(c.forward[s] + c.backward_input[s] + c.backward_weight[s] for s in held)
                for held in p.held)
        for c, _, _ in splits
    )  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _splits(
    p: Plan, cfg: ModelConfig, seq_len: int, mfu: float, flops: float, hbm: float, mb: int,
    steps: int,
) -> tuple[tuple[CostModel, tuple[Matrices, ...], tuple[float, ...]], ...]:  # fmt: skip
    """Per stage split of `_costs`: its cost model, what each stage's Newton-Schulz works on
    and each stage's parameters (cached: every arm, link and update share them)."""
    costs = _costs(p, cfg, seq_len, mfu, flops, hbm, mb)
    mats = _stage_matrices(p, cfg, seq_len, steps)
    return tuple(
        (c, x, tuple(w / PARAM_BYTES for w in c.weight_bytes)) for c, x in zip(costs, mats)
    )


@dataclass(frozen=True)
class _Ranks:
    """What `pipeline_timing` gives per rank that its update and links do not change."""

    stages: tuple[tuple[int, ...], ...]  # per rank the stages it holds
    memory: tuple[float, ...]
    state: tuple[float, ...]
    params: tuple[float, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weights: tuple[float, ...]
    stashed: tuple[float, ...]
    chunks: tuple[int, ...]
    last: int
    matrices: tuple[Matrices, ...]


@functools.lru_cache(maxsize=16384)
def _ranks(
    p: Plan, cfg: ModelConfig, seq_len: int, mfu: float, flops: float, hbm: float, mb: int,
    kept: Arm, split: int,
) -> _Ranks:  # fmt: skip
    """`pipeline_timing`'s per rank sizes of stage split `split` (of `_splits`) holding `kept`'s
    state (cached: the arms sharing a state and every link share them)."""
    costs, mats, _ = _splits(p, cfg, seq_len, mfu, flops, hbm, mb, kept.ns_steps)[split]
    held_state = tuple(kept.state_bytes(w / PARAM_BYTES, x.params)
                       for w, x in zip(costs.weight_bytes, mats))  # fmt: skip
    ranks = p.held

    def per_rank(*xs: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(sum(x[s] for x in xs for s in stages) for stages in ranks)

    memory = _memory(p, costs.weight_bytes, held_state, costs.activation_bytes)
    last = next(r for r, stages in enumerate(ranks) if p.sched.num_stages - 1 in stages)
    return _Ranks(
        ranks,
        tuple(m.total for m in memory),
        per_rank(held_state),
        tuple(x / PARAM_BYTES for x in per_rank(costs.weight_bytes)),
        per_rank(costs.forward),
        per_rank(costs.backward_input, costs.backward_weight),
        tuple(m.weights for m in memory),
        tuple(float(m.stashed) for m in memory),
        tuple(len(stages) for stages in ranks),
        last,
        tuple(sum((mats[s] for s in stages), Matrices()) for stages in ranks),
    )


@functools.lru_cache(maxsize=16384)
def _steady(p: Plan, c: CostModel) -> Steady:
    """`p`'s steady step under `c` (cached: arms whose update takes the same time share it)."""
    return p.time(c)


@functools.lru_cache(maxsize=4096)
def _stage_matrices(
    p: Plan, cfg: ModelConfig, seq_len: int, steps: int
) -> tuple[tuple[Matrices, ...], ...]:
    """Per stage split of `_costs` (in its order: `simulate.model_costs`' candidates), what each
    stage's Newton-Schulz works on (`sim.optimizer`)."""
    sched = p.sched
    ranks = tuple(sched.rank_of(s) for s in range(sched.num_stages))
    splits = [None, ranks] if sched.num_chunks > 1 else [None]
    out = []
    for split in splits:
        layers = _split(cfg, sched.num_stages, seq_len, "balanced", split)[0]
        out.append(tuple(layers_matrices(cfg, tuple(r), steps) for r in layers))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _costs(
    p: Plan, cfg: ModelConfig, seq_len: int, mfu: float, flops: float, hbm: float, mb: int = 1
) -> list[CostModel]:
    """The analytic cost models of `p`'s schedule (both stage splits) on a GPU of `flops` and
    `hbm` bandwidth, microbatches of `mb` sequences; the links are set by the caller (so the
    cache ignores them)."""
    dev = Device(
        name="",
        peak_flops=flops,
        hbm_bandwidth=hbm,
        intra_node_bandwidth=1.0,
        inter_node_bandwidth=1.0,
    )
    return model_costs(p.sched, cfg, dev, {}, mfu=mfu, seq_len=seq_len, mb_size=mb)


@functools.lru_cache(maxsize=4096)
def _memory(p: Plan, weight: tuple, state: tuple, activation: tuple) -> tuple[RankMemory, ...]:
    """Per rank peaks (`sim.memory`: the schedule's order alone, no timing)."""
    return rank_memory(p.sched, weight, state, activation)
