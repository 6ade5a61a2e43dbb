"""Memory: per rank of a schedule, from each rank's action order alone (`rank_memory`), and per
GPU by term (`gpu_memory`).

## Per rank of a schedule

A rank runs its list in order, so what it holds changes only at its own actions and the peak
over its list is the peak in time (the transient inside one action is not modelled). After
each action a rank holds, for every stage it owns:

- weights: every weight version alive (a version lives from the STEP that makes it, version 0
  from the start, until both its last use and the next version exist: `peak_versions`' rule),
  times one version's size, plus the stage's `state` (gradient accumulator and optimizer
  state: one copy, whatever the versions);
- activations: every microbatch forwarded and not yet fully backwarded (a split backward frees
  at BW: the weight gradient still reads the stash), times one microbatch's stash.

Sizes come per stage from the cost model: bytes for `timing.analytic_costs` (see there what is
counted), "units" for `timing.uniform_costs` (one rank's share of the weights = 1, one
microbatch's activations on one rank's share = 1; a stage of a rank with v chunks is 1/v).


## Per GPU, by term

Per-GPU memory of one training configuration, term by term (issue 52, item 2): weights,
gradients and optimizer state per optimizer, activations per layer (SwiGLU, grouped-query
attention, RMSNorm; with and without recomputation), the logits and the communication buffers.
Checked against published measured peaks in `benchmarks/validation/memory_published.py`
(docs/verdict.md, 'Memory').

**Activations per layer** (bytes per token, in units of the model dimension h; bf16, 2 bytes
an element; Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Section 4.1, the derivation of their `34 s b h + 5 a s^2 b` redone for a Llama block):

- attention: the norm's input 2, the QKV projections' input 2, Q 2 and K, V 2g each (g =
  key-value heads / heads: GQA), the attention output (the output projection's input) 2:
  `8 + 4g`. Flash attention keeps no score matrix (their `5 a s / h` term is gone) and no
  dropout mask (Llama has no dropout: their 3 + 2 bytes of masks are gone);
- MLP (SwiGLU of width F): the norm's input 2, the gate and up projections' input 2, the gate
  output (SiLU's input) 2F/h, SiLU's output and the up output (the product's inputs) 2F/h each,
  the product (the down projection's input) 2F/h: `4 + 8 F / h`.

Llama 3 8B (g = 1/4, F/h = 3.5): 9 + 32 = 41 bytes per token per dim, against GPT's 34.

- **selective** recomputation, torchtitan's op-level policy (`torchtitan/distributed/
  activation_checkpoint.py`, `_save_list`: every `mm` output but every second one, the
  attention's output; the rest recomputed): the block's input 2, the Q projection 2, the V
  projection 2g, the attention output 2, the gate projection 2F/h, the down projection 2;
  `8 + 2g + 2F/h` (15.5 at 8B). Megatron's "selective" (the attention core alone) is the
  no-recomputation figure once flash attention is used.
- **full** recomputation: the block's input (2) kept per layer, and one layer's activations
  while it is recomputed in backward (a transient on top).
- with **tensor parallelism** t (Megatron's sequence parallelism on, as torchtitan and Megatron
  run it: Korthikanti's `34 / t`), every term over t; plus the all-gathered inputs of the two
  column-parallel projections, kept whole by the recomputed layer (2 + 2, not divided).

**Logits**: the last stage's loss on fp32 logits (torchtitan: `cross_entropy(pred.float())`),
whose backward starts holding three fp32 copies of tokens x vocab (log-softmax's saved output,
the loss's gradient, log-softmax's input gradient): 12 bytes per token per vocabulary entry,
over t with a vocabulary-parallel loss.

**State per parameter** (`state_bytes`; `sim.optimizer` states the optimizers' part): bf16
weights 2 per version (2BW keeps a second stashed version), fp32 gradients 4, fp32 master
weights 4, and the optimizer's own buffers: AdamW two fp32 moments (8), Muon one fp32 momentum
(4) on its matrices and AdamW's two on the rest (the embedding, the head and the norms: 13 % of
SmolLM-360M, 3 % of Llama 3 70B; `matrix_share`), error feedback one fp32 buffer of the last
update (4). ZeRO stage z shards over the data-parallel group: 1 the master weights, optimizer
buffers and EF's buffer (the update of the shard the rank computes), 2 also the gradients, 3
(FSDP) also the weights, which are then gathered a unit at a time.

**Communication buffers**: FSDP gathers a unit (a block; the embedding and the head are units
of their own) ahead of the one computing: two units of bf16 weights, and one unit's fp32
gradient before its reduce-scatter; under a pipeline torchtitan does not reshard after forward
(`reshard_after_forward` is off with PP) and accumulates unsharded fp32 gradients until the
last microbatch (`gathered`): the stage's weights and gradients whole. DP's gradient buckets
(25 MB) are left out.

Not counted: the CUDA context and NCCL's own buffers, the caching allocator's reserve and
fragmentation (the published peaks are reserved memory: they include it), fp8 weight copies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from stalepipe.config import ModelConfig
from stalepipe.config.shapes import block_params
from stalepipe.lab.sim.optimizer import EF_BYTES, OPTIMIZER_BYTES, model_matrices
from stalepipe.training.schedules.schedule import PipelineSchedule


@dataclass(frozen=True)
class RankMemory:
    """Peaks over one rank's list, in the cost model's memory unit."""

    weights: float  # live weight versions x version size + optimizer state, at its peak
    activations: float  # stashed microbatches x stash size, at its peak
    total: float  # peak of the sum (<= weights + activations: the peaks may not coincide)
    stashed: int  # most microbatch stashes held at once, over all the rank's stages


def _version_deltas(sched: PipelineSchedule, rank: int, stage: int) -> dict[int, int]:
    """Position in `rank`'s list -> change in `stage`'s live version count after that action
    (position -1: before the first action)."""
    acts = sched.ranks[rank]
    born: dict[int, int] = {0: -1}
    last: dict[int, int] = {}
    for i, a in enumerate(acts):
        if a.stage != stage:
            continue
        if a.kind == "STEP":
            born[a.makes] = i
        else:
            last[a.reads] = i
    delta: dict[int, int] = {}
    for v, b in born.items():
        # alive on positions [b, end): until its last use is done and the next version exists
        end = max(last.get(v, b) + 1, born.get(v + 1, len(acts) + 1))
        delta[b] = delta.get(b, 0) + 1
        delta[end] = delta.get(end, 0) - 1
    return delta


def memory_trace(
    sched: PipelineSchedule,
    rank: int,
    weight: tuple[float, ...],
    state: tuple[float, ...],
    activation: tuple[float, ...],
) -> list[tuple[float, float, int]]:
    """(weights, activations, stashed microbatches) held by `rank` after each action of its
    list, with per-stage sizes of one weight version, the optimizer state and one stash."""
    stages = sched.stages_of(rank)
    deltas = {s: _version_deltas(sched, rank, s) for s in stages}
    versions = {s: deltas[s].get(-1, 0) for s in stages}
    w = sum(versions[s] * weight[s] + state[s] for s in stages)
    act, stashed, out = 0.0, 0, []
    for i, a in enumerate(sched.ranks[rank]):
        for s in stages:
            d = deltas[s].get(i, 0)
            versions[s] += d
            w += d * weight[s]
        if a.kind == "F":
            act, stashed = act + activation[a.stage], stashed + 1
        elif a.kind in ("B", "BW"):
            act, stashed = act - activation[a.stage], stashed - 1
        out.append((w, act, stashed))
    return out


def rank_memory(
    sched: PipelineSchedule,
    weight: tuple[float, ...],
    state: tuple[float, ...],
    activation: tuple[float, ...],
) -> tuple[RankMemory, ...]:
    """Per rank, the peaks of `memory_trace` (sizes per stage, as there)."""
    out = []
    for r in range(sched.num_ranks):
        stages = sched.stages_of(r)
        start = sum(weight[s] + state[s] for s in stages)
        trace = memory_trace(sched, r, weight, state, activation) or [(start, 0.0, 0)]
        out.append(
            RankMemory(
                weights=max(start, max(t[0] for t in trace)),
                activations=max(t[1] for t in trace),
                total=max(start, max(t[0] + t[1] for t in trace)),
                stashed=max(t[2] for t in trace),
            )
        )
    return tuple(out)


# ---- per GPU, by term (issue 52, item 2) ----


RECOMPUTE = ("none", "selective", "full")
LOGIT_BYTES = 12.0  # per token per vocabulary entry: three fp32 copies at the backward's start


def _shape(cfg: ModelConfig) -> tuple[float, float]:
    """(g, F/h): key-value heads over heads, and the MLP's width over the model's."""
    ffn = cfg.expert_ffn_dim or cfg.ffn_dim if cfg.num_experts else cfg.ffn_dim
    return cfg.num_kv_heads / cfg.num_heads, ffn / cfg.dim


def layer_bytes_per_token_dim(cfg: ModelConfig, recompute: str = "none") -> float:
    """Activation bytes one layer keeps per token, in units of dim (module docstring); for
    `full` the kept input alone (the recomputed layer is `transient_bytes`)."""
    g, f = _shape(cfg)
    if cfg.num_experts:  # a token's top-k experts (and the shared ones) each keep their MLP
        f *= cfg.top_k + cfg.num_shared_experts
    if recompute == "none":
        return (8 + 4 * g) + (4 + 8 * f)
    if recompute == "selective":
        return 8 + 2 * g + 2 * f
    if recompute == "full":
        return 2.0
    raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")


def activation_bytes(
    cfg: ModelConfig, tokens: float, layers: int, recompute: str, tp: int = 1
) -> float:
    """Bytes one microbatch of `tokens` keeps over `layers` layers on one GPU."""
    return layers * tokens * cfg.dim * layer_bytes_per_token_dim(cfg, recompute) / tp


def transient_bytes(cfg: ModelConfig, tokens: float, recompute: str, tp: int = 1) -> float:
    """What a layer's backward adds on top of the kept activations: under full recomputation
    the recomputed layer whole; with TP the column-parallel inputs gathered whole (2 + 2)."""
    gathered = 4.0 * tokens * cfg.dim if tp > 1 else 0.0
    if recompute != "full":
        return gathered if recompute == "selective" else 0.0
    return tokens * cfg.dim * layer_bytes_per_token_dim(cfg, "none") / tp + gathered


def logits_bytes(cfg: ModelConfig, tokens: float, tp: int = 1) -> float:
    """The loss's fp32 logits at the backward's start on the last stage (vocabulary-parallel
    over `tp`)."""
    return LOGIT_BYTES * tokens * cfg.vocab_size / tp


def state_bytes(
    optimizer: str = "adamw",
    *,
    ef: bool = False,
    versions: int = 1,
    zero: int = 0,
    dp: int = 1,
    matrix_share: float = 1.0,
) -> float:
    """Bytes per parameter a GPU keeps between steps (module docstring), the data-parallel
    group of `dp` sharding as ZeRO stage `zero` says (3: FSDP); `matrix_share` of the
    parameters are matrices (Muon's rule), the rest AdamW's."""
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZER_BYTES)}, got {optimizer!r}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0-3, got {zero}")
    weights, grads = 2.0 * versions, 4.0
    own = matrix_share * OPTIMIZER_BYTES[optimizer] + (1 - matrix_share) * OPTIMIZER_BYTES["adamw"]
    master = 4.0 + own + (EF_BYTES if ef else 0.0)
    return (
        weights / (dp if zero >= 3 else 1)
        + grads / (dp if zero >= 2 else 1)
        + master / (dp if zero >= 1 else 1)
    )


@functools.lru_cache(maxsize=256)
def model_params(cfg: ModelConfig) -> int:
    """Every parameter of the model: its blocks, the embedding and an untied head (cached: each
    configuration's memory asks)."""
    whole = sum(block_params(cfg, i) for i in range(cfg.num_layers))
    return whole + cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)


@dataclass(frozen=True)
class Memory:
    """One GPU's peak, by term (bytes)."""

    state: float
    activations: float
    transient: float
    logits: float
    buffers: float

    @property
    def total(self) -> float:
        return self.state + self.activations + self.transient + self.logits + self.buffers


def gpu_memory(
    cfg: ModelConfig,
    *,
    seq_len: int,
    microbatch: int,
    in_flight: int = 1,
    layers: int | None = None,
    params: float | None = None,
    tp: int = 1,
    dp: int = 1,
    zero: int = 0,
    cp: int = 1,
    recompute: str = "none",
    optimizer: str = "adamw",
    ef: bool = False,
    versions: int = 1,
    last_stage: bool = True,
    gathered: bool = False,
    ep: int = 1,
    matrix_share: float | None = None,
) -> Memory:
    """The peak of one GPU holding `layers` layers (default all) with `params` parameters
    (default the whole model's), `in_flight` microbatches of `microbatch` sequences stashed
    (a pipeline stage's most), tensor-parallel over `tp`, context-parallel over `cp`, the
    data-parallel group of `dp` sharding by ZeRO stage `zero`. Peak at the backward's start:
    every stash, the logits on the last stage, one layer's recomputation. `gathered`: FSDP
    under a pipeline as torchtitan runs it (no resharding after forward, gradients accumulated
    unsharded until the step's last microbatch): the stage's bf16 weights and fp32 gradients
    whole, instead of a unit at a time. `ep`: expert parallelism (a unit's routed experts are
    gathered 1/ep at a time). `matrix_share`: the share of `params` in Muon's matrices
    (default the model's)."""
    layers = cfg.num_layers if layers is None else layers
    whole = model_params(cfg)
    params = whole if params is None else params
    tokens = microbatch * seq_len / cp
    # ZeRO shards over the data- and context-parallel ranks together (torchtitan's dp_shard_cp;
    # Megatron's distributed optimizer: get_data_parallel_group(with_context_parallel=True))
    shard = dp * cp
    share = model_matrices(cfg).params / whole if matrix_share is None else matrix_share
    kept = state_bytes(optimizer, ef=ef, versions=versions, zero=zero, dp=shard, matrix_share=share)
    state = params / tp * kept
    acts = in_flight * activation_bytes(cfg, tokens, layers, recompute, tp)
    buffers = 0.0
    if zero >= 3 and shard > 1 and gathered:
        buffers = (2.0 + 4.0) * params / tp
    elif zero >= 3 and shard > 1:  # two gathered bf16 units and one unit's fp32 gradient
        last = cfg.num_layers - 1  # with EP a GPU gathers 1/ep of the routed experts
        routed = cfg.num_experts * 3 * cfg.dim * cfg.expert_hidden_dim if cfg.num_experts else 0
        block = max(block_params(cfg, 0), block_params(cfg, last) - routed * (1 - 1 / ep))
        unit = max(block, cfg.vocab_size * cfg.dim) / tp
        buffers = 2 * 2.0 * unit + 4.0 * unit
    logits = logits_bytes(cfg, tokens, tp) if last_stage else 0.0
    return Memory(state, acts, transient_bytes(cfg, tokens, recompute, tp), logits, buffers)
