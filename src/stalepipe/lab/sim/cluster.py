"""A cluster for the verdict's throughput model: nodes of GPUs, two kinds of link, and the
cost of the collectives data parallelism and FSDP use, as NCCL runs them (docs/verdict.md, 'The
cluster model').

A `Cluster` is the GPU's compute (peak bf16 FLOP/s, HBM bandwidth, memory) and its links:
inside a node (NVLink or PCIe) and between nodes (InfiniBand or Ethernet), each a line rate per
GPU and per direction (Gb/s) and a per-hop latency (us). Between nodes, "per GPU" is one rail:
DGX-style nodes give each GPU its own NIC (8 x 400 Gb/s), and a node whose one 100 Gb/s NIC is
shared by 8 GPUs is 12.5 Gb/s per GPU. `link_efficiency` and `intra_node_efficiency` are the
shares of the line rates NCCL's bus bandwidth reaches (0.92: 46-48 GB/s per 400 Gb/s = 50 GB/s
NIC; 0.82: 370 of NVLink 4's 450 GB/s, ring).

Collectives (`collective_time`), as NCCL runs them over a group of n GPUs, k of them in each of
its N = n / k nodes:

- **rings** (all-reduce, all-gather, reduce-scatter): NCCL runs one ring per channel and spreads
  the channels over the node's NICs, so a ring that leaves the node crosses it on all k rails
  of the group at once: bus bandwidth = efficiency x min(intra-node line rate, k x rail rate)
  (one GPU per node: its own NIC; a whole node in the group: the node's aggregate). The k
  rails are the group's share of the node's NICs: the other groups of the node (other pipeline
  stages) use theirs at the same time. Time = latency + bytes moved per rank / bus bandwidth,
  bytes = 2(n-1)/n x S (all-reduce) or (n-1)/n x S (S the whole gathered or scattered tensor);
  latency per pass (two for an all-reduce) n - 1 steps, N - 1 of them between nodes
  (`tuning.cc`: `(nsteps - nInterSteps) * intraLat + nInterSteps * interLat`), each step's
  latency the preset's per-hop latency times a scale that grows with the chunk S / n a rank
  sends in it, from NCCL's small-message (LL) cost to its large-message (Simple) one: a
  saturating curve fitted on one published nccl-tests sweep (`HOP_SMALL`, `HOP_LARGE`,
  `CHUNK_HALF`; issue 52: the constant latency was 3x too high for small messages and the
  model 1.2-2.7x too fast at FSDP's 32-256 MiB);
- **trees** (all-reduce only, across nodes): NCCL's double binary tree between nodes, a chain
  inside each: latency 2 x (log2 N x inter-node + (k-1) x intra-node), each hop a ring hop
  times tuning.cc's tree / ring ratio (`TREE_HOP_NET`, `TREE_HOP_NVLINK`), bus bandwidth 0.92
  x the ring's (`tuning.cc`). NCCL picks, per size, the faster of the two; so does this one: the
  tree for small, latency-bound messages over many nodes, the ring for large ones. (At N = 2 a
  tree moves half the ring's bytes across nodes, which is why two-node nccl-tests all-reduce
  figures exceed the NICs' line rate; the model keeps the ring's bytes: conservative there.)

Presets (`CLUSTERS`); one's own: a .json or .toml file with the keys of `Cluster` (any subset,
with `base` naming the preset the others default to), or `--inter-node-gbps` over a preset.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalepipe.config import ConfigError, unknown_choice
from stalepipe.hardware import DEVICES, Device


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """GPUs, nodes and links; bandwidths in Gb/s per GPU and direction, latencies in us."""

    name: str
    gpu: str  # what the compute figures are (a datasheet name)
    peak_tflops: float  # dense bf16
    hbm_tbps: float  # HBM bandwidth, TB/s (the optimizer update is memory bound)
    memory_gb: float  # HBM per GPU, decimal GB
    gpus_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    intra_node_latency_us: float
    inter_node_latency_us: float
    # the share of the line rate NCCL's bus bandwidth reaches between nodes (nccl-tests issue
    # 290: 46-48 GB/s per 400 Gb/s NIC = 0.92-0.96; NVIDIA/nccl issue 495: 600 of 800 Gb/s over
    # RoCE) and inside a node (nccl-tests issue 212: 370 of NVLink 4's 450 GB/s, "protocol
    # overhead (~20%)", ring; NVLink SHARP's all-reduce is not modelled)
    link_efficiency: float = 0.92
    intra_node_efficiency: float = 0.82

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in ("name", "gpu") and not (isinstance(value, int | float) and value > 0):
                raise ConfigError(
                    f"cluster {self.name}: {f.name} must be a number > 0, got {value!r}"
                )
        if max(self.link_efficiency, self.intra_node_efficiency) > 1:
            raise ConfigError(f"cluster {self.name}: an efficiency must be in (0, 1]")
        if int(self.gpus_per_node) != self.gpus_per_node:
            raise ConfigError(f"cluster {self.name}: gpus_per_node must be a whole number")

    def link(self, spans_nodes: bool) -> tuple[float, float]:
        """(bandwidth in bytes/s, latency in s) of one GPU's link, across nodes (its rail) or
        inside its node, at `link_efficiency` of the line rate: pipeline p2p messages."""
        if spans_nodes:
            bw = self.link_efficiency * self.inter_node_gbps
            return bw * 1e9 / 8, self.inter_node_latency_us * 1e-6
        return self.intra_node_efficiency * self.intra_node_gbps * 1e9 / 8, (
            self.intra_node_latency_us * 1e-6
        )

    def device(self) -> Device:
        """The simulator's `Device` for this cluster (pipeline p2p uses the same links)."""
        return Device(
            name=self.gpu,
            peak_flops=self.peak_tflops * 1e12,
            hbm_bandwidth=self.hbm_tbps * 1e12,
            intra_node_bandwidth=self.link(False)[0],
            inter_node_bandwidth=self.link(True)[0],
            p2p_latency=self.inter_node_latency_us * 1e-6,
            gpus_per_node=int(self.gpus_per_node),
            memory_bytes=self.memory_gb * 1e9,
        )

    def describe(self) -> str:
        return (
            f"{self.name}: {self.gpu}, {self.gpus_per_node} per node, {self.memory_gb:g} GB, "
            f"{self.peak_tflops:g} TFLOP/s bf16; links per GPU: {self.intra_node_gbps:g} Gb/s "
            f"inside a node ({self.intra_node_latency_us:g} us), {self.inter_node_gbps:g} Gb/s "
            f"between nodes ({self.inter_node_latency_us:g} us); NCCL at {self.intra_node_efficiency:.0%}"
            f" / {self.link_efficiency:.0%} of those line rates"
        )


