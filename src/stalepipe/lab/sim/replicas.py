"""The data-parallel family of the cluster model (issue 52, item 1), each with Megatron's tensor
parallelism inside a node and a choice of activation recomputation (docs/verdict.md, 'The
cluster model'):

- **dp** (DDP): fp32 gradients all-reduced once a step, bucket by bucket behind the last
  backward; every state replicated.
- **zero1** (Megatron's distributed optimizer; ZeRO stage 1): the same gradient traffic as a
  reduce-scatter (fp32) then an all-gather of the bf16 weights, once a step; master weights and
  optimizer state sharded, the update on a 1/D shard.
- **zero2**: gradients sharded too, so reduce-scattered after every microbatch's backward.
- **fsdp** (ZeRO-3; FSDP2 as torchtitan runs it): per unit and microbatch an all-gather of the
  bf16 weights in forward and again in backward, a reduce-scatter of the fp32 gradients
  (`sim.parallel`'s docstring has the overlap).
- **hsdp**: FSDP inside a node (the shard group), replicas across nodes all-reducing each
  node's gradient shard once a step.

**Tensor parallelism** t (Narayanan et al. 2021, Section 2.3: the MLP's first weight split by
columns and its second by rows, attention split by heads; with Korthikanti et al. 2022's
sequence parallelism the two all-reduces of a layer's forward become two all-gathers and two
reduce-scatters of the layer's input, tokens x dim bf16, and the backward the same again), inside
a node only, t in (1, 2, 4, 8): a GPU computes 1/t of each matmul and holds 1/t of the weights
and activations (`sim.memory`); the TP traffic is on the critical path (not overlapped:
Megatron's default and torchtitan without AsyncTP, whose Table 4 gains 5.7 % with it).

**Recomputation** (`RECOMPUTE`): none, selective (torchtitan's op-level policy: every second
matmul of a block recomputed, `recompute_share`) or full (the whole forward again): the extra
forward FLOPs slow the backward, and the kept activations shrink (`sim.memory`).

**The update** (`flat_update`; `sim.optimizer` states the model): the workload's arm's
optimizer (these are synchronous: never error feedback), elementwise on the shard the GPU
updates (1/D from ZeRO-1 on; HSDP's shard group), and for Muon its Newton-Schulz placed
replicated or sharded over the data-parallel ranks (the state's shard group for HSDP), the
faster kept, with its traffic; after the gradients' exchange, on the critical path.

**Context parallelism** c (`CP_DEGREES`; issue 52, item 1), the Llama 3 paper's (Dubey et al.
2024, Section 3.3.2): each sequence's tokens split over c GPUs in 2c chunks, chunk i and
2c - 1 - i on one GPU so that causal attention's work is even; per layer and microbatch an
all-gather of K and V in forward (GQA: the key-value heads alone) and a reduce-scatter of their
gradients in backward, both on the critical path ("the all-gather communication latency is
exposed in the critical path" there; `cp_time`). A GPU computes and keeps 1/c of each
sequence's tokens (a token still attends over the whole sequence: the attention FLOPs per GPU
are 1/c), the batch splits over N / (t c) replicas, and the gradients are reduced, and ZeRO
shards, over the data- and context-parallel GPUs together (Megatron's and torchtitan's
`dp_shard_cp`), so their traffic is that of N / t GPUs as without CP. The CP group sits inside
a node where t x c fits one (torchtitan's and Llama 3's order: TP innermost, then CP). A degree
c > 1 is tried only where the smaller gave configurations of that kind and TP and a microbatch
of one sequence without recomputation did not fit at it (TP's rule, read on memory alone: CP
buys memory; a short sequence never needs it; CP is not searched to split a batch of fewer
sequences than GPUs), and
only where the weights' terms alone (state and gathered buffers, which CP does not divide) fit
(`cp_may_fit`).
"""

from __future__ import annotations

import functools
import math

from stalepipe.config import ModelConfig
from stalepipe.lab.sim.cluster import Cluster, collective_time, compute_time, trailing
from stalepipe.lab.sim.memory import RECOMPUTE, gpu_memory
from stalepipe.lab.sim.optimizer import (
    NS_BYTES,
    PLACEMENTS,
    model_matrices,
    ns_mfu,
    ns_time,
)
from stalepipe.lab.sim.workload import Option, _units

