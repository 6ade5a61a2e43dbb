"""torch.distributed.pipelining's schedules on the benchmark's model: the contenders of
pipeline_throughput.py (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and
ScheduleZBVZeroBubble; the interleaved and ZB-V ones over 2 model chunks per process)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.speed.pipeline_setup import P, random_batch, setup_stage
from stalepipe.config import ModelConfig, OptimConfig
from stalepipe.training.models import build_model, partition
from stalepipe.training.optim import build_optimizer, resolve_config
from stalepipe.training.optim.lr_schedule import set_peak_lr
from stalepipe.training.peers.group import init_from_env


class _TorchStage(torch.nn.Module):
    """Our stage as torch.pipelining wants it: the last stage returns logits."""

    def __init__(self, stage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x):
        return self.stage(x)


CHUNKED = ("interleaved", "zbv")  # torch schedules with 2 model chunks per process


def _torch_stages(model_cfg: ModelConfig, schedule: str):
    """This process's torch.pipelining stages: one of P, or two of 2P (interleaved: s and
    s + P; ZB-V: s and 2P-1-s); the stage indices and an AdamW over their parameters."""
    from torch.distributed.pipelining import PipelineStage

    if schedule not in CHUNKED:
        rank, stage, _, opt = setup_stage(model_cfg)
        return [PipelineStage(_TorchStage(stage), rank, P, torch.device("cpu"))], [rank], opt
    rank = init_from_env("gloo", 120).rank
    torch.set_num_threads(1)
    parts = partition(build_model(model_cfg, seed=0), 2 * P)
    ids = [rank, 2 * P - 1 - rank] if schedule == "zbv" else [rank, rank + P]
    stages = [PipelineStage(_TorchStage(parts[i]), i, 2 * P, torch.device("cpu")) for i in ids]
    owned = [(n, p) for i in ids for n, p in parts[i].owned_parameters().items()]
    opt = build_optimizer(resolve_config(OptimConfig(name="adamw")), owned)
    set_peak_lr(opt)
    return stages, ids, opt


def theirs(model_cfg: ModelConfig, schedule: str, m: int, mb: int, T: int, steps: int, warm: int):
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    stages, ids, opt = _torch_stages(model_cfg, schedule)
    V = model_cfg.vocab_size

    def loss_fn(logits, y):
        return F.cross_entropy(logits.float().view(-1, V), y.view(-1))

    if schedule in CHUNKED:
        cls = {"interleaved": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble}[schedule]
        sched = cls(stages, n_microbatches=m, loss_fn=loss_fn)
    else:
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        sched = cls(stages[0], n_microbatches=m, loss_fn=loss_fn)
    first, last = 0 in ids, max(ids) == len(ids) * P - 1
    t0 = 0.0
    for k in range(steps):
        if k == warm:
            dist.barrier()
            t0 = time.perf_counter()
        x, y = random_batch(k, m, mb, T, V)
        targets = {"target": y, "losses": []} if last else {}
        if first:
            sched.step(x, **targets)
        else:
            sched.step(**targets)
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    return {"wall": time.perf_counter() - t0, "tokens": (steps - warm) * m * mb * T}
