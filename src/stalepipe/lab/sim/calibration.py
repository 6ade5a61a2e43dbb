"""The calibrations of the cluster model on ONE named source each (issue 52, item 3):
`sim.efficiency`'s curve on Narayanan et al. SC'21 Table 1 (`CALIBRATION_SOURCE`), with the
published layouts it and the held-out rows of benchmarks/validation/cluster_published.py are
timed on, and `sim.cluster.collective_time`'s latency curve on one nccl-tests sweep
(`fit_collectives`). Kept apart from the curves: the fits time with the cluster model, which
reads them."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from stalepipe.config import ModelConfig
from stalepipe.lab.sim.cluster import CLUSTERS, Cluster, collective_time
from stalepipe.lab.sim.efficiency import CALIBRATION_SOURCE, block_size, curve
from stalepipe.lab.sim.parallel import Workload, layout


def gpt(h: int, heads: int, layers: int) -> ModelConfig:
    """Narayanan et al.'s GPT (vocabulary 51,200, sequence 2,048, a 4h GeLU MLP, tied
    embedding) in this package's block: multi-head attention and a SwiGLU of width 8h/3,
    the same 12 h^2 parameters and 24 h^2 matmul FLOPs per token a block (three MLP matmuls
    instead of two)."""
    return ModelConfig(
        vocab_size=51200,
        dim=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        ffn_dim=round(8 * h / 3),
        max_seq_len=2048,
        tie_embeddings=True,
    )


def megatron_tokens_per_s(tflops: float, h: int, layers: int, s: int = 2048, v: int = 51200):
    """A Megatron TFLOP/s per GPU as tokens/s per GPU: Narayanan et al. (SC'21) eq. (3),
    F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per iteration of B s tokens, which counts the
    recomputation's extra forward ('equation (3) assumes activation recomputation')."""
    return tflops * 1e12 / (96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h)))


@dataclass(frozen=True)
class Layout:
    """A published run: the model, the cluster preset, GPUs, global batch (sequences), the
    layout, and the published tokens/s per GPU; `source` names where it is from."""

    source: str
    what: str
    cfg: Any  # ModelConfig
    seq_len: int
    cluster: str  # a preset of sim.cluster.CLUSTERS, or a name in `clusters`
    gpus: int
    batch: int
    tp: int
    stages: int
    schedule: str  # "1f1b", "interleaved-1f1b", ... ; "dp" / "fsdp" without a pipeline
    microbatch: int
    recompute: str
    published: float  # tokens/s per GPU
    cp: int = 1  # context parallelism: each sequence over `cp` GPUs

    def tokens(self) -> float:
        """A microbatch's tokens on one GPU (its shape, `sim.efficiency`)."""
        return self.microbatch * self.seq_len / self.cp


# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM" (SC'21), Table 1: (parameters B, heads, hidden, layers, TP, PP, GPUs, batch,
# achieved TFLOP/s per GPU), on DGX A100 80GB (8 x 200 Gb/s HDR InfiniBand a node), sequence
# 2048, activation recomputation (eq. 3). Not in the table, assumed: microbatch 1 (as in its
# Table 2 and Figures 14-15), the default non-interleaved schedule (1F1B).
MEGATRON_TABLE1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def megatron_layout(
    source: str,
    size: float,
    heads: int,
    h: int,
    layers: int,
    tp: int,
    pp: int,
    gpus: int,
    batch: int,
    tflops: float,
) -> Layout:
    what = f"GPT {size:g}B, TP {tp} x PP {pp} x DP {gpus // (tp * pp)}, {gpus} A100, batch {batch}"
    return Layout(
        source, what, gpt(h, heads, layers), 2048, "a100-ib", gpus, batch, tp, pp,
        "1f1b" if pp > 1 else "dp", 1, "full", megatron_tokens_per_s(tflops, h, layers),
    )  # fmt: skip


CALIBRATION = tuple(megatron_layout(CALIBRATION_SOURCE, *row) for row in MEGATRON_TABLE1)


def timed(r: Layout, mfu: float | None, clusters: dict | None = None) -> float:
    """The cluster model's tokens/s per GPU of layout `r` at a fixed `mfu` (None: the curve)."""
    c = (clusters or {}).get(r.cluster) or CLUSTERS[r.cluster]
    w = Workload(r.cfg, r.seq_len, r.batch, r.gpus, mfu)
    o = layout(
        w,
        c,
        tp=r.tp,
        stages=r.stages,
        schedule=r.schedule,
        microbatch=r.microbatch,
        recompute=r.recompute,
        cp=r.cp,
    )
    return o.tokens_per_s / r.gpus