KINDS = {"dp": 0, "zero1": 1, "zero2": 2, "fsdp": 3, "hsdp": 3}
TP_DEGREES = (1, 2, 4, 8)
CP_DEGREES = (1, 2, 4, 8, 16)  # Llama 3's long-context stage ran CP 16 (its Table 4)
GRAD_BYTES, PARAM_BYTES = 4.0, 2.0  # as sim.parallel


def recompute_share(cfg: ModelConfig, mode: str) -> float:
    """Extra forward FLOPs per forward under recomputation `mode`: 0, 1 (full), or for
    torchtitan's selective op policy the matmuls it does not save (every second one of a
    block's seven: K, the output projection and the up projection) over the block's matmuls."""
    if mode == "none":
        return 0.0
    if mode == "full":
        return 1.0
    if mode != "selective":
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {mode!r}")
    h, kv = cfg.dim, cfg.num_kv_heads * cfg.head_dim
    q = h * cfg.num_heads * cfg.head_dim
    ffn = cfg.ffn_dim
    matmuls = 2 * q + 2 * h * kv + 3 * h * ffn
    return (h * kv + q + h * ffn) / matmuls


def tp_time(c: Cluster, cfg: ModelConfig, tokens: float, t: int) -> float:
    """Seconds of one layer's forward TP traffic over `t` GPUs of a node, sequence parallel:
    two all-gathers and two reduce-scatters of the layer's bf16 input (tokens x dim); the
    backward moves the same again."""
    if t <= 1:
        return 0.0
    size = 2.0 * tokens * cfg.dim
    return 2 * (
        collective_time(c, "all-gather", size, t, t)
        + collective_time(c, "reduce-scatter", size, t, t)
    )


def tp_choices(c: Cluster, num_gpus: int) -> list[int]:
    """TP degrees that fit in a node and divide the GPU count."""
    g = int(c.gpus_per_node)
    return [t for t in TP_DEGREES if t <= g and num_gpus % t == 0]


def cp_time(
    c: Cluster, cfg: ModelConfig, tokens: float, cp: int, tp: int = 1, per_node: int = 0
) -> float:
    """Seconds of one layer's context-parallel traffic for a microbatch of `tokens` (whole
    sequences) over `cp` GPUs (`per_node` of them in a node; default all), forward and
    backward: the all-gather of the layer's bf16 K and V (tokens x key-value heads x head
    dim each, a TP rank's heads) and the reduce-scatter of their gradients (module
    docstring)."""
    if cp <= 1:
        return 0.0
    size = 2.0 * 2 * tokens * cfg.num_kv_heads * cfg.head_dim / min(tp, cfg.num_kv_heads)
    return collective_time(c, "all-gather", size, cp, per_node or cp) + collective_time(
        c, "reduce-scatter", size, cp, per_node or cp
    )


def cp_choices(w, n: int) -> list[int]:
    """CP degrees that divide the `n` GPUs (TP groups) and split the sequence into 2c chunks."""
    return [p for p in CP_DEGREES if n % p == 0 and w.seq_len % (2 * p) == 0]


def experts(cfg: ModelConfig, layer: int) -> int:
    """Routed expert parameters of block `layer` (0 for a dense block)."""
    if not cfg.num_experts or not cfg.is_moe_layer(layer):
        return 0
    return cfg.num_experts * 3 * cfg.dim * cfg.expert_hidden_dim


def a2a_time(c: Cluster, cfg: ModelConfig, tokens: float, ep: int, per_node: int = 0) -> float:
    """Seconds of one MoE layer's expert-parallel traffic in forward and backward over `ep`
    GPUs, `per_node` of them in a node (default all): dispatch and combine all-to-alls of the
    routed tokens' bf16 activations (tokens x top-k x dim), each once in forward and once in
    backward; on the critical path here (DualPipeV's overlap: `sim.hybrid.a2a_exposed`)."""
    if ep <= 1:
        return 0.0
    size = 2.0 * tokens * cfg.top_k * cfg.dim
    return 4 * collective_time(c, "all-to-all", size, ep, per_node or ep)


