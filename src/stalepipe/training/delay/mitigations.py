"""Delay mitigations as pure tensor math (docs/design.md, 'Mitigations'); the classes only own
the buffers.

- error feedback (EF), update level:       W_{k+1} = W_k - 2 U_k + U_{k-1},  U_{-1} = 0
- Taylor / DC-ASGD compensation:           g <- g + lambda * g * g * (W_k - W_stale)
- adaptive Taylor (DC-ASGD-a):             lambda = lambda_0 / (sqrt(EMA(g^2)) + eps)
- DC-ASGD-EMA (curvature "ema"):           g * g above replaced by V = EMA(g^2)
- synchronous start / cooldown windows:    tau = 0 inside (see `policies.in_sync_window`)

Weight prediction, the PipeMare LR schedule and adaptive momentum are in `correctors`.

All functions work in place on the tensors they are given and return what the caller keeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from stalepipe.config import ConfigError, DelayConfig, TrainConfig
from stalepipe.config.registry import LR_SCHEDULES, with_decay_phase


@torch.no_grad()
def error_feedback_(param: torch.Tensor, w_k: torch.Tensor, u_prev: torch.Tensor) -> torch.Tensor:
    """Turn the base optimizer's result into the EF update, in place; return the raw U_k.

    On entry `param` holds W_k - U_k (what `opt.step()` made of W_k = `w_k`); on exit it holds
    W_k - 2 U_k + U_{k-1} (paper: x_{t+1} = x_t - 2 u_{t-1}(g_{t-1}) + u_{t-2}(g_{t-2})).
    The raw U_k, not the corrected change, is what the next step subtracts.
    """
    u_k = w_k - param
    param.copy_(w_k).sub_(u_k, alpha=2).add_(u_prev)
    return u_k


@torch.no_grad()
def taylor_compensate_(
    grad: torch.Tensor,
    w_new: torch.Tensor,
    w_stale: torch.Tensor,
    lam: float,
    curvature: torch.Tensor | None = None,
) -> None:
    """DC-ASGD (Zheng et al., 2017, eq. 9), in place: g <- g + lambda * g * g * (W_k - W_stale).

    `curvature` replaces g * g: DC-ASGD-EMA (marin's `dc_asgd_ema`) passes V = EMA_beta(g * g),
    g <- g + lambda * V * (W_k - W_stale)."""
    if curvature is None:
        grad.add_(grad * grad * (w_new - w_stale), alpha=lam)
    else:
        grad.add_(curvature * (w_new - w_stale), alpha=lam)


@torch.no_grad()
def taylor_ema_update_(mean_square: torch.Tensor, grad: torch.Tensor, ema: float) -> None:
    """DC-ASGD-a's MeanSquare(t) = m * MeanSquare(t-1) + (1 - m) * g_t^2, in place."""
    mean_square.mul_(ema).add_((1.0 - ema) * (grad * grad))


@torch.no_grad()
def taylor_compensate_adaptive_(
    grad: torch.Tensor,
    w_new: torch.Tensor,
    w_stale: torch.Tensor,
    lam0: float,
    mean_square: torch.Tensor,
    eps: float,
    curvature: torch.Tensor | None = None,
) -> None:
    """DC-ASGD-a (Zheng et al., 2017, sec. 5), in place: lambda = lambda_0 / (sqrt(MS) + eps)
    elementwise, then the constant-lambda rule (`curvature` as in `taylor_compensate_`)."""
    scale = lam0 / mean_square.sqrt().add_(eps)
    if curvature is None:
        grad.add_(scale * grad * grad * (w_new - w_stale))
    else:
        grad.add_(scale * curvature * (w_new - w_stale))


@torch.no_grad()
def taylor_correct_stages_(
    params: Sequence[Sequence[torch.Tensor]],
    stale: Sequence[Sequence[torch.Tensor] | None],
    mean_squares: Sequence[Sequence[torch.Tensor]] | None,
    cfg: DelayConfig,
) -> None:
    """Taylor / DC-ASGD over every stage, in place: each `params[s][i].grad` moved from the
    point `stale[s][i]` it was taken at to the live weights (None: stage s read its live
    weights); `mean_squares[s][i]`, the EMA of g^2 (adaptive lambda, DC-ASGD-EMA), is updated
    first with every gradient, fresh or stale."""
    ema = cfg.taylor_curvature == "ema"
    for s, stage in enumerate(params):
        for i, p in enumerate(stage):
            if p.grad is None:
                continue
            ms = None
            if mean_squares is not None:
                ms = mean_squares[s][i]
                taylor_ema_update_(ms, p.grad, cfg.taylor_ema)
            point = stale[s]
            if point is None:
                continue
            curvature = ms if ema else None
            if cfg.taylor_adaptive:
                assert ms is not None
                taylor_compensate_adaptive_(
                    p.grad, p.detach(), point[i], cfg.taylor, ms, cfg.taylor_eps, curvature
                )
            else:
                taylor_compensate_(p.grad, p.detach(), point[i], cfg.taylor, curvature)


def resolve_delay_config(delay: DelayConfig, train: TrainConfig) -> DelayConfig:
    """`delay` with the synchronous cooldown as a step count the engine can use directly.

    With `sync_cooldown_wsd` the cooldown is exactly the LR schedule's decay phase
    (`LRScheduleSpec.decay_steps`: WSD's, `optim.lr_schedule.wsd_decay_steps`); the schedule
    must then have one.
    """
    if not delay.sync_cooldown_wsd:
        return delay
    decay_steps = LR_SCHEDULES[train.lr_schedule].decay_steps
    if decay_steps is None:
        raise ConfigError(
            f"delay.sync_cooldown_wsd aligns the cooldown with WSD's decay phase, but "
            f"train.lr_schedule is {train.lr_schedule!r}; use --train.lr_schedule "
            f"{' or '.join(with_decay_phase())} or set --delay.sync_cooldown to a step count or "
            f"fraction"
        )
    return dataclasses.replace(
        delay, sync_cooldown=float(decay_steps(train)), sync_cooldown_wsd=False
    )
