"""Learning-rate schedules as pure multipliers of each parameter group's peak LR.

Every param group stores its peak LR under `"peak_lr"`; `apply_lr` sets `lr = peak_lr * mult`,
so composite optimizers (Muon's matrix and AdamW groups, say) follow one schedule together.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from stalepipe.config import TrainConfig


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak LR at `step` (0-based) for `cfg.lr_schedule`:

    - cosine: linear warmup to 1, then cosine decay to `min_lr_ratio` at the last step;
    - wsd (warmup-stable-decay, Hu et al. 2024): warmup, constant 1, then a linear decay to
      `min_lr_ratio` over the last `decay_frac` of the steps;
    - constant: warmup, then 1.
    """
    total, warmup, floor = cfg.num_steps, cfg.warmup_steps, cfg.min_lr_ratio
    if step < warmup:
        return (step + 1) / warmup
    if cfg.lr_schedule == "constant":
        return 1.0
    if cfg.lr_schedule == "cosine":
        span = max(total - 1 - warmup, 1)
        progress = min((step - warmup) / span, 1.0)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    assert cfg.lr_schedule == "wsd", cfg.lr_schedule
    decay_start = total - wsd_decay_steps(cfg)
    if step < decay_start:
        return 1.0
    progress = (step - decay_start + 1) / max(total - decay_start, 1)
    return 1.0 - (1.0 - floor) * progress


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
