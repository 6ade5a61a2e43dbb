"""Delay correctors beyond the paper (docs/design.md, 'Correctors beyond the paper'), as pure math
plus the per-stage groups they need. With `v = k - tau_s(k)` the version stage s reads at step k:

- weight prediction (SpecTrain, Chen et al. 2018; PipeMare, Yang et al. 2021):
      the gradient is taken at  W_hat = W_v + c * tau_s(k) * (W_v - W_{v-1}),  W_{-1} = W_0
- PipeMare LR schedule (Yang et al. 2021, sec. 3.1; AsyncPP's `--lr_correction`):
      lr_s(k) = lr(k) * tau_s(k)^-(1 - min(k/K, 1))  for tau_s >= 1, lr(k) for tau_s = 0
- adaptive momentum (Ajanthan et al., ICML 2025; AsyncPP's `--adaptive_momentum`):
      mu_s(k) = mu + tau_s(k) * (0.99 - mu) / P
- DC-ASGD-EMA lives with Taylor compensation in `mitigations` (its curvature argument).

The per-stage hyperparameters are set on each stage's param groups for the duration of one
`optimizer.step()` and restored after it, so the groups (and checkpoints) always hold the
config's values; a pure function of (step, tau) gives the corrected ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from stalepipe.config import ConfigError, DelayConfig
from stalepipe.training.delay.policies import DelaySchedule

MOMENTUM_CAP = 0.99  # Ajanthan et al.'s target momentum for the stalest stage


@torch.no_grad()
def predict_weights(
    w_v: Sequence[torch.Tensor], w_prev: Sequence[torch.Tensor], scale: float
) -> list[torch.Tensor]:
    """SpecTrain / PipeMare weight prediction: W_v + scale * (W_v - W_{v-1}) per tensor, with
    scale = c * tau (the last applied change extrapolated over the delay). New tensors."""
    return [torch.add(a, a - b, alpha=scale) for a, b in zip(w_v, w_prev, strict=True)]


def pipemare_lr_factor(tau: int, step: int, anneal_steps: int) -> float:
    """PipeMare's staleness LR factor tau^-(1 - min(k/K, 1)) (Yang et al. 2021, sec. 3.1):
    1/tau at step 0, annealed to 1 at step K; 1 for tau = 0 and for tau = 1."""
    if tau == 0 or anneal_steps == 0:
        return 1.0
    return float(tau) ** -(1.0 - min(step / anneal_steps, 1.0))


def adaptive_momentum(mu: float, tau: int, num_stages: int) -> float:
    """Ajanthan et al. (ICML 2025): mu_s = mu + tau_s * (0.99 - mu) / P."""
    return mu + tau * (MOMENTUM_CAP - mu) / num_stages


def momentum_key(group: dict) -> str:
    """The field of a param group that adaptive momentum sets: `momentum` (Muon's matrix
    groups, torch SGD) or the first of `betas` (AdamW, NAdamW, SOAP, Adan, Lion, MARS and the
    AdamW part of Muon / MARS: optim.beta1). Refuses a group with no momentum."""
    if group.get("momentum"):
        return "momentum"
    if "betas" in group:
        return "betas"
    raise ConfigError(
        "delay.adaptive_momentum needs an optimizer with momentum (a momentum or betas[0] "
        "field > 0); set delay.adaptive_momentum false"
    )


def prepare_groups(
    optimizer: torch.optim.Optimizer,
    params: Sequence[Sequence[torch.Tensor]],
    cfg: DelayConfig,
    delay: DelaySchedule,
) -> list[int | None] | None:
    """The stage of each param group when `cfg` sets per-stage hyperparameters (the PipeMare
    LR schedule, adaptive momentum), after splitting groups per stage (`group_stages`); None
    otherwise. Refuses adaptive momentum where it cannot work or would do nothing."""
    if not (cfg.lr_correction_steps > 0 or cfg.adaptive_momentum):
        return None
    if cfg.adaptive_momentum:
        P = delay.num_stages
        if max(delay.max_tau) > P:
            raise ConfigError(
                f"delay.adaptive_momentum needs tau_s <= {P} stages (mu_s would pass 0.99); "
                f"use a policy with at most {P} steps of delay"
            )
        check_momentum(optimizer)
    return group_stages(optimizer, params, split=True)


def check_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Refuse adaptive momentum for an optimizer without momentum (`momentum_key`), or whose
    every group is at mu = 0.99 already, where mu_s = mu for every stage (it would do nothing:
    NAdamW's default beta1)."""
    mus = []
    for g in optimizer.param_groups:
        key = momentum_key(g)
        mus.append(g[key] if key == "momentum" else g[key][0])
    if all(mu == MOMENTUM_CAP for mu in mus):
        raise ConfigError(
            f"delay.adaptive_momentum does nothing at momentum {MOMENTUM_CAP} (mu_s = mu + "
            f"tau_s (0.99 - mu) / P = mu on every stage); set optim.beta1 below {MOMENTUM_CAP} "
            f"or delay.adaptive_momentum false"
        )


def group_stages(
    optimizer: torch.optim.Optimizer, params: Sequence[Sequence[torch.Tensor]], split: bool
) -> list[int | None]:
    """The stage of every param group of `optimizer` (None: the group spans stages).

    With `split`, groups that span stages are first replaced by one group per stage (same
    hyperparameters, the stage's parameters in order), so that per-stage LRs and momenta can
    be set; the pipeline runtime's optimizers hold one stage each and are never split."""
    stage_of = {id(p): s for s, ps in enumerate(params) for p in ps}
    groups = []
    for g in optimizer.param_groups:
        stages = sorted({stage_of[id(p)] for p in g["params"]})
        if not split or len(stages) <= 1:
            groups.append(g)
            continue
        for s in stages:
            keep = [i for i, p in enumerate(g["params"]) if stage_of[id(p)] == s]
            sub = {**g, "params": [g["params"][i] for i in keep]}
            if "param_names" in g:
                sub["param_names"] = [g["param_names"][i] for i in keep]
            groups.append(sub)
    if len(groups) != len(optimizer.param_groups):
        assert not optimizer.state, "split param groups before the first step"
        optimizer.param_groups[:] = groups
    out: list[int | None] = []
    for g in optimizer.param_groups:
        stages = {stage_of[id(p)] for p in g["params"]}
        out.append(stages.pop() if len(stages) == 1 else None)
    return out


@contextlib.contextmanager
def stage_hyperparameters(
    optimizer: torch.optim.Optimizer,
    stages: Sequence[int | None],
    lr_factors: Sequence[float] | None,
    momenta: Sequence[int] | None,
    num_stages: int,
) -> Iterator[None]:
    """Within the block, group g of stage s has lr * lr_factors[s] and, with `momenta`
    (tau per stage), its momentum field at `adaptive_momentum(mu, tau_s, P)`; restored after."""
    saved = []
    for g, s in zip(optimizer.param_groups, stages, strict=True):
        assert s is not None, "per-stage hyperparameters need per-stage groups"
        saved.append((g, {k: g[k] for k in ("lr", "betas", "momentum") if k in g}))
        if lr_factors is not None:
            g["lr"] = g["lr"] * lr_factors[s]
        if momenta is not None:
            key = momentum_key(g)
            if key == "momentum":
                g[key] = adaptive_momentum(g[key], momenta[s], num_stages)
            else:
                b = tuple(g[key])
                g[key] = (adaptive_momentum(b[0], momenta[s], num_stages), *b[1:])
    try:
        yield
    finally:
        for g, values in saved:
            g.update(values)