def _from_device(name: str, dev: Device, inter_gbps: float, inter_us: float) -> Cluster:
    return Cluster(
        name=name,
        gpu=dev.name,
        peak_tflops=dev.peak_flops / 1e12,
        hbm_tbps=dev.hbm_bandwidth / 1e12,
        memory_gb=dev.memory_bytes / 1e9,
        gpus_per_node=dev.gpus_per_node,
        intra_node_gbps=dev.intra_node_bandwidth * 8 / 1e9,
        inter_node_gbps=inter_gbps,
        intra_node_latency_us=5.0,
        inter_node_latency_us=inter_us,
    )


_H100 = DEVICES["h100"]  # NVLink 4: 450 GB/s one way = 3600 Gb/s per GPU (devices.py)
# NCCL's bus bandwidth over Ethernet (RoCE): NVIDIA/nccl issue 495, "~600 of 800 Gb/s" on
# 8 x 100G RoCE NICs = 0.75 of line rate (InfiniBand's 0.92: nccl-tests issue 290)
ROCE_EFFICIENCY = 0.75
CLUSTERS: dict[str, Cluster] = {
    # DGX H100: one ConnectX-7 NDR InfiniBand 400 Gb/s NIC per GPU
    "h100-ib": _from_device("h100-ib", _H100, 400.0, 10.0),
    # the same nodes on Ethernet (RoCE) at 100 and 25 Gb/s per GPU
    "h100-eth100": dataclasses.replace(
        _from_device("h100-eth100", _H100, 100.0, 20.0), link_efficiency=ROCE_EFFICIENCY
    ),
    "h100-eth25": dataclasses.replace(
        _from_device("h100-eth25", _H100, 25.0, 30.0), link_efficiency=ROCE_EFFICIENCY
    ),
    # DGX A100: NVLink 3 (300 GB/s one way), one HDR InfiniBand 200 Gb/s NIC per GPU
    "a100-ib": _from_device("a100-ib", DEVICES["a100"], 200.0, 10.0),
    # PCIe-only nodes: NVIDIA H100 PCIe datasheet (756 TFLOPS bf16 dense, 80 GB HBM2e at
    # 2.0 TB/s), GPUs talk through PCIe Gen5 x16 (64 GB/s = 512 Gb/s one way), 100 Gb/s
    # Ethernet per GPU between nodes
    "h100-pcie": dataclasses.replace(
        _from_device("h100-pcie", _H100, 100.0, 20.0),
        **dict(gpu="NVIDIA H100 PCIe", peak_tflops=756.5, hbm_tbps=2.0, intra_node_gbps=512.0),
        intra_node_latency_us=10.0,
        link_efficiency=ROCE_EFFICIENCY,
    ),
}