def flat_step(
    w, c: Cluster, kind: str, tp: int, b: int, recompute: str, ep: int = 1, cp: int = 1
) -> tuple:
    """(step time, exposed traffic, peak memory) of data-parallel `kind` at TP `tp`, microbatch
    `b` sequences, recomputation `recompute`, expert parallelism `ep` (FSDP, MoE: each GPU
    holds 1/ep of the routed experts, gathered over the n/ep GPUs holding the same ones, one a
    node, each on its own rail), context parallelism `cp` (each sequence's tokens over `cp`
    GPUs: module docstring); `w` a `sim.workload.Workload`."""
    units, n = _units(w.cfg, w.seq_len), w.num_gpus // tp
    routed = [experts(w.cfg, i) for i in range(len(units))]
    params = sum(p for p, _ in units)
    tokens, k = b * w.seq_len / cp, w.global_batch // (n // cp) // b
    speed, hbm = c.peak_tflops * 1e12 * w.mfu_at(tokens, tp), c.hbm_tbps * 1e12
    tpc = tp_time(c, w.cfg, tokens, tp)
    fwd = [compute_time(tokens * f / tp, PARAM_BYTES * p / tp, speed, hbm) + tpc for p, f in units]
    extra = recompute_share(w.cfg, recompute) * sum(fwd)
    g = int(c.gpus_per_node) // tp  # this GPU's data-parallel peers in its node
    zero = KINDS[kind]
    shard = min(n, g) if kind == "hsdp" else n

    def coll(op: str, nbytes: float, ranks: int, per_node: int = 0) -> float:
        return collective_time(c, op, nbytes / tp, ranks, per_node or min(ranks, g))

    def sharded(op: str, nbytes: float, expert_bytes: float) -> float:
        if ep <= 1:
            return coll(op, nbytes + expert_bytes, shard)
        return coll(op, nbytes, shard) + coll(op, expert_bytes / ep, shard // ep, 1)

    if zero == 3:  # per unit and microbatch, inside the shard group
        gather = [sharded("all-gather", 2.0 * (p - x), 2.0 * x) for (p, _), x in zip(units, routed)]
        scatter = [
            sharded("reduce-scatter", 4.0 * (p - x), 4.0 * x) for (p, _), x in zip(units, routed)
        ]
        exposed = gather[0] + sum(max(0.0, a - f) for a, f in zip(gather[1:], fwd))
        exposed += sum(max(0.0, a + s - 2 * f) for a, s, f in zip(gather, scatter, fwd))
        comm = k * (2 * sum(gather) + sum(scatter))
        exposed *= k
        if shard < n:  # hsdp: the shard's gradient all-reduced across nodes once a step
            across = coll("all-reduce", GRAD_BYTES * params / shard, n // shard, 1)
            tail = trailing(across, 2 * sum(fwd), len(units)) - 2 * sum(fwd)
            comm, exposed = comm + across, exposed + tail
    else:
        rs = coll("reduce-scatter", GRAD_BYTES * params, n)
        ag = coll("all-gather", PARAM_BYTES * params, n)
        ar = coll("all-reduce", GRAD_BYTES * params, n)
        once = ar if zero == 0 else rs + ag
        comm = once + (k - 1) * rs if zero == 2 else once
        exposed = trailing(once, 2 * sum(fwd), len(units)) - 2 * sum(fwd)
        if zero == 2:
            exposed += (k - 1) * max(0.0, rs - 2 * sum(fwd))
    exposed += w.overlap_cost * (comm - exposed)
    opt = flat_update(w, c, kind, tp)[0]
    a2a = sum(1 for x in routed if x) * a2a_time(c, w.cfg, tokens, ep)
    # the CP group inside a node as far as TP leaves room (module docstring)
    a2a += len(units) * cp_time(c, w.cfg, tokens * cp, cp, tp, min(cp, g))
    step = k * (3 * sum(fwd) + extra + a2a) + exposed + opt
    return step, exposed + k * a2a, flat_memory(w, c, kind, tp, b, recompute, ep, cp)


def ns_traffic(placement: str, nbytes: float, d: int, sharded_state: bool, coll) -> float:
    """Seconds of the traffic Newton-Schulz adds over `d` data-parallel ranks (`sim.optimizer`,
    dion's Muon), for matrices of `nbytes` (bf16) on each rank's part; `coll(kind, nbytes)` times
    a collective over them (all-gather: the whole gathered tensor; all-to-all: a rank's own)."""
    if d <= 1:
        return 0.0
    if placement == "sharded":  # whole matrices, 1/d of them a rank; the results to every rank
        return 2 * coll("all-to-all", nbytes / d) if sharded_state else coll("all-gather", nbytes)
    return coll("all-gather", nbytes) if sharded_state else 0.0  # Moonlight's "DP gather"


def tp_ns_traffic(c: Cluster, nbytes: float, tp: int) -> float:
    """Seconds of bringing a TP group's `tp` GPUs whole matrices and back: two all-to-alls
    inside the node of a GPU's slices, `nbytes` in all (`sim.optimizer`)."""
    return 2 * collective_time(c, "all-to-all", nbytes / tp, tp, tp) if tp > 1 else 0.0


@functools.lru_cache(maxsize=65536)
def flat_update(
    w, c: Cluster, kind: str, tp: int, placements: tuple[str, ...] = PLACEMENTS
) -> tuple[float, str]:
    """(seconds, Newton-Schulz's placement) of the update of data-parallel `kind` at TP `tp`
    (module docstring): the arm's elementwise update on the GPU's shard, and for Muon the
    faster of `placements` with its traffic ('' for AdamW and for one data-parallel rank).
    Cached: every microbatch size and recomputation of a kind shares it."""
    n, zero = w.num_gpus // tp, KINDS[kind]
    g = int(c.gpus_per_node) // tp
    shard = min(n, g) if kind == "hsdp" else n  # the group the state is sharded over
    arm = w.arm.synchronous()
    params = sum(p for p, _ in _units(w.cfg, w.seq_len))
    mats = model_matrices(w.cfg, arm.ns_steps)
    hbm = c.hbm_tbps * 1e12
    elementwise = arm.traffic(params, mats.params) / tp / (shard if zero else 1) / hbm
    if not arm.muon:
        return elementwise, ""
    speed = c.peak_tflops * 1e12 * ns_mfu(w.cfg, w.mfu, w.mfu_scale)
    nbytes = NS_BYTES * mats.params / tp  # this GPU's slice of every matrix

    def coll(op: str, size: float) -> float:
        return collective_time(c, op, size, shard, min(shard, g))

    timed = []
    for placement in placements if shard > 1 else PLACEMENTS[:1]:
        d = shard if placement == "sharded" else 1
        seconds = ns_time(mats, tp * d, speed) + tp_ns_traffic(c, nbytes * tp / d, tp)
        seconds += ns_traffic(placement, nbytes, shard, zero > 0, coll)
        timed.append((elementwise + seconds, placement if shard > 1 else ""))
    return min(timed)


def flat_memory(
    w, c: Cluster, kind: str, tp: int, b: int, recompute: str, ep: int = 1, cp: int = 1
) -> float:
    """Peak bytes per GPU of data-parallel `kind` (`sim.memory.gpu_memory`); with CP the
    data-parallel group is n / cp, sharding with the CP GPUs (`gpu_memory`'s `cp`)."""
    return _flat_memory(w, c, kind, tp, b, recompute, ep, cp).total


def _flat_memory(w, c: Cluster, kind: str, tp: int, b: int, recompute: str, ep: int, cp: int):
    n, zero = w.num_gpus // tp, KINDS[kind]
    shard = min(n, int(c.gpus_per_node) // tp) if kind == "hsdp" else n
    return gpu_memory(
        w.cfg,
        seq_len=w.seq_len,
        microbatch=b,
        tp=tp,
        dp=(shard if zero == 3 else n) // cp,
        zero=zero,
        cp=cp,
        recompute=recompute,
        ep=ep,
        optimizer=w.arm.optimizer,  # synchronous: no error feedback
    )


def _splits(w, c: Cluster, kind: str, tp: int, cp: int) -> bool:
    """Whether the GPUs and the batch split for `kind` at TP `tp` and CP `cp` (HSDP: replicas
    across nodes, its CP group inside its shard group, a node)."""
    n, g = w.num_gpus // tp, int(c.gpus_per_node) // tp
    if n % cp or w.global_batch % (n // cp):
        return False
    return kind != "hsdp" or (n > g and min(n, g) % cp == 0)


def _one_fits(w, c: Cluster, kind: str, tp: int, cp: int) -> bool:
    """Whether a microbatch of one sequence without recomputation fits at CP `cp`."""
    return flat_memory(w, c, kind, tp, 1, "none", 1, cp) <= c.memory_gb * 1e9


def cp_may_fit(w, c: Cluster, kind: str, tp: int, cp: int) -> bool:
    """Whether what CP does not divide (the state and the gathered buffers: the weights'
    terms) leaves room in memory for `kind` at TP `tp` and CP `cp`: else no degree fits."""
    m = _flat_memory(w, c, kind, tp, 1, "full", 1, cp)
    return m.state + m.buffers <= c.memory_gb * 1e9


def best_flat(w, c: Cluster, kind: str, tp: int, ep: int = 1, cp: int = 1) -> tuple | None:
    """(step, exposed, memory, microbatch, recompute) of `kind` at TP `tp` (and CP `cp`): per
    recomputation the largest microbatch that fits (the model charges a microbatch's compute
    in proportion to its tokens, so the largest is the fastest but for the roofline), the
    fastest of those; the one nearest to fitting when none fits; None when the batch does not
    split."""
    if not _splits(w, c, kind, tp, cp):
        return None
    n = w.num_gpus // tp
    local = w.global_batch // (n // cp)
    sizes = [b for b in (2**i for i in range(local.bit_length(), -1, -1)) if local % b == 0]
    limit = c.memory_gb * 1e9
    timed = []
    for mode in RECOMPUTE:
        b = next((b for b in sizes if flat_memory(w, c, kind, tp, b, mode, ep, cp) <= limit), None)
        if b is not None:
            timed.append((*flat_step(w, c, kind, tp, b, mode, ep, cp), b, mode))
            if b == sizes[0]:
                break  # more recomputation at the same microbatch is only slower
    if timed:
        return min(timed, key=lambda r: r[0])
    return (*flat_step(w, c, kind, tp, sizes[-1], "full", ep, cp), sizes[-1], "full")


def flat_options(w, c: Cluster, kinds=tuple(KINDS)) -> list:
    """The best of each data-parallel kind at each TP and CP degree, a larger degree only
    while the smaller needs recomputation or does not fit (`sim.workload.Option`s)."""
    out = []
    for kind in kinds:
        for tp in tp_choices(c, w.num_gpus):
            if tp > 1 and any(o.schedule == kind and o.fits and o.recompute == "none" for o in out):
                break  # TP buys memory the smaller degree no longer needs (sim.hybrid's rule)
            n = w.num_gpus // tp
            for cp in cp_choices(w, n):
                mine = [o for o in out if (o.schedule, o.tp) == (kind, tp)]
                if cp > 1 and (not mine or _one_fits(w, c, kind, tp, mine[-1].cp)):
                    break  # CP buys memory where the smaller degree needs it (TP's rule)
                if cp > 1 and _splits(w, c, kind, tp, cp) and not cp_may_fit(w, c, kind, tp, cp):
                    break  # the weights alone do not fit: CP cannot help
                for ep in _ep_choices(w, c, kind, tp) if cp == 1 else (1,):
                    r = best_flat(w, c, kind, tp, ep, cp)
                    if r is None:
                        continue
                    step, exposed, mem, b, mode = r
                    update, ns = flat_update(w, c, kind, tp)
                    out.append(
                        Option(
                            kind,
                            "sync",
                            1,
                            n // cp,
                            "fsdp" if KINDS[kind] == 3 else "dp",
                            w.global_batch // (n // cp) // b,
                            b,
                            "",
                            step,
                            exposed,
                            0.0,
                            mem,
                            c.memory_gb * 1e9,
                            w.global_batch * w.seq_len / step,
                            tp,
                            mode,
                            ep,
                            cp,
                            ns,
                            update,
                        )
                    )
    return [o for o in out if math.isfinite(o.tokens_per_s)]


def _ep_choices(w, c: Cluster, kind: str, tp: int) -> tuple[int, ...]:
    """Expert-parallel degrees tried: 1, and for an MoE model under FSDP without TP a node's
    GPUs (at most the experts), where the batch and the shard group split evenly."""
    g = min(int(c.gpus_per_node), w.cfg.num_experts)
    if not w.cfg.num_experts or kind != "fsdp" or tp > 1 or g <= 1 or w.num_gpus % g:
        return (1,)
    return (1, g)
