"""Every way to train one model on N GPUs of a cluster, timed and sized (docs/verdict.md, 'The
cluster model'): data parallelism (DP), FSDP / ZeRO-3, each pipeline schedule of the simulator
over P and m, and hybrids (P stages x D replicas = N GPUs, the replicas sharing gradients by
DP or FSDP), synchronous and asynchronous.

Assumptions, each stated once (the three with a range, MFU, link efficiency and overlap cost,
are `sim.cluster`'s `*_RANGE`; BI = BW = F):

- compute: a forward is the roofline of its FLOPs at peak x MFU and of reading its bf16 weights
  from HBM (`compute_time`); the MFU by the microbatch's shape (`sim.efficiency`: a block's
  FLOPs per microbatch and GPU), or one given MFU for every configuration (`--mfu`).
- collectives: NCCL's ring or tree, over the group's rails across nodes (`sim.cluster`).
- overlap: communication hidden behind compute still slows it, by `overlap_cost` of the
  communication's time (NCCL's kernels take SMs and HBM bandwidth from the compute).
- memory: mixed precision, `PARAM_BYTES` (bf16 weights) per weight version plus the fp32
  gradient accumulator, fp32 master weights and the workload's arm's optimizer state (AdamW's
  two moments; Muon's momentum on its matrices; error feedback's buffer on an EF arm's
  asynchronous schedules: `sim.optimizer`) per parameter, plus the activations of the
  microbatches in flight, the logits and FSDP's buffers (`sim.memory`). A configuration over
  the GPU's memory is kept, marked `fits=False`, and named by the verdict, never chosen.
- the update: the arm's optimizer (`sim.optimizer`): AdamW's 28 HBM bytes a parameter; Muon's
  elementwise part and its Newton-Schulz FLOPs, replicated or sharded over the data-parallel
  replicas (both tried, with their traffic); on a synchronous step's critical path, inside an
  asynchronous schedule's stream.
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
  link. The microbatch size b is searched (`hybrid.microbatch_sizes`: powers of two up to
  the sequences per GPU, as for DP and FSDP), the same sizes for synchronous and asynchronous
  schedules: m = global batch / D / b, m < P not considered (a schedule needing more, the V schedules' 2P, refuses the rest); larger b
  buys compute efficiency (`sim.efficiency`: bigger matmuls) and costs bubble (fewer
  microbatches) and memory (each stash b times larger); each b is checked against memory, and
  the fastest that fits is kept. Past `MAX_SIM_MICROBATCHES` (and 4P) the step time and memory
  are extrapolated linearly from m = max(8, 2P) and twice that (exact once the steady state is
  affine in m).
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
import sys

from stalepipe.config import ConfigError
from stalepipe.config.registry import PIPELINE_SCHEDULES
from stalepipe.lab.sim.cluster import Cluster
from stalepipe.lab.sim.hybrid import (
    MAX_STAGES,
    _layer_comm,
    _pipeline_device,
    _placed,
    _placements,
    group_per_node,
    pipelines,
    tp_cluster,
)
from stalepipe.lab.sim.replicas import KINDS, flat_options, flat_step, flat_update
from stalepipe.lab.sim.workload import (
    GRAD_BYTES,
    PARAM_BYTES,
    STATE_BYTES,
    Option,
    PipeTiming,
    Workload,
    _costs,
    _memory,
    _units,
    cluster_schedules,
    pipeline_timing,
)
from stalepipe.training.delay.policies import PAPER_ASYNC, never_delays

__all__ = [
    "GRAD_BYTES", "MAX_STAGES", "_pipeline_device", "PARAM_BYTES", "STATE_BYTES", "Option", "PipeTiming",
    "Workload", "_costs", "_memory", "_units", "all_options", "best", "cluster_schedules",
    "cache_clear", "data_parallel", "layout", "pipeline_timing", "pipelines",
]  # fmt: skip


def data_parallel(w: Workload, c: Cluster, *, sharded: bool) -> Option | None:
    """DP (`sharded` False) or FSDP over all N GPUs without TP (`sim.replicas`), at the fastest
    fitting microbatch and recomputation (the nearest to fitting when none does); None when
    the batch does not split over N."""
    opts = flat_options(w, c, ("fsdp" if sharded else "dp",))
    return next((o for o in opts if o.tp == 1), None)


def layout(
    w: Workload, c: Cluster, *, tp: int, stages: int, schedule: str, microbatch: int = 1,
    recompute: str = "none", across: str = "dp", cp: int = 1, ep: int = 1,
) -> Option:  # fmt: skip
    """One fixed configuration, timed as the search times it (a published run's layout, for
    benchmarks/validation): `schedule` 'dp' / 'zero1' / 'zero2' / 'fsdp' / 'hsdp' at
    `stages` 1, or a pipeline schedule of `stages` (replicas sharing gradients `across`,
    'stages in a node' placement); TP `tp`, CP `cp`, EP `ep` (over a stage's replicas, MoE),
    microbatches of `microbatch` sequences and recomputation `recompute` as given, not
    searched. Raises ConfigError where the sizes do not split."""
    n, limit = w.num_gpus // tp, c.memory_gb * 1e9
    if w.num_gpus % (tp * stages * cp) or w.global_batch % (n // stages // cp):
        raise ConfigError(
            f"{w.num_gpus} GPUs, batch {w.global_batch}: no TP {tp} x CP {cp} x PP {stages}"
        )
    if stages == 1:
        k = w.global_batch // (n // cp) // microbatch
        step, exposed, mem = flat_step(w, c, schedule, tp, microbatch, recompute, ep, cp)
        rate = w.global_batch * w.seq_len / step
        across = "fsdp" if KINDS[schedule] == 3 else "dp"
        update, ns = flat_update(w, c, schedule, tp)
        return Option(schedule, "sync", 1, n // cp, across, k, microbatch, "", step, exposed, 0.0,
                      mem, limit, rate, tp, recompute, ep, cp, ns, update)  # fmt: skip
    v, vc, vw = tp_cluster(c, tp), tp_cluster(c, tp, cp), dataclasses.replace(w, num_gpus=n)
    replicas = n // stages // cp
    local = w.global_batch // replicas
    if local % microbatch:
        raise ConfigError(
            f"{local} sequences a replica do not split into microbatches of {microbatch}"
        )
    m = local // microbatch
    name, spn, per_node = _placements(vc, n // cp, stages, replicas)[0]
    dev = _pipeline_device(vc, spn, stages)
    comm = _layer_comm(vw, c, schedule, stages, m, microbatch, tp, cp, ep, min(ep, per_node))
    sync = never_delays(PIPELINE_SCHEDULES[schedule].policy)
    group = replicas * cp
    sharing = (group, across, group_per_node(c, tp, cp, per_node, group))
    sizes = (stages, m, tp, recompute, microbatch)
    r = _placed(vw, c, v, dev, schedule, sizes, sharing, sync, cp, comm, ep)
    if r is None:
        raise ConfigError(f"{schedule} refuses P={stages}, m={m} for {w.cfg.num_layers} layers")
    step, exposed, mem, update, ns, bubble = r
    exposed += m * w.cfg.num_layers / stages * comm
    return Option(schedule, PIPELINE_SCHEDULES[schedule].policy, stages, replicas, across, m, microbatch,
                  name, step, exposed, bubble, mem, limit, w.global_batch * w.seq_len / step,
                  tp, recompute, ep, cp, ns, update)  # fmt: skip


def all_options(
    w: Workload,
    c: Cluster,
    async_schedules: tuple[str, ...] = (PAPER_ASYNC,),
    *,
    best_only: bool = False,
) -> list[Option]:
    """DP, FSDP and every pipeline configuration (synchronous, and `async_schedules`).
    `best_only`: only `best`'s picks are wanted (the map, the assumptions' corners): a pipeline
    that cannot beat the fastest fitting configuration of its policy found before it is not
    timed nor listed (`hybrid.pipelines`' `floor`); `best` returns the same option."""
    if w.num_gpus < 1 or w.global_batch < 1:
        raise ConfigError("the GPU count and the global batch must be >= 1")
    flat, pipes, floor = _synchronous(dataclasses.replace(w, arm=w.arm.synchronous()), c, best_only)
    floor = dict(floor) if floor is not None else None  # the cached one stays as it was
    return [*flat, *pipes, *pipelines(w, c, async_schedules, floor)]


@functools.lru_cache(maxsize=1024)
def _synchronous(
    w: Workload, c: Cluster, best_only: bool
) -> tuple[tuple[Option, ...], tuple[Option, ...], dict[str, float] | None]:
    """`all_options`' synchronous part (the data-parallel family, the synchronous pipelines)
    and, with `best_only`, the floor they leave: cached, so arms that differ only in error
    feedback (which synchronous schedules never run) share it. The search over depth and TP
    runs for the synchronous pipelines and the asynchronous ones apart (`hybrid.pipelines`),
    so each side searches deeper where its own pipelines need it (2BW's second weight version
    and EF's buffer may not fit where a synchronous schedule does)."""
    flat = flat_options(w, c)
    floor = None
    if best_only:
        floor = {"sync": min((o.step_time for o in flat if o.fits), default=float("inf"))}
    pipes = pipelines(w, c, cluster_schedules(sync=True), floor)
    return tuple(flat), tuple(pipes), floor


def cache_clear() -> None:
    """Empty every cache of the cluster model (`functools.lru_cache`s of `sim`'s modules): a
    cold start, as a fresh process makes one (benchmarks/speed/verdict_map_speed.py)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("stalepipe.lab.sim."):
            for f in vars(module).values():
                if hasattr(f, "cache_clear") and getattr(f, "__module__", None) == name:
                    f.cache_clear()


def best(options: list[Option], policy: str = "sync", kind: str | None = None) -> Option | None:
    """The fastest option of `policy` (and `kind`) that fits in memory; None when none does."""
    ok = [o for o in options if o.policy == policy and o.fits and kind in (None, o.kind)]
    return max(ok, key=lambda o: o.tokens_per_s, default=None)
