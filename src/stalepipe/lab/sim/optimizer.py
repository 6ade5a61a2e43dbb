"""The optimizer's part of a training step and of memory, per optimizer (issue 52: "2BW's costs
are AdamW's"). Each arm of the verdict (AdamW, AdamW+EF, Muon, Muon+EF) is costed with its own
optimizer, for synchronous and asynchronous schedules alike (docs/verdict.md, 'The cluster
model'). Torch-free: the verdict's tables import `Arm` before any model is built.

**AdamW** is elementwise and memory-bound: `ADAMW_TRAFFIC` = 28 HBM bytes a parameter (the
fp32 gradient read, 4; the fp32 master weights and both moments read and written, 3 x 8), at
the GPU's HBM bandwidth, on the share of the parameters the GPU updates (1/D where ZeRO or FSDP
shards the state).

**Muon** (training/optim/muon.py) on each hidden weight matrix (`groups.param_kind` 'matrix':
the attention and MLP projections, an MoE layer's router and experts), AdamW on the rest (the
embedding, the head, the norms), as our Muon does:

- elementwise, `MUON_TRAFFIC` = 24 bytes a matrix parameter: the gradient read (4), the fp32
  master weights and the momentum read and written (2 x 8), the bf16 Newton-Schulz input
  written and its output read (2 + 2);
- **Newton-Schulz** (`ns_flops`), exactly the matmuls of `muon.newton_schulz`: on the wide
  orientation of an m x n matrix (m <= n), `steps` iterations (`ns_steps`, 5 by default) of
  `gram = X X^T` (2 m^2 n FLOPs), `gram @ gram` (2 m^3) and `poly @ X` (2 m^2 n):
  `steps x (4 m^2 n + 2 m^3)`. The elementwise terms (3 m n + 3 m^2 an iteration, under 1/m
  of the matmuls) are left out. SmolLM-360M: 7.22 TFLOP a step over its 224 matrices (the
  issue's "~7 TFLOP"; tests/sim/test_optimizer_cost.py);
- the Newton-Schulz matmuls run at the calibrated MFU of their size (`ns_mfu`:
  `sim.efficiency.curve` at x = one iteration over one block's matrices, the unit the curve
  is fitted in: a block's matmuls on one GPU), or at `--mfu` when one is given, times the
  assumptions' MFU scale; bf16, at the GPU's dense bf16 peak (on CUDA our Muon runs NS in
  bf16, as Jordan's reference does).

**Where Newton-Schulz runs** (`PLACEMENTS`); the search tries both wherever the GPU holds
data-parallel peers, and keeps the faster:

- `replicated`, the naive way: every data-parallel replica orthogonalises every matrix of its
  stage (Moonlight's Algorithm 1 does too, Liu et al. 2025, arXiv 2502.16982: "DP Gather" of the
  momentum, the full NS on every rank, the local part kept); where ZeRO or FSDP shards the
  state, that gather is an all-gather of the bf16 matrices over the D ranks;
- `sharded`: each of the D ranks orthogonalises whole matrices, 1/D of them (at least the
  largest one), as microsoft/dion's `dion/muon.py` (commit 0c20549) does: with the matrices
  whole on every rank (DDP) each rank runs NS on its one matrix of a batch of D and the
  results are all-gathered (bf16); with the matrices sharded (FSDP2) an all-to-all brings each
  rank one whole matrix of the batch and a second one sends the results back ("FSDP2 Muon uses
  all-to-all communications", after Essential AI's distributed Muon), so ZeRO-1/2 and FSDP pay
  two all-to-alls of the bf16 matrices and DP one all-gather.

With **tensor parallelism** t a GPU holds slices: as dion's sharded-matrix path, two
all-to-alls inside the node bring the t GPUs of a TP group whole matrices, 1/t of them each,
and send the results back (an assumption: Megatron's own Muon support is not modelled). The NS
traffic is on the critical path of a synchronous step (not overlapped) and, in an asynchronous
one, hides behind the step as the replicas' other exchanges do.

**State per parameter** (`Arm.state_bytes`, `sim.memory.state_bytes`): fp32 gradient 4, fp32
master 4, AdamW's two moments 8 (Muon: one momentum 4 on the matrices, AdamW's 8 on the rest),
error feedback's fp32 copy of the last update `EF_BYTES` 4 (only on EF arms, only on
asynchronous schedules: the synchronous baseline runs without it), all sharded by ZeRO-1 and up
(EF's buffer is the update of the shard a rank computes, so it shards with the optimizer state).
EF also moves `EF_TRAFFIC` = 8 bytes a parameter (its buffer read and written). 2BW's second
weight version is the schedule's (`sim.memory.rank_memory`). Newton-Schulz's working buffers
(a few bf16 copies of the largest matrix) are not counted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from stalepipe.config import ModelConfig
from stalepipe.lab.sim.efficiency import curve

OPTIMIZERS = ("adamw", "muon")
NAMES = {"adamw": "AdamW", "muon": "Muon"}
NS_STEPS = 5  # optim.ns_steps' default (training/optim/specs.py)
PLACEMENTS = ("replicated", "sharded")
ADAMW_TRAFFIC = 28.0  # HBM bytes a parameter of an AdamW update (module docstring)
MUON_TRAFFIC = 24.0  # HBM bytes a matrix parameter of Muon's elementwise part
EF_TRAFFIC = 8.0  # error feedback's buffer read and written
GRAD_MASTER_BYTES = 8.0  # fp32 gradient accumulator 4 + fp32 master weights 4
OPTIMIZER_BYTES = {"adamw": 8.0, "muon": 4.0}  # fp32 buffers a (matrix) parameter beyond them
EF_BYTES = 4.0  # error feedback's fp32 copy of the last update
NS_BYTES = 2.0  # what Newton-Schulz's traffic moves a matrix parameter: bf16


@dataclass(frozen=True)
class Arm:
    """What an arm of the verdict trains with: the optimizer it is costed as, error feedback
    (on its asynchronous schedules only), Muon's Newton-Schulz iterations."""

    optimizer: str = "adamw"
    ef: bool = False
    ns_steps: int = NS_STEPS

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")

    @property
    def muon(self) -> bool:
        return self.optimizer == "muon"

    def label(self) -> str:
        """'AdamW', 'AdamW+EF', 'Muon', 'Muon+EF'."""
        return NAMES[self.optimizer] + ("+EF" if self.ef else "")

    def synchronous(self) -> Arm:
        """The arm as its synchronous baseline runs it: without error feedback."""
        return Arm(self.optimizer, False, self.ns_steps) if self.ef else self

    def traffic(self, params: float, matrix_params: float) -> float:
        """HBM bytes of the elementwise update of `params` parameters, `matrix_params` of them
        matrices (module docstring)."""
        m = matrix_params if self.muon else 0.0
        out = ADAMW_TRAFFIC * (params - m) + MUON_TRAFFIC * m
        return out + (EF_TRAFFIC * params if self.ef else 0.0)

    def state_bytes(self, params: float, matrix_params: float) -> float:
        """Bytes kept between steps beyond the bf16 weights: gradient, master, the optimizer's
        buffers and EF's (module docstring)."""
        m = matrix_params if self.muon else 0.0
        buffers = OPTIMIZER_BYTES["adamw"] * (params - m) + OPTIMIZER_BYTES["muon"] * m
        return GRAD_MASTER_BYTES * params + buffers + (EF_BYTES * params if self.ef else 0.0)


