"""The slow, obvious delayed-training reference (docs/design.md, 'Style', rule 6): every weight
version is kept, the stale point is assembled name by name from `DelaySchedule.version`, and the
gradient is taken with `torch.func.functional_call` on fresh leaves (weight prediction and
DC-ASGD-EMA included; the per-stage LR and momentum are tested on closed forms). Tests check
`DelayEmulator` and `DelayedOptimizer` against it; never use it for real training (memory grows with
the steps).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call

from stalepipe.config import DelayConfig
from stalepipe.training.delay.policies import DelaySchedule

Batch = Sequence[tuple[torch.Tensor, torch.Tensor]]


def stage_of_uses(stages: Sequence[nn.Module], model: nn.Module) -> dict[str, tuple[str, int]]:
    """Map every parameter *use* of `model` (names with duplicates, e.g. both `tok_emb.weight`
    and a tied `lm_head.weight`) to (owning parameter's name, stage that reads it)."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    stage_of_module = {}
    for s, stage in enumerate(stages):
        for module in stage.modules():
            stage_of_module.setdefault(id(module), s)
    uses = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None and id(module) in stage_of_module:
                name = f"{mod_name}.{attr}" if mod_name else attr
                uses[name] = (canonical[id(p)], stage_of_module[id(module)])
    return uses


def reference_train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: DelayConfig,
    uses: Mapping[str, tuple[str, int]],
    num_stages: int,
    total_steps: int,
    batches: Callable[[int], Batch],
    steps: int | None = None,
) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Run `steps` (default all) delayed steps from the model's current weights; return every
    weight version W_0..W_steps (name -> tensor) and the loss of each step."""
    names = dict(model.named_parameters())
    owner_stage = {}
    for use, (pname, stage) in uses.items():
        if use == pname:
            owner_stage[pname] = stage
    delay = DelaySchedule.build(cfg, num_stages, total_steps)

    def read(stage: int, k: int, pname: str) -> torch.Tensor:
        """What `stage` computes step k at: W_v, or weight prediction's point (docs/delay.md)."""
        tau, v = delay.tau(stage, k), delay.version(stage, k)
        w = versions[v][pname]
        if not cfg.weight_pred or tau == 0 or v == 0:
            return w
        return torch.add(w, w - versions[v - 1][pname], alpha=cfg.weight_pred_scale * tau)

    def snapshot() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in names.items()}

    versions = [snapshot()]
    losses = []
    u_prev = {n: torch.zeros_like(p) for n, p in names.items()}
    mean_sq = {n: torch.zeros_like(p) for n, p in names.items()}
    for k in range(total_steps if steps is None else steps):
        leaves = {
            use: read(stage, k, pname).clone().requires_grad_(True)
            for use, (pname, stage) in uses.items()
        }
        acc, loss = _accumulated_gradients(model, leaves, batches(k))
        losses.append(loss)

        with torch.no_grad():
            for p in names.values():
                p.grad = None
            for use, (pname, _) in uses.items():  # owner's use first: model order
                if use in acc:
                    p = names[pname]
                    p.grad = acc[use].clone() if p.grad is None else p.grad + acc[use]
            w_k = snapshot()
            for n, p in names.items():
                if p.grad is None:
                    continue
                g = p.grad
                stale = read(owner_stage[n], k, n)
                ema = cfg.taylor_curvature == "ema"
                if cfg.taylor > 0 and (cfg.taylor_adaptive or ema):
                    mean_sq[n] = cfg.taylor_ema * mean_sq[n] + (1.0 - cfg.taylor_ema) * (g * g)
                curv = mean_sq[n] if ema else g * g  # DC-ASGD-EMA: EMA(g^2) for g^2
                if cfg.taylor > 0 and cfg.taylor_adaptive:
                    lam = cfg.taylor / (mean_sq[n].sqrt() + cfg.taylor_eps)
                    p.grad = g + (lam * curv if ema else lam * g * g) * (w_k[n] - stale)
                elif cfg.taylor > 0:
                    p.grad = g + cfg.taylor * (curv * (w_k[n] - stale))
            optimizer.step()
            if cfg.ef:
                for n, p in names.items():
                    u = w_k[n] - p
                    p.copy_(w_k[n] - 2 * u + u_prev[n])
                    u_prev[n] = u
            optimizer.zero_grad(set_to_none=True)
        versions.append(snapshot())
    return versions, losses


def _accumulated_gradients(
    model: nn.Module, leaves: dict[str, torch.Tensor], mbs: Batch
) -> tuple[dict[str, torch.Tensor], float]:
    """Per use, the sum over the microbatches of d(loss / m) / d(leaf), in microbatch order;
    and the step's loss."""
    acc: dict[str, torch.Tensor] = {}
    total = torch.zeros(())
    for x, y in mbs:
        loss = functional_call(model, leaves, (x, y), tie_weights=False) / len(mbs)
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        for use, g in zip(leaves, grads, strict=True):
            if g is not None:
                acc[use] = g if use not in acc else acc[use] + g
        total = total + loss.detach().float()
    return acc, total.item()
