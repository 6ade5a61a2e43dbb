"""Every way to train one model on N GPUs of a cluster, timed and sized (docs/verdict.md, 'The
cluster model'): data parallelism (DP), FSDP / ZeRO-3, each pipeline schedule of the simulator
over P and m, and hybrids (P stages x D replicas = N GPUs, the replicas sharing gradients by
DP or FSDP), synchronous and asynchronous.

Assumptions, each stated once (the three with a range, MFU, link efficiency and overlap cost,
are `sim.cluster`'s `*_RANGE`; BI = BW = F):

- compute: a forward is the roofline of its FLOPs at peak x MFU and of reading its bf16 weights
  from HBM (`compute_time`); one MFU for every configuration above that.
- collectives: NCCL's ring or tree, over the group's rails across nodes (`sim.cluster`).
- overlap: communication hidden behind compute still slows it, by `overlap_cost` of the
  communication's time (NCCL's kernels take SMs and HBM bandwidth from the compute).
- memory: mixed-precision AdamW, `PARAM_BYTES` (bf16 weights) per weight version plus
  `STATE_BYTES` (fp32 gradient accumulator, fp32 master weights, two fp32 moments) per
  parameter, plus the activations of the microbatches in flight (`timing.ACT_BYTES_PER_TOKEN_DIM`,
  no recomputation); nothing else (no logits, buffers, fragmentation). A configuration over the
  GPU's memory is kept, marked `fits=False`, and named by the verdict, never chosen.
- DP: an all-reduce of the fp32 gradients (`GRAD_BYTES`) once per step, bucket by bucket behind
  the backward of the step's last microbatch (DDP's buckets; `trailing`).
- FSDP (ZeRO-3, weights, gradients and optimizer state sharded over all N): per unit (a block;
  the embedding folded into the first, norm and head into the last) an all-gather of its bf16
  weights in forward and again in backward, a reduce-scatter of its fp32 gradients in backward,
  for every microbatch; unit l+1's gather behind unit l's forward (FSDP2's prefetch), each
  backward's gather and reduce-scatter behind that unit's backward; exposed: the first gather
  and what each unit's traffic leaves over its compute. Memory: the sharded weights and state,
  two gathered units (the one computing and the one prefetched) and one microbatch's
  activations.
- Pipelines: the timing simulator's steady step (`sim.simulate`, both stage splits, the faster
  kept), cached per (schedule, P, m, placement, link): it does not depend on the replicas'
  link. Microbatches of one sequence; m = global batch / D; m < P is not considered. Past
  `MAX_SIM_MICROBATCHES` (and 4P) the step time and memory are extrapolated linearly from
  m = max(8, 2P) and twice that (exact once the steady state is affine in m).
- Hybrids: the replicas of each stage share gradients once a step ("dp": all-reduce; "fsdp":
  reduce-scatter of gradients, optimizer on a 1/D shard, all-gather of the bf16 weights, as
  torchtitan runs FSDP with PP: weights gathered once per step), layer by layer as FSDP does it,
  for synchronous and asynchronous schedules alike. Synchronous: each rank sends its layers'
  gradients behind its last backward of the step (`trailing`), updates its shard, and gathers
  its layers' weights behind its first forward of the next (`leading`), using the idle window
  the schedule leaves it between the two (its `gap`: the drain and the next fill); the latest
  rank delays the step by what it overruns. Asynchronous (no flush): a whole step to hide it
  in, exposed only when longer than a step; its update, on a 1/D shard under FSDP, is simulated
  inside its stream.
- PipeDream (Narayanan et al. 2019) as published: an update after every microbatch, stage s
  keeping P - s weight versions; a global batch is m updates, each paying the optimizer and
  the replicas' gradient exchange (hidden behind the next update only).
- Placement across nodes (N > GPUs per node): "stages in a node" (pipeline p2p on the fast
  link, each stage's replicas across nodes, as many rails as the node holds of them) or
  "replicas in a node" (gradient traffic on the fast link, p2p across nodes); both are tried.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from stalepipe.config import ConfigError, ModelConfig
from stalepipe.delay.policies import PAPER_ASYNC, never_delays, parse_policy
from stalepipe.models.transformer import block_flops, block_params, head_flops
from stalepipe.sim.cluster import Cluster, collective_time, compute_time, leading, trailing
from stalepipe.sim.devices import Device
from stalepipe.sim.memory import rank_memory
from stalepipe.sim.simulate import model_costs
from stalepipe.sim.steady import Plan, plan
from stalepipe.sim.timing import ACT_BYTES_PER_TOKEN_DIM, CostModel

PARAM_BYTES = 2.0  # bf16 weights: one version, and what FSDP gathers
STATE_BYTES = 16.0  # fp32 grad accumulator 4 + fp32 master 4 + AdamW moments 8 (timing.py)
GRAD_BYTES = 4.0  # gradients are reduced in fp32 (torchtitan's default reduce dtype)
OPT_TRAFFIC = 28.0  # HBM bytes an AdamW update moves per parameter (timing.analytic_costs)
MAX_SIM_MICROBATCHES = 16
MAX_STAGES = 8  # deeper pipelines of these models leave a block or two per stage
SIM_STEPS = 3


def cluster_schedules(sync: bool) -> tuple[str, ...]:
    """The registered pipeline schedules the cluster model compares (`ScheduleSpec.cluster`),
    the synchronous ones or the others, in the registry's order: a schedule registered later
    is compared with no change here."""
    from stalepipe.config.registry import PIPELINE_SCHEDULES

    return tuple(
        name
        for name, spec in PIPELINE_SCHEDULES.items()
        if spec.cluster and never_delays(spec.policy) == sync
    )


@dataclass(frozen=True)
class Workload:
    """What is trained: a model shape, its sequence length, the global batch (sequences per
    optimizer step) and the number of GPUs, at a model FLOPs utilisation `mfu` (the compute
    roof; `compute_time` adds the memory roof), with communication that slows the compute it
    hides behind by `overlap_cost` of its own time (`sim.cluster.OVERLAP_COST_RANGE`)."""

    cfg: ModelConfig
    seq_len: int
    global_batch: int
    num_gpus: int
    mfu: float = 0.4
    overlap_cost: float = 0.05


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

    @property
    def fits(self) -> bool:
        return self.peak_memory <= self.memory_limit

    @property
    def kind(self) -> str:
        """'dp', 'fsdp', 'pp' (one replica) or 'hybrid' (a pipeline of replicas)."""
        if self.stages == 1:
            return self.schedule
        return "pp" if self.replicas == 1 else "hybrid"

    def label(self) -> str:
        """E.g. 'fsdp x16 (microbatch 4)' or '1f1b P=4 x fsdp 4 (stages in a node), m=32'."""
        if self.stages == 1:
            return f"{self.schedule} x{self.replicas} (microbatch {self.microbatch_size})"
        rep = f" x {self.across} {self.replicas}" if self.replicas > 1 else ""
        where = f" ({self.placement})" if self.placement else ""
        each = " (an update each)" if parse_policy(self.policy).per_microbatch else ""
        return f"{self.schedule} P={self.stages}{rep}{where}, m={self.microbatches}{each}"


def _units(cfg: ModelConfig, seq_len: int) -> list[tuple[int, int]]:
    """(parameters, forward FLOPs per token) of each FSDP unit: the blocks, the embedding
    folded into the first, the final norm and untied head into the last."""
    out = [(block_params(cfg, i), block_flops(cfg, seq_len, i)) for i in range(cfg.num_layers)]
    emb = cfg.vocab_size * cfg.dim
    out[0] = (out[0][0] + emb, out[0][1])
    head = cfg.dim + (0 if cfg.tie_embeddings else emb)
    out[-1] = (out[-1][0] + head, out[-1][1] + head_flops(cfg))
    return out


def _activations(cfg: ModelConfig, tokens: int) -> float:
    return cfg.num_layers * tokens * cfg.dim * ACT_BYTES_PER_TOKEN_DIM


def _sizes(w: Workload) -> list[int]:
    """Microbatch sizes (sequences) that divide one GPU's share of the batch, largest first."""
    local = w.global_batch // w.num_gpus
    return [b for b in (2**i for i in range(local.bit_length(), -1, -1)) if local % b == 0]