ADAMW = Arm()


def ns_flops(rows: int, cols: int, steps: int = NS_STEPS) -> float:
    """The matmul FLOPs of `muon.newton_schulz` on a `rows x cols` matrix (module docstring)."""
    m, n = min(rows, cols), max(rows, cols)
    return float(steps * (4 * m * m * n + 2 * m**3))


def block_matrices(cfg: ModelConfig, layer: int) -> tuple[tuple[int, int, int], ...]:
    """(rows, cols, how many) of block `layer`'s weight matrices, as the model builds them
    (models/layers.py, models/moe.py; `nn.Linear` weights are out x in)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn = ((q, cfg.dim, 1), (kv, cfg.dim, 2), (cfg.dim, q, 1))
    if not cfg.is_moe_layer(layer):
        return (*attn, (cfg.ffn_dim, cfg.dim, 2), (cfg.dim, cfg.ffn_dim, 1))
    fe, e = cfg.expert_hidden_dim, cfg.num_experts
    out = (*attn, (e, cfg.dim, 1), (fe, cfg.dim, 2 * e), (cfg.dim, fe, e))
    if cfg.num_shared_experts:
        s = cfg.num_shared_experts * fe
        out += ((s, cfg.dim, 2), (cfg.dim, s, 1))
    return out


@dataclass(frozen=True)
class Matrices:
    """What Newton-Schulz works on in some layers: matrix parameters, FLOPs a step, and the
    FLOPs of the largest matrix (the least one rank of a sharded placement does)."""

    params: float = 0.0
    flops: float = 0.0
    largest: float = 0.0

    def __add__(self, o: Matrices) -> Matrices:
        return Matrices(self.params + o.params, self.flops + o.flops, max(self.largest, o.largest))


@functools.lru_cache(maxsize=4096)
def layer_matrices(cfg: ModelConfig, layer: int, steps: int = NS_STEPS) -> Matrices:
    """`Matrices` of block `layer`."""
    shapes = block_matrices(cfg, layer)
    return Matrices(
        float(sum(r * c * k for r, c, k in shapes)),
        sum(k * ns_flops(r, c, steps) for r, c, k in shapes),
        max(ns_flops(r, c, steps) for r, c, _ in shapes),
    )


@functools.lru_cache(maxsize=4096)
def layers_matrices(cfg: ModelConfig, layers: tuple[int, ...], steps: int = NS_STEPS) -> Matrices:
    """`Matrices` of the blocks `layers` (a stage's, or the whole model's)."""
    out = Matrices()
    for i in layers:
        out = out + layer_matrices(cfg, i, steps)
    return out


def model_matrices(cfg: ModelConfig, steps: int = NS_STEPS) -> Matrices:
    """`Matrices` of every block of the model."""
    return layers_matrices(cfg, tuple(range(cfg.num_layers)), steps)


@functools.lru_cache(maxsize=1024)
def ns_mfu(cfg: ModelConfig, mfu: float | None, mfu_scale: float = 1.0) -> float:
    """The MFU Newton-Schulz's matmuls run at (module docstring): the given `mfu`, else the
    calibrated curve at one iteration over one block's matrices; times `mfu_scale`, at most 1."""
    x = layer_matrices(cfg, 0, 1).flops
    base = curve(x) if mfu is None else mfu
    return min(1.0, base * mfu_scale)


