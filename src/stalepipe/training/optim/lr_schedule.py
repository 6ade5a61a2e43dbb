"""Learning-rate schedules as pure multipliers of each parameter group's peak LR.

Every param group stores its peak LR under `"peak_lr"`; `apply_lr` sets `lr = peak_lr * mult`,
so composite optimizers (Muon's matrix and AdamW groups, say) follow one schedule together.

The schedules are `LR_SCHEDULES` (config/registry.py), registered at the end of this module:
each one a pure function of (step, `TrainConfig`) for the steps after the linear warmup. This
module is torch-free (the package root imports it to register them; torch only types hints).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from stalepipe.config import TrainConfig
from stalepipe.config.registry import LR_SCHEDULES, LRScheduleSpec

if TYPE_CHECKING:
    import torch


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak LR at `step` (0-based): a linear warmup to 1 over
    `cfg.warmup_steps`, then the registered schedule `cfg.lr_schedule` (`LR_SCHEDULES`)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    return LR_SCHEDULES[cfg.lr_schedule].multiplier(step, cfg)


def cosine(step: int, cfg: TrainConfig) -> float:
    """Cosine decay from 1 after the warmup to `min_lr_ratio` at the last step (SGDR,
    Loshchilov & Hutter 2017, without restarts)."""
    floor = cfg.min_lr_ratio
    span = max(cfg.num_steps - 1 - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def wsd(step: int, cfg: TrainConfig) -> float:
    """Warmup-stable-decay (Hu et al. 2024, MiniCPM): 1, then a linear decay to
    `min_lr_ratio` over the last `decay_frac` of the steps (`wsd_decay_steps`)."""
    total, floor = cfg.num_steps, cfg.min_lr_ratio
    decay_start = total - wsd_decay_steps(cfg)
    if step < decay_start:
        return 1.0
    progress = (step - decay_start + 1) / max(total - decay_start, 1)
    return 1.0 - (1.0 - floor) * progress


def constant(step: int, cfg: TrainConfig) -> float:
    """1 after the warmup."""
    return 1.0


def wsd_decay_steps(cfg: TrainConfig) -> int:
    """Length of WSD's decay phase in steps (what a synchronous cooldown aligns with)."""
    return int(round(cfg.decay_frac * cfg.num_steps))


def set_peak_lr(optimizer: torch.optim.Optimizer) -> None:
    """Record each group's current LR as its peak (call once, right after construction)."""
    for group in optimizer.param_groups:
        group.setdefault("peak_lr", group["lr"])


def apply_lr(optimizer: torch.optim.Optimizer, mult: float) -> None:
    """Set every group's LR to `peak_lr * mult`."""
    for group in optimizer.param_groups:
        group["lr"] = group["peak_lr"] * mult


@contextlib.contextmanager
def config_peak_lr(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Keep the groups' current peak LR (the config's) across loading an optimizer state,
    which would restore the saved ones: a run resumed with a new `--optim.lr` uses it."""
    peaks = [group["peak_lr"] for group in optimizer.param_groups]
    yield
    for group, peak in zip(optimizer.param_groups, peaks, strict=True):
        group["peak_lr"] = peak


# The LR schedules by name, in the order --help lists them.
LR_SCHEDULES.register(LRScheduleSpec(name="cosine", multiplier=cosine))
LR_SCHEDULES.register(LRScheduleSpec(name="wsd", multiplier=wsd, decay_steps=wsd_decay_steps))
LR_SCHEDULES.register(LRScheduleSpec(name="constant", multiplier=constant))
