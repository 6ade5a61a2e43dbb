"""A cluster for the verdict's throughput model: nodes of GPUs, two kinds of link, and the
alpha-beta cost of the collectives data parallelism and FSDP use (docs/verdict.md, 'The
cluster model').

A `Cluster` is the GPU's compute (peak bf16 FLOP/s, HBM bandwidth, memory) and its links:
inside a node (NVLink or PCIe) and between nodes (InfiniBand or Ethernet), each a bandwidth
per GPU and per direction (Gb/s) and a per-message latency (us). "Per GPU": a node whose one
100 Gb/s NIC is shared by 8 GPUs is 12.5 Gb/s per GPU.

Collectives are rings (NCCL's default for large messages) in the alpha-beta model: a ring over
n ranks takes n-1 steps per phase, each paying the latency alpha and moving 1/n of the bytes
over the slowest link of the ring (the inter-node one as soon as the ring leaves a node):

    all-reduce          2(n-1) alpha + 2(n-1)/n x bytes / beta   (reduce-scatter + all-gather)
    all-gather          (n-1) alpha  + (n-1)/n x bytes / beta    (bytes: the whole gathered tensor)
    reduce-scatter      (n-1) alpha  + (n-1)/n x bytes / beta

Presets (`CLUSTERS`); one's own: a .json or .toml file with the keys of `Cluster` (any subset,
with `base` naming the preset the others default to), or `--inter-node-gbps` over a preset.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from stalepipe.config import ConfigError, unknown_choice
from stalepipe.sim.devices import DEVICES, Device


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

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in ("name", "gpu") and not (isinstance(value, int | float) and value > 0):
                raise ConfigError(
                    f"cluster {self.name}: {f.name} must be a number > 0, got {value!r}"
                )
        if int(self.gpus_per_node) != self.gpus_per_node:
            raise ConfigError(f"cluster {self.name}: gpus_per_node must be a whole number")

    def link(self, spans_nodes: bool) -> tuple[float, float]:
        """(bandwidth in bytes/s, latency in s) of the slowest link of a group of GPUs."""
        if spans_nodes:
            return self.inter_node_gbps * 1e9 / 8, self.inter_node_latency_us * 1e-6
        return self.intra_node_gbps * 1e9 / 8, self.intra_node_latency_us * 1e-6

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
            f"between nodes ({self.inter_node_latency_us:g} us)"
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
CLUSTERS: dict[str, Cluster] = {
    # DGX H100: one ConnectX-7 NDR InfiniBand 400 Gb/s NIC per GPU
    "h100-ib": _from_device("h100-ib", _H100, 400.0, 10.0),
    # the same nodes on Ethernet (RoCE) at 100 and 25 Gb/s per GPU
    "h100-eth100": _from_device("h100-eth100", _H100, 100.0, 20.0),
    "h100-eth25": _from_device("h100-eth25", _H100, 25.0, 30.0),
    # DGX A100: NVLink 3 (300 GB/s one way), one HDR InfiniBand 200 Gb/s NIC per GPU
    "a100-ib": _from_device("a100-ib", DEVICES["a100"], 200.0, 10.0),
    # PCIe-only nodes: NVIDIA H100 PCIe datasheet (756 TFLOPS bf16 dense, 80 GB HBM2e at
    # 2.0 TB/s), GPUs talk through PCIe Gen5 x16 (64 GB/s = 512 Gb/s one way), 100 Gb/s
    # Ethernet per GPU between nodes
    "h100-pcie": dataclasses.replace(
        _from_device("h100-pcie", _H100, 100.0, 20.0),
        **dict(gpu="NVIDIA H100 PCIe", peak_tflops=756.5, hbm_tbps=2.0, intra_node_gbps=512.0),
        intra_node_latency_us=10.0,
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


# ---- collectives (alpha-beta, ring) ---------------------------------------------------------


def ring_bytes_per_rank(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring `kind` over `n` ranks of a tensor of
    `nbytes` (the whole tensor: the all-reduced one, the gathered one, the one scattered)."""
    share = (n - 1) / n * nbytes
    return {"all-reduce": 2 * share, "all-gather": share, "reduce-scatter": share}[kind]


def ring_time(kind: str, nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring `kind` over `n` ranks whose slowest link has `bandwidth` (bytes/s)
    and `latency` (s) per message: steps x latency + bytes per rank / bandwidth."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
    return steps * latency + ring_bytes_per_rank(kind, nbytes, n) / bandwidth