def data_parallel(w: Workload, c: Cluster, *, sharded: bool) -> Option | None:
    """DP (`sharded` False) or FSDP over all N GPUs, at the largest microbatch that fits (the
    smallest when none does); None when the batch does not split over N."""
    if w.global_batch % w.num_gpus:
        return None
    units, n = _units(w.cfg, w.seq_len), w.num_gpus
    params = sum(p for p, _ in units)
    speed, hbm = c.peak_tflops * 1e12 * w.mfu, c.hbm_tbps * 1e12
    option = None
    for b in _sizes(w):
        tokens, k = b * w.seq_len, w.global_batch // n // b
        fwd = [compute_time(tokens * f, PARAM_BYTES * p, speed, hbm) for p, f in units]
        if sharded:
            gather = [collective_time(c, "all-gather", PARAM_BYTES * p, n) for p, _ in units]
            scatter = [collective_time(c, "reduce-scatter", GRAD_BYTES * p, n) for p, _ in units]
            exposed = gather[0] + sum(max(0.0, g - f) for g, f in zip(gather[1:], fwd))
            exposed += sum(max(0.0, g + s - 2 * f) for g, s, f in zip(gather, scatter, fwd))
            comm = 2 * sum(gather) + sum(scatter)
            state = (PARAM_BYTES + STATE_BYTES) * params / n
            memory, times = state + 2 * PARAM_BYTES * max(p for p, _ in units), k
        else:  # one all-reduce a step, bucket by bucket behind the last backward
            comm = collective_time(c, "all-reduce", GRAD_BYTES * params, n)
            exposed = trailing(comm, 2 * sum(fwd), len(units)) - 2 * sum(fwd)
            memory, times = (PARAM_BYTES + STATE_BYTES) * params, 1
        exposed = times * (exposed + w.overlap_cost * (comm - exposed))
        memory += _activations(w.cfg, tokens)
        opt = OPT_TRAFFIC * params / (n if sharded else 1) / (c.hbm_tbps * 1e12)
        step = k * 3 * sum(fwd) + exposed + opt
        option = Option(
            *("fsdp" if sharded else "dp", "sync", 1, n, "fsdp" if sharded else "dp", k, b, ""),
            step,
            exposed,
            0.0,
            memory,
            c.memory_gb * 1e9,
            w.global_batch * w.seq_len / step,
        )
        if option.fits:
            return option
    return option


