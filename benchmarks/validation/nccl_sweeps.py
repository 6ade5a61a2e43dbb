"""Complete published nccl-tests sweeps (every size of a run's output), the data the collective
model (`sim.cluster.collective_time`) is calibrated on and checked against (issue 52, item 3;
benchmarks/validation/cluster_published.py prints the comparison).

nccl_sweeps.csv beside this file holds the published numbers only, quoted as printed: the
size in bytes (nccl-tests' size: the whole gathered, scattered or reduced buffer), the time in
us where the source prints it, and the bus bandwidth in GB/s (out-of-place unless `SWEEPS`
says otherwise). `SWEEPS` says where each sweep is from and on what.

    OMP_NUM_THREADS=1 python benchmarks/validation/nccl_sweeps.py           # the calibration's fit
    OMP_NUM_THREADS=1 python benchmarks/validation/nccl_sweeps.py --errors  # the held-out error

`--errors` needs only `collective_time`, so it runs on an older checkout too (`PYTHONPATH=
OLD/src`): the error of the model before the size-dependent latency, on the same cells.
"""

from __future__ import annotations

import csv
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from stalepipe.lab.sim import cluster as sc
from stalepipe.lab.sim.cluster import CLUSTERS, Cluster, collective_time, ring_bytes_per_rank

DATA = Path(__file__).with_name("nccl_sweeps.csv")
# the sweep the latency curve is fitted on (a checkout older than the curve has no name for it)
CALIBRATION = getattr(sc, "COLLECTIVE_CALIBRATION", "vp-all-gather")
SIZES = tuple(2**i * 2**20 for i in range(9))  # 1 to 256 MiB: TP's activations, FSDP's layers

# AWS p5.48xlarge: 8 H100 SXM, NVLink 4, four 100 Gb/s EFA cards per GPU (crazyguitar/aws-gpu-
# communication-benchmark README: "four Elastic Fabric Adapter (EFA) interfaces per GPU";
# Perplexity's p5 write-up: "four 100 Gbps EFA cards" per GPU) = 400 Gb/s per GPU; EFA's own
# latency is not in the preset (h100-ib's 10 us a hop, an assumption)
P5 = replace(CLUSTERS["h100-ib"], name="aws-p5")
# Voltage Park: 8 H100 SXM per node on InfiniBand, "3.2 Tbps InfiniBand (400 Gbps per port, 3
# active ports per node)" (its nccl_multinode_summary.md): the two halves disagree; taken as
# 3.2 Tb/s a node = 400 Gb/s per GPU
VOLTAGE_PARK = replace(CLUSTERS["h100-ib"], name="voltage-park")
# Crusoe: 8 A100-80GB SXM, 8 InfiniBand HCAs a node (the dstack example's NCCL_IB_HCA); the
# HCAs' speed is not stated: taken as HDR 200 Gb/s, as NVIDIA's "DGX-A100 ... 8x200Gbit/s IB
# cards ... 192GB/s AllReduce BusBW" (NVIDIA/nccl issue 1576) for the same node
CRUSOE = replace(CLUSTERS["a100-ib"], name="crusoe-a100")
AZURE_A100 = replace(CLUSTERS["a100-ib"], name="azure-nd-a100-v4")

_VP = "ZiyanIshani/vpbenchmarking results/nccl/nccl_multinode/nccl_{}_20260224_225706.txt (b841c5b)"
_P5 = "crazyguitar/aws-gpu-communication-benchmark data/nccl_{}.csv (fd167f9), nodes = {}"


@dataclass(frozen=True)
class Sweep:
    """Where a sweep is from (repository, path, commit, or an issue), the cluster it ran on
    (a preset with what the source says), the collective, and the group."""

    source: str
    cluster: Cluster
    kind: str
    nodes: int
    per_node: int = 8
    note: str = "out-of-place"


SWEEPS = {
    "vp-all-gather": Sweep(_VP.format("allgather"), VOLTAGE_PARK, "all-gather", 4,
                           note="out-of-place; NCCL 2.24.3, 512 B to 8 GiB"),
    "vp-all-reduce": Sweep(_VP.format("allreduce"), VOLTAGE_PARK, "all-reduce", 4,
                           note="out-of-place; NCCL 2.24.3, 8 B to 8 GiB"),
    **{
        f"p5-{kind}-{nodes}": Sweep(_P5.format(kind.replace("-", "_"), nodes), P5, kind, nodes,
                                    note="out-of-place busbw, 32 MiB up (the run's -b 32M)")
        for kind in ("all-gather", "all-reduce") for nodes in (2, 4, 8, 16, 32)
    },
    "crusoe-all-reduce": Sweep(
        "dstackai/dstack examples/clusters/crusoe/README.md (33be4e7)", CRUSOE, "all-reduce", 2,
        note="out-of-place; 8 B to 2 GiB"),
    "azure-a100-all-reduce": Sweep(
        "Azure/AI-benchmarking-guide Azure_Results/ND_A100_v4_results.md (3bb66ca), table 6",
        AZURE_A100, "all-reduce", 1,
        note="in-place busbw as the source gives it, sizes labelled 1K to 8G (powers of 2)"),
    "nccl1047-reduce-scatter": Sweep(
        "NVIDIA/nccl issue 1047 (\"Reducescatter (H100: ring)\", one node)", CLUSTERS["h100-ib"],
        "reduce-scatter", 1, note="out-of-place, NCCL_ALGO=Ring; 128 MiB to 8 GiB"),
}  # fmt: skip


