"""Accelerator speeds for the analytic cost model of the timing simulator.

Peak numbers are vendor datasheet figures (dense bf16, no sparsity); the simulator scales FLOP/s
by a model FLOPs utilisation (MFU, default 0.4) because no real kernel reaches the peak.
Link bandwidths are per GPU and per direction: pipeline p2p sends one way at a time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from stalepipe.config import unknown_choice


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator and its links. Bandwidths in bytes/s, latency in seconds."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bandwidth: float  # memory bandwidth (the optimizer update is memory bound)
    intra_node_bandwidth: float  # to a neighbour in the same node, one direction
    inter_node_bandwidth: float  # to a neighbour in another node, one direction
    p2p_latency: float = 10e-6  # one GPU-to-GPU message (NVLink / InfiniBand class)
    gpus_per_node: int = 8
    memory_bytes: float = 0.0  # device memory (HBM), decimal bytes as datasheets give it


# NVIDIA H100 SXM5 datasheet: 989 TFLOPS bf16 dense (1979 with sparsity), 80 GB HBM3 at
# 3.35 TB/s, NVLink 4 900 GB/s bidirectional (450 GB/s one way); one ConnectX-7 NDR 400 Gb/s
# (50 GB/s) per GPU between nodes (DGX H100).
_H100 = Device(
    name="NVIDIA H100 SXM",
    peak_flops=989e12,
    hbm_bandwidth=3.35e12,
    intra_node_bandwidth=450e9,
    inter_node_bandwidth=50e9,
    memory_bytes=80e9,
)

DEVICES: dict[str, Device] = {
    "h100": _H100,
    # NVIDIA H200 SXM datasheet: the H100's Hopper compute (989 TFLOPS bf16 dense) and links
    # (NVLink 900 GB/s bidirectional; NDR 400 Gb/s per GPU in a DGX H200), 141 GB HBM3e at
    # 4.8 TB/s.
    "h200": dataclasses.replace(
        _H100, name="NVIDIA H200 SXM", hbm_bandwidth=4.8e12, memory_bytes=141e9
    ),
    # NVIDIA A100 SXM4 80GB datasheet: 312 TFLOPS bf16 dense, 80 GB HBM2e 2.039 TB/s, NVLink 3
    # 600 GB/s bidirectional (300 GB/s one way); HDR 200 Gb/s (25 GB/s) per GPU (DGX A100).
    "a100": Device(
        name="NVIDIA A100 SXM 80GB",
        peak_flops=312e12,
        hbm_bandwidth=2.039e12,
        intra_node_bandwidth=300e9,
        inter_node_bandwidth=25e9,
        memory_bytes=80e9,
    ),
    # An order-of-magnitude CPU "device" (one socket of a recent server: ~2 TFLOP/s bf16 with
    # AMX/AVX-512, ~300 GB/s DDR5, 256 GB of it); stages as processes on one host talk through
    # shared memory (~10 GB/s via gloo), hosts over 100 GbE (12.5 GB/s). For sanity checks only.
    "cpu": Device(
        name="CPU socket (rough)",
        peak_flops=2e12,
        hbm_bandwidth=300e9,
        intra_node_bandwidth=10e9,
        inter_node_bandwidth=12.5e9,
        p2p_latency=50e-6,
        gpus_per_node=1,
        memory_bytes=256e9,
    ),
}


def get_device(name: str) -> Device:
    """The device `name`; an unknown name raises ConfigError suggesting the closest one."""
    if name not in DEVICES:
        raise unknown_choice("device", name, DEVICES)
    return DEVICES[name]


# ---- peak FLOP/s of the GPU a run is on (the MFU denominator) ------------------------------
# Keyed by the exact name `torch.cuda.get_device_name()` reports: a substring match gave the
# PCIe and NVL parts the SXM figure. Dense bf16 tensor-core FLOP/s from each vendor datasheet
# (half the "with sparsity" figure). A name not listed gets no MFU, never a wrong one.
PEAK_BF16_FLOPS: dict[str, float] = {
    "NVIDIA H100 80GB HBM3": 989.4e12,  # H100 SXM5
    "NVIDIA H100 PCIe": 756.5e12,
    "NVIDIA H100 NVL": 835.5e12,
    "NVIDIA H200": 989.4e12,  # H200 SXM
    "NVIDIA H200 NVL": 835.5e12,
    "NVIDIA GH200 480GB": 989.4e12,
    "NVIDIA B200": 2250e12,  # HGX B200
    "NVIDIA L40S": 362.05e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
}


def peak_bf16_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of one GPU named exactly `device_name` (as
    `torch.cuda.get_device_name()` spells it; surrounding spaces ignored), None when unlisted."""
    return PEAK_BF16_FLOPS.get(device_name.strip())