def ns_time(mats: Matrices, group: int, speed: float) -> float:
    """Seconds of Newton-Schulz on `mats` spread over `group` GPUs, whole matrices (each does
    the larger of an even share and the largest matrix), at `speed` FLOP/s a GPU."""
    if not mats.flops or speed <= 0:
        return 0.0
    return max(mats.flops / max(1, group), mats.largest) / speed


@dataclass(frozen=True)
class Update:
    """How a pipeline rank's update (its STEP) is simulated: `arm`'s elementwise update, and
    Newton-Schulz on its matrices spread over `group` GPUs at `speed` FLOP/s a GPU (`speed` 0:
    not in the STEP; a synchronous schedule's is added in its gap, `sim.hybrid`). Hashable: the
    pipeline timings are cached on it."""

    arm: Arm = ADAMW
    group: int = 1
    speed: float = 0.0

    def time(self, params: float, mats: Matrices, hbm: float, share: float = 1.0) -> float:
        """Seconds of one rank's update of `params` parameters holding `mats`, the elementwise
        part on `share` of them, at `hbm` bytes/s."""
        elementwise = self.arm.traffic(params, mats.params) * share / hbm
        return elementwise + (ns_time(mats, self.group, self.speed) if self.arm.muon else 0.0)


ELEMENTWISE = Update()  # AdamW's update, no Newton-Schulz: the timings' default