@dataclass(frozen=True)
class Point:
    sweep: str
    nbytes: int
    time_us: float | None  # None where the source prints no time
    busbw: float  # GB/s, as printed


def load() -> dict[str, list[Point]]:
    """The published points of each sweep, in the CSV's order (sizes ascending)."""
    out: dict[str, list[Point]] = {name: [] for name in SWEEPS}
    with DATA.open(newline="") as f:
        for row in csv.DictReader(f):
            t = row["time_us"]
            out[row["sweep"]].append(
                Point(row["sweep"], int(row["size_bytes"]), float(t) if t else None,
                      float(row["busbw_gbs"]))
            )  # fmt: skip
    return out


def seconds(p: Point) -> float:
    """A point's time: as printed, or from its bus bandwidth where only that is printed."""
    if p.time_us is not None:
        return p.time_us * 1e-6
    s = SWEEPS[p.sweep]
    return ring_bytes_per_rank(s.kind, p.nbytes, s.nodes * s.per_node) / (p.busbw * 1e9)


def busbw_at(points: list[Point], nbytes: float) -> tuple[float, bool] | None:
    """(published bus bandwidth at `nbytes`, whether interpolated): the point itself, or
    interpolated in log size and log bandwidth between the two published points around it;
    None outside the sweep's sizes (no extrapolation)."""
    for p in points:
        if p.nbytes == nbytes:
            return p.busbw, False
    below = [p for p in points if p.nbytes < nbytes]
    above = [p for p in points if p.nbytes > nbytes]
    if not below or not above:
        return None
    a, b = below[-1], above[0]
    w = math.log(nbytes / a.nbytes) / math.log(b.nbytes / a.nbytes)
    return math.exp((1 - w) * math.log(a.busbw) + w * math.log(b.busbw)), True


def measured(name: str, points: list[Point]) -> list[Any]:
    """A sweep's points as `sim.calibration.Measured` (what `fit_collectives` reads)."""
    from stalepipe.lab.sim.calibration import Measured

    s = SWEEPS[name]
    return [Measured(s.cluster, s.kind, s.nodes, s.per_node, p.nbytes, seconds(p)) for p in points]


def calibration() -> tuple[float, float, float]:
    """`fit_collectives` on `CALIBRATION`'s sweep alone."""
    from stalepipe.lab.sim.calibration import fit_collectives

    return fit_collectives(measured(CALIBRATION, load()[CALIBRATION]))


def model_busbw(name: str, nbytes: float) -> float:
    """`collective_time` of sweep `name`'s collective at `nbytes`, as busbw (GB/s)."""
    s = SWEEPS[name]
    n = s.nodes * s.per_node
    t = collective_time(s.cluster, s.kind, nbytes, n, s.per_node)
    return ring_bytes_per_rank(s.kind, nbytes, n) / t / 1e9


def cells() -> list[tuple[str, int, float, float, bool]]:
    """(sweep, size, published busbw, model busbw, interpolated) at each of `SIZES` inside a
    sweep's published sizes."""
    out = []
    for name, points in load().items():
        for size in SIZES:
            got = busbw_at(points, size)
            if got is not None:
                out.append((name, size, got[0], model_busbw(name, size), got[1]))
    return out


def held_out_errors(table: list[tuple[str, int, float, float, bool]]) -> list[float]:
    """|model / published - 1| of the held-out sweeps' cells (the calibration sweep's left out)."""
    return [abs(m / p - 1) for name, _, p, m, _ in table if name != CALIBRATION]


def calibration_errors() -> list[float]:
    """|model / published - 1| of the calibration sweep's bus bandwidth at every size it prints
    (the sweep prints its times; busbw is bytes / time)."""
    s = SWEEPS[CALIBRATION]
    n = s.nodes * s.per_node
    return [abs(seconds(p) / collective_time(s.cluster, s.kind, p.nbytes, n, s.per_node) - 1)
            for p in load()[CALIBRATION]]  # fmt: skip


def summary(errors: list[float]) -> tuple[float, float]:
    """(median, worst) of `errors`."""
    e = sorted(errors)
    n = len(e)
    return (e[n // 2] if n % 2 else (e[n // 2 - 1] + e[n // 2]) / 2), e[-1]


if __name__ == "__main__":
    if "--errors" in sys.argv[1:]:
        held = held_out_errors(cells())
        (med, worst), (cmed, cworst) = summary(held), summary(calibration_errors())
        print(f"held out: {len(held)} cells at 1-256 MiB, median |error| {med:.1%}, worst "
              f"{worst:.1%}; {CALIBRATION} at every size: median {cmed:.1%}, "
              f"worst {cworst:.1%}")  # fmt: skip
    else:
        small, large, half = calibration()
        print(f"{CALIBRATION}: HOP_SMALL {small:.3f}, HOP_LARGE {large:.3f}, "
              f"CHUNK_HALF {half:.3g} bytes")  # fmt: skip