@functools.lru_cache(maxsize=256)
def _linear(r: Layout) -> tuple[float, float]:
    """(a, b) with 1 / tokens-per-s-per-GPU = a / mfu + b: the layout timed at two MFUs (the
    compute and what scales with it, the bubble, against the traffic that does not)."""
    lo, hi = 0.3, 0.6
    t_lo, t_hi = 1 / timed(r, lo), 1 / timed(r, hi)
    a = (t_lo - t_hi) / (1 / lo - 1 / hi)
    return a, t_hi - a / hi


def predicted(r: Layout, e_max: float, x_half: float) -> float:
    """Tokens/s per GPU of `r` at the curve (e_max, x_half), through `_linear`."""
    a, b = _linear(r)
    x = block_size(r.cfg, r.seq_len, r.tokens(), r.tp)
    return 1 / (a / curve(x, e_max, x_half) + b)


def fit(rows: tuple[Layout, ...] | list[Layout]) -> tuple[float, float]:
    """(E_MAX, X_HALF) minimising the squared log error over the rows of `CALIBRATION_SOURCE`
    alone (the others are ignored: held out): a grid over X_HALF on a log scale, and for each
    the E_MAX that zeroes the mean log error (exact for a pure compute row, refined by two
    fixed-point passes otherwise)."""
    cal = [r for r in rows if r.source == CALIBRATION_SOURCE]
    if len(cal) < 2:
        raise ValueError(f"fit needs two rows of {CALIBRATION_SOURCE} or more, got {len(cal)}")
    best = (math.inf, 0.0, 0.0)
    for i in range(201):  # X_HALF from 1e8 to 1e13 FLOPs
        x_half = 10 ** (8 + 5 * i / 200)
        e = 0.5
        for _ in range(3):
            mean = sum(math.log(r.published / predicted(r, e, x_half)) for r in cal) / len(cal)
            e = min(1.0, e * math.exp(mean))
        sse = sum(math.log(r.published / predicted(r, e, x_half)) ** 2 for r in cal)
        if sse < best[0]:
            best = (sse, e, x_half)
    return best[1], best[2]


# ---- the collectives' latency curve (sim.cluster.HOP_SMALL, HOP_LARGE, CHUNK_HALF) ----------


@dataclass(frozen=True)
class Measured:
    """One published nccl-tests point: `kind` of `nbytes` (nccl-tests' size) over `nodes` x
    `per_node` GPUs of `cluster`, taking `seconds`."""

    cluster: Cluster
    kind: str
    nodes: int
    per_node: int
    nbytes: float
    seconds: float

    def model(self, hops: tuple[float, float, float] | None = None) -> float:
        """`collective_time` of this point, at the calibrated curve or at `hops`."""
        n = self.nodes * self.per_node
        if hops is None:
            return collective_time(self.cluster, self.kind, self.nbytes, n, self.per_node)
        return collective_time(self.cluster, self.kind, self.nbytes, n, self.per_node, hops)


def _log_sse(points: list[Measured], hops: tuple[float, float, float]) -> float:
    return sum(math.log(p.model(hops) / p.seconds) ** 2 for p in points)


def fit_collectives(points: list[Measured]) -> tuple[float, float, float]:
    """(HOP_SMALL, HOP_LARGE, CHUNK_HALF) minimising the squared log error of
    `collective_time` over `points` (the calibration sweep alone; the caller picks it): a grid
    over CHUNK_HALF on a log scale (1e3 to 1e8 bytes, 40 a decade), and for each the two
    scales by Gauss-Newton (a ring's time is linear in them)."""
    if len(points) < 3:
        raise ValueError(f"fit_collectives needs three points or more, got {len(points)}")
    best = (math.inf, 0.0, 0.0, 0.0)
    for i in range(201):
        half = 10 ** (3 + i / 40)
        small, large = 0.5, 1.0
        for _ in range(12):
            base = [math.log(p.model((small, large, half)) / p.seconds) for p in points]
            d = 1e-4
            ds = [math.log(p.model((small + d, large, half)) / p.seconds) for p in points]
            dl = [math.log(p.model((small, large + d, half)) / p.seconds) for p in points]
            js = [(a - b) / d for a, b in zip(ds, base)]
            jl = [(a - b) / d for a, b in zip(dl, base)]
            # the 2 x 2 normal equations of one Gauss-Newton step
            ss, sl, ll = (
                sum(x * y for x, y in zip(u, v)) for u, v in ((js, js), (js, jl), (jl, jl))
            )
            gs, gl = sum(x * r for x, r in zip(js, base)), sum(x * r for x, r in zip(jl, base))
            det = ss * ll - sl * sl
            if det <= 0:
                break
            step_s, step_l = (ll * gs - sl * gl) / det, (ss * gl - sl * gs) / det
            small, large = max(1e-3, small - step_s), max(1e-3, large - step_l)
            if abs(step_s) + abs(step_l) < 1e-9:
                break
        sse = _log_sse(points, (small, large, half))
        if sse < best[0]:
            best = (sse, small, large, half)
    return best[1], best[2], best[3]