KEYS = [f.name for f in dataclasses.fields(Cluster)]


def _read(path: Path) -> dict[str, object]:
    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cluster file {path} cannot be read ({e}); see docs/verdict.md"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"cluster file {path} must hold a table of keys, e.g. gpus_per_node")
    return data


def cluster_file(path: str | Path) -> Cluster:
    """A cluster described in a .json or .toml file: `base` (a preset, default h100-ib) and any
    of `KEYS` over it. A key not in `KEYS` raises ConfigError naming the closest."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--cluster {p}: no such file; give a preset ({', '.join(CLUSTERS)})")
    data = _read(p)
    base = str(data.pop("base", "h100-ib"))
    if base not in CLUSTERS:
        raise unknown_choice("cluster", base, CLUSTERS, key=f"{p}: base")
    for key in data:
        if key not in KEYS:
            raise unknown_choice("key", key, KEYS, key=f"cluster file {p}")
    return dataclasses.replace(CLUSTERS[base], **{"name": p.stem, **data})  # type: ignore[arg-type]


def get_cluster(name: str, inter_node_gbps: float | None = None) -> Cluster:
    """A preset of `CLUSTERS` or a cluster file (.json / .toml), with the inter-node bandwidth
    overridden when given; an unknown preset raises ConfigError suggesting the closest."""
    if name.lower().endswith((".json", ".toml")):
        c = cluster_file(name)
    elif name in CLUSTERS:
        c = CLUSTERS[name]
    else:
        raise unknown_choice("cluster", name, CLUSTERS)
    if inter_node_gbps is not None:
        c = dataclasses.replace(c, inter_node_gbps=inter_node_gbps)
    return c


# ---- collectives (alpha-beta, as NCCL runs them) ----------------------------------------------

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def ring_bytes_per_rank(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring `kind` over `n` ranks of a tensor of
    `nbytes` (the whole tensor: the all-reduced one, the gathered one, the one scattered)."""
    share = (n - 1) / n * nbytes
    # all-to-all: each rank keeps 1/n of its S bytes and sends the rest, 1/n to each peer
    return {"all-reduce": 2 * share, "all-gather": share, "reduce-scatter": share,
            "all-to-all": share}[kind]  # fmt: skip