@dataclass(frozen=True)
class PipeTiming:
    """One pipeline replica's steady step, as the replicas' gradient traffic needs it."""

    step_time: float
    bubble: float
    memory: tuple[float, ...]  # per rank peak, bytes
    state: tuple[float, ...]  # per rank optimizer state + gradient accumulator, bytes
    params: tuple[float, ...]  # per rank parameters
    optimizer: tuple[float, ...]  # per rank update time
    gap: tuple[float, ...]  # per rank: next step's first forward - this step's last backward
    forward: tuple[float, ...]  # per rank: one microbatch's forward, s
    backward: tuple[float, ...]  # per rank: one microbatch's backward (BI + BW), s

    @staticmethod
    def blend(a: PipeTiming, b: PipeTiming, t: float) -> PipeTiming:
        """a + t (b - a) for the step time and memory (linear extrapolation in m)."""
        mem = tuple(x + t * (y - x) for x, y in zip(a.memory, b.memory))
        step = a.step_time + t * (b.step_time - a.step_time)
        return dataclasses.replace(b, step_time=step, memory=mem)


@functools.lru_cache(maxsize=4096)
def pipeline_timing(
    cfg: ModelConfig,
    seq_len: int,
    mfu: float,
    dev: Device,
    schedule: str,
    stages: int,
    m: int,
    opt_share: float = 1.0,
) -> PipeTiming:
    """The simulated steady step of one replica (cached; `dev.gpus_per_node` is the stages
    per node), of the two stage splits the faster (`simulate.model_costs`), each rank updating
    `opt_share` of its stages' parameters (1/D under FSDP). Raises ConfigError when the
    schedule refuses these sizes."""
    half = max(MAX_SIM_MICROBATCHES // 2, 2 * stages)  # past the V schedules' m >= 2P
    if m > 2 * half:
        a = pipeline_timing(cfg, seq_len, mfu, dev, schedule, stages, half, opt_share)
        b = pipeline_timing(cfg, seq_len, mfu, dev, schedule, stages, 2 * half, opt_share)
        return PipeTiming.blend(a, b, (m - half) / half)
    p = plan(schedule, stages, m, SIM_STEPS)
    links = dict(
        intra_node_bandwidth=dev.intra_node_bandwidth,
        inter_node_bandwidth=dev.inter_node_bandwidth,
        ranks_per_node=dev.gpus_per_node,
        p2p_latency=dev.p2p_latency,
    )
    compute = (cfg, seq_len, mfu, dev.peak_flops, dev.hbm_bandwidth)
    options = [
        dataclasses.replace(c, optimizer=tuple(o * opt_share for o in c.optimizer), **links)
        for c in _costs(p, *compute)
    ]
    costs, t = min(((c, p.time(c)) for c in options), key=lambda ct: ct[1].step_time)
    sizes = (costs.weight_bytes, costs.state_bytes, costs.activation_bytes)
    ranks = [p.sched.stages_of(r) for r in range(p.sched.num_ranks)]

    def per_rank(*xs: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(sum(x[s] for x in xs for s in stages) for stages in ranks)

    state = per_rank(costs.state_bytes)
    return PipeTiming(
        t.step_time,
        1 - sum(t.busy) / (len(t.busy) * t.step_time),
        _memory(p, *sizes),
        state,
        tuple(x / STATE_BYTES for x in state),
        per_rank(costs.optimizer),
        t.gap,
        per_rank(costs.forward),
        per_rank(costs.backward_input, costs.backward_weight),
    )


@functools.lru_cache(maxsize=4096)
def _costs(
    p: Plan, cfg: ModelConfig, seq_len: int, mfu: float, flops: float, hbm: float
) -> list[CostModel]:
    """The analytic cost models of `p`'s schedule (both stage splits) on a GPU of `flops` and
    `hbm` bandwidth; the links are set by the caller (so the cache ignores them)."""
    dev = Device(
        name="",
        peak_flops=flops,
        hbm_bandwidth=hbm,
        intra_node_bandwidth=1.0,
        inter_node_bandwidth=1.0,
    )
    return model_costs(p.sched, cfg, dev, {}, mfu=mfu, seq_len=seq_len, mb_size=1)


@functools.lru_cache(maxsize=4096)
def _memory(p: Plan, weight: tuple, state: tuple, activation: tuple) -> tuple[float, ...]:
    """Per rank peak memory (`sim.memory`: the schedule's order alone, no timing)."""
    return tuple(m.total for m in rank_memory(p.sched, weight, state, activation))


def _placements(c: Cluster, n: int, stages: int, replicas: int) -> list[tuple[str, int, int]]:
    """(name, stages per node, a stage's replicas in each node) of each placement: the
    replicas of a stage cross nodes on that many rails (`sim.cluster.collective_time`)."""
    g = int(c.gpus_per_node)
    if n <= g:
        return [("", stages, replicas)]
    out = [("stages in a node", g, min(replicas, g // min(stages, g)))]
    if replicas > 1:
        out.append(("replicas in a node", max(1, g // replicas), min(replicas, g)))
    return out


def _pipeline_device(c: Cluster, stages_per_node: int, stages: int) -> Device:
    """The simulator's device for a pipeline with `stages_per_node`; when the whole pipeline
    sits in a node the inter-node link plays no part and is left out (so the cache hits)."""
    dev = dataclasses.replace(c.device(), name="", gpus_per_node=stages_per_node)
    if stages <= stages_per_node:
        bw, lat = c.link(False)
        return dataclasses.replace(dev, inter_node_bandwidth=bw, p2p_latency=lat)
    return dev


def _hybrid(
    w: Workload,
    c: Cluster,
    t: PipeTiming,
    replicas: int,
    across: str,
    per_node: int,
    sync: bool,
    sharded: PipeTiming | None = None,
) -> tuple[float, float, float]:
    """(step time, exposed traffic, peak memory) of a pipeline replica with `replicas`
    sharing gradients `across` ('dp' or 'fsdp'), `per_node` of each stage's replicas in a
    node (module docstring). `sharded`: the same pipeline timed with each rank updating its
    1/D shard (FSDP, asynchronous: the update sits inside the stream, so it is simulated there
    rather than subtracted)."""
    memory = max(t.memory)
    if replicas == 1:
        return t.step_time, 0.0, memory
    units = max(1, round(w.cfg.num_layers / len(t.params)))  # blocks per rank

    def coll(kind: str, nbytes: float) -> float:
        return collective_time(c, kind, nbytes, replicas, per_node)

    if across == "dp":
        grads = [coll("all-reduce", GRAD_BYTES * p) for p in t.params]
        gather = [0.0] * len(t.params)
        opt = list(t.optimizer)
    else:
        grads = [coll("reduce-scatter", GRAD_BYTES * p) for p in t.params]
        gather = [coll("all-gather", PARAM_BYTES * p) for p in t.params]
        opt = [o / replicas for o in t.optimizer]
        memory = max(m - s * (1 - 1 / replicas) for m, s in zip(t.memory, t.state))
    cost = w.overlap_cost
    if sync:  # each rank: gradients behind its last backward, weights behind its next forward
        late = []
        for r, (x, g, o) in enumerate(zip(grads, gather, opt)):
            tail = trailing(x, t.backward[r], units) - t.backward[r]
            ag = leading(g, t.forward[r], units)
            ready = max(t.gap[r], tail + o + g / units) + ag - g / units if g else tail + o
            late.append(ready - t.gap[r] + cost * (x + g))
        step = t.step_time + max(0.0, *late)
    else:  # no flush: a whole step to hide it in
        hidden = max(x + g for x, g in zip(grads, gather))
        longest = max(x + g + o for x, g, o in zip(grads, gather, opt))
        step = max((sharded or t).step_time + cost * hidden, longest)
    return step, max(0.0, step - t.step_time), memory


def pipelines(w: Workload, c: Cluster, schedules: tuple[str, ...]) -> list[Option]:
    """Every pipeline configuration of `schedules`: P (powers of two, P <= N and the model's
    layers), D = N / P replicas sharing by DP or FSDP, each placement; m = global batch / D."""
    from stalepipe.config.registry import PIPELINE_SCHEDULES

    out = []
    limit = c.memory_gb * 1e9
    for stages in (2**i for i in range(1, w.num_gpus.bit_length())):
        if w.num_gpus % stages or stages > min(w.cfg.num_layers, MAX_STAGES):
            continue
        replicas = w.num_gpus // stages
        m = w.global_batch // replicas
        if w.global_batch % replicas or m < stages:
            continue
        for spn_name, spn, per_node in _placements(c, w.num_gpus, stages, replicas):
            dev = _pipeline_device(c, spn, stages)
            for name in schedules:
                policy = PIPELINE_SCHEDULES[name].policy
                # PipeDream updates after every microbatch: its steady update is the same at
                # any m >= P, so one m is simulated and a global batch takes m updates
                updates = m if parse_policy(policy).per_microbatch else 1
                m_sim = min(m, 2 * stages) if updates > 1 else m
                try:
                    t = pipeline_timing(w.cfg, w.seq_len, w.mfu, dev, name, stages, m_sim)
                except ConfigError:
                    continue  # too many stages for the layers, or m too small for it
                sync = never_delays(policy)
                for across in ("dp", "fsdp") if replicas > 1 else ("dp",):
                    sharded = None
                    if across == "fsdp" and not sync:
                        sharded = pipeline_timing(
                            w.cfg, w.seq_len, w.mfu, dev, name, stages, m_sim, 1 / replicas
                        )
                    step, exposed, mem = _hybrid(w, c, t, replicas, across, per_node, sync, sharded)
                    step, exposed = step * updates, exposed * updates
                    tps = w.global_batch * w.seq_len / step
                    out.append(
                        Option(
                            name,
                            policy,
                            stages,
                            replicas,
                            across,
                            m,
                            1,
                            spn_name,
                            step,
                            exposed,
                            t.bubble,
                            mem,
                            limit,
                            tps,
                        )
                    )
    return out


def all_options(
    w: Workload, c: Cluster, async_schedules: tuple[str, ...] = (PAPER_ASYNC,)
) -> list[Option]:
    """DP, FSDP and every pipeline configuration (synchronous, and `async_schedules`)."""
    if w.num_gpus < 1 or w.global_batch < 1:
        raise ConfigError("the GPU count and the global batch must be >= 1")
    flat = [data_parallel(w, c, sharded=s) for s in (False, True)]
    synchronous = cluster_schedules(sync=True)
    return [o for o in flat if o is not None] + pipelines(w, c, synchronous + async_schedules)


def best(options: list[Option], policy: str = "sync", kind: str | None = None) -> Option | None:
    """The fastest option of `policy` (and `kind`) that fits in memory; None when none does."""
    ok = [o for o in options if o.policy == policy and o.fits and kind in (None, o.kind)]
    return max(ok, key=lambda o: o.tokens_per_s, default=None)