def ring_time(kind: str, nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring `kind` over `n` ranks whose links all have `bandwidth` (bytes/s, the
    bus bandwidth) and `latency` (s) per hop: hops x latency + bytes per rank / bandwidth."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
    return steps * latency + ring_bytes_per_rank(kind, nbytes, n) / bandwidth


TREE_BANDWIDTH = 0.92  # NCCL tuning.cc: a tree all-reduce's bus bandwidth, "busBw * .92"

# The latency of a ring step grows with the chunk each rank sends in it (issue 52): NCCL sends
# small messages with its LL protocol (a few us a hop) and large ones with Simple, whose
# per-step cost is several times higher (tuning.cc's hwLat at NVIDIA/nccl b647562: ring LL 0.6
# / 2.7 us a hop over NVLink / the network, Simple 3.4 / 14 us). A saturating curve in the
# chunk m = S / n (the bytes a rank sends a step), the same form as `sim.efficiency`'s, scales
# the preset's per-hop latencies: h(m) = HOP_SMALL + (HOP_LARGE - HOP_SMALL) x hop_share(m).
# Fitted (`sim.calibration.fit_collectives`) on ONE complete nccl-tests sweep,
# `COLLECTIVE_CALIBRATION`, every size it prints; every other published sweep is held out
# (benchmarks/validation/cluster_published.py, docs/verdict.md 'Checked against published
# figures'). The bus bandwidth is the one above at every size: a large message reaches it.
COLLECTIVE_CALIBRATION = "vp-all-gather"  # H100 + 400 Gb/s InfiniBand, 4 x 8, 512 B to 8 GiB
HOP_SMALL = 0.319  # x the preset's per-hop latency, tiny chunks (tests check `fit_collectives`)
HOP_LARGE = 1.52  # x the preset's per-hop latency, large chunks
CHUNK_HALF = 1.26e5  # bytes a rank sends a step at which the scale is half way
# A tree's hop against a ring's, from tuning.cc's hwLat (tree / ring; NVIDIA/nccl b647562), LL
# for tiny chunks and Simple for large ones, moved between the two as the ring's scale is: across
# nodes 5.0 / 2.7 and 28 / 14; inside a node (NVLink) 0.6 / 0.6 and 28 / 3.4. Not fitted.
TREE_HOP_NET = (5.0 / 2.7, 28 / 14.0)
TREE_HOP_NVLINK = (0.6 / 0.6, 28 / 3.4)
# The held-out error of `collective_time` at these constants: median and worst |model / published
# - 1| of the held-out sweeps' bus bandwidths at 1-256 MiB (cluster_published.py prints them;
# tests/verdict/test_cluster_published.py recomputes them). `sim.efficiency.MODEL_ERROR` is the
# larger of this and the training rows' (docs/verdict.md).
COLLECTIVE_ERROR = 0.189
COLLECTIVE_ERROR_WORST = 0.898


def bus_bandwidth(c: Cluster, per_node: int, nodes: int) -> float:
    """Bytes/s of NCCL's bus bandwidth for a group with `per_node` GPUs in each of `nodes`
    nodes (module docstring): the intra-node link, and across nodes the group's rails."""
    intra = c.intra_node_efficiency * c.intra_node_gbps
    if nodes <= 1:
        return intra * 1e9 / 8
    return min(intra, c.link_efficiency * per_node * c.inter_node_gbps) * 1e9 / 8


def hop_share(chunk: float, half: float = CHUNK_HALF) -> float:
    """How far a step of `chunk` bytes a rank is from NCCL's small-message latency (0) to its
    large-message one (1)."""
    return chunk / (chunk + half)


@functools.lru_cache(maxsize=65536)
def collective_time(
    c: Cluster,
    kind: str,
    nbytes: float,
    n: int,
    per_node: int = 0,
    hops: tuple[float, float, float] = (HOP_SMALL, HOP_LARGE, CHUNK_HALF),
) -> float:
    """Seconds of collective `kind` of a tensor of `nbytes` over `n` GPUs of cluster `c`,
    `per_node` of them in each node (default: as many as fit, min(n, GPUs per node)); the
    faster of NCCL's ring and (all-reduce across nodes) tree. `hops`: (HOP_SMALL, HOP_LARGE,
    CHUNK_HALF), the calibrated latency curve (given otherwise only by its fit). Cached: a search
    asks for the same exchange at every microbatch size, recomputation and placement."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    k = min(n, per_node or int(c.gpus_per_node))
    nodes = math.ceil(n / k)
    bw = bus_bandwidth(c, k, nodes)
    small, large, half = hops
    f = hop_share(nbytes / n, half)
    scale = (small + (large - small) * f) * 1e-6
    a_in, a_out = c.intra_node_latency_us * scale, c.inter_node_latency_us * scale
    moved = ring_bytes_per_rank(kind, nbytes, n)
    # NCCL's ring latency: per pass (two for an all-reduce), n - 1 steps, N - 1 across nodes
    ring = (n - nodes) * a_in + (nodes - 1) * a_out
    if kind != "all-reduce":
        return ring + moved / bw
    ring = 2 * ring + moved / bw
    if nodes <= 1:
        return ring
    (net_lo, net_hi), (nvl_lo, nvl_hi) = TREE_HOP_NET, TREE_HOP_NVLINK
    net, nvl = net_lo + (net_hi - net_lo) * f, nvl_lo + (nvl_hi - nvl_lo) * f
    tree = 2 * (math.floor(math.log2(nodes)) * a_out * net + (k - 1) * a_in * nvl)
    return min(ring, tree + moved / (TREE_BANDWIDTH * bw))


# ---- overlap and compute (sim/parallel.py's steps) ------------------------------------------


def compute_time(flops: float, weight_bytes: float, speed: float, hbm: float) -> float:
    """Seconds of a forward of `flops` through layers of `weight_bytes` (bf16): the roofline of
    the compute at `speed` (peak x MFU) and of reading the weights at `hbm` bytes/s. A
    microbatch of t tokens does 2t FLOPs per weight it reads (2 bytes), so it is weight-bound
    below t = speed / hbm (118 tokens on an H100 at MFU 0.4): short sequences, one at a time."""
    return max(flops / speed, weight_bytes / hbm)


def trailing(comm: float, compute: float, units: int) -> float:
    """From the start of a backward over `units` equal layers until its gradient traffic
    (`comm` in all) ends, each layer's share sent as soon as its backward ends and the layer
    before's is sent (DDP's buckets, FSDP's per-layer reduce-scatter): a two-machine flow."""
    if comm <= 0:
        return compute
    c, b = comm / units, compute / units
    return b + c + (units - 1) * max(b, c)


def leading(comm: float, compute: float, units: int) -> float:
    """What gathering the weights (`comm` in all) adds to a forward over `units` equal layers
    when each layer's gather is issued as the layer before starts computing (FSDP2's
    prefetch): the first gather, then each layer's gather beyond its predecessor's compute."""
    if comm <= 0:
        return 0.0
    g, f = comm / units, compute / units
    return g + (units - 1) * max(0.0, g - f)


# ---- the assumptions with a range --------------------------------------------------------------

# A verdict holds only where it holds at every corner of these (docs/verdict.md, 'The cluster
# model'; `assumption_corners`).
MFU_RANGE = (0.75, 1.25)  # x the MFU (given, or by shape; at most 1): torchtitan's H100 FSDP runs
# 33-39 %, its A100 57 %
# NCCL bus bandwidth / line rate on InfiniBand: 0.75 (p5's all-gathers at 8-16 nodes) to 0.96
# (nccl-tests 290's 48 GB/s per NDR NIC) around its central 0.92; a preset of another fabric
# (RoCE, 0.75) takes the same spread relative to its central value (`link_efficiency_range`)
LINK_EFFICIENCY_RANGE = (0.75, 0.96)
IB_EFFICIENCY = 0.92
OVERLAP_COST_RANGE = (0.0, 0.15)  # no published measurement used: wide enough to show its weight


def link_efficiency_range(c: Cluster) -> tuple[float, float]:
    """`LINK_EFFICIENCY_RANGE` scaled by the cluster's central efficiency over InfiniBand's
    (the same range for InfiniBand; 0.61-0.78 for RoCE's 0.75), at most 1."""
    f = c.link_efficiency / IB_EFFICIENCY
    return tuple(min(1.0, x * f) for x in LINK_EFFICIENCY_RANGE)  # type: ignore[return-value]


def assumption_corners(w: Any, c: Cluster) -> list[tuple[Any, Cluster]]:
    """The workload (`sim.parallel.Workload`) and the cluster at each corner of the
    assumptions' ranges (8: MFU, link efficiency, overlap cost each at its low and high end; a
    given value outside a range widens it)."""
    effs = link_efficiency_range(c)
    costs = (min(OVERLAP_COST_RANGE[0], w.overlap_cost), max(OVERLAP_COST_RANGE[1], w.overlap_cost))
    return [
        (
            dataclasses.replace(w, mfu_scale=w.mfu_scale * f, overlap_cost=o),
            dataclasses.replace(c, link_efficiency=e),
        )
        for f in MFU_RANGE
        for e in effs
        for o in costs
    ]
