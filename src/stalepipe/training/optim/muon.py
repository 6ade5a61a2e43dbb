"""Muon (Jordan et al. 2024, kellerjordan.github.io/posts/muon) with an AdamW part, one object.

Hidden matrices: momentum -> Nesterov look-ahead -> orthogonalise with 5 quintic Newton-Schulz
steps -> shape-aware LR -> decoupled weight decay. Everything else (embeddings, head, norms) runs
AdamW inside the same optimizer, so one `state_dict` holds all of it.

Shape-aware LR scaling (`scale`), for a matrix with `rows x cols` (after flattening ndim > 2 to
`(shape[0], -1)`):
- `original` (Jordan's reference): `lr * max(1, rows / cols) ** 0.5`; the matrix LR is its own
  hyperparameter (~0.02) and the AdamW part has a separate `adam_lr`.
- `match_rms` (Moonshot, Liu et al. 2025, arXiv 2502.16982): `lr * 0.2 * max(rows, cols) ** 0.5`,
  which gives the update the RMS of a typical AdamW update, so Muon can reuse AdamW's LR and
  weight decay for every parameter.

Why not `torch.optim.Muon` (torch 2.13): it accepts matrices only (the AdamW part would have to be
a second optimizer object with its own state_dict, breaking "one optimizer per stage"), it always
runs Newton-Schulz in bfloat16 (slow on CPU and too coarse for bitwise emulator/runtime checks in
fp32), and its math is not exposed as a pure function to test. The update below is the same
algorithm (same coefficients, EMA momentum, Nesterov, LR adjustment, decay with the unscaled LR).
"""

from __future__ import annotations

import math

import torch

from stalepipe.training.optim.adamw import CompositeOptimizer
from stalepipe.training.optim.base import group_hyper, zero_state

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic coefficients of Jordan's reference
NS_EPS = 1e-7


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximate the orthogonal factor U V^T of `g = U S V^T` (a 2-D tensor) with `steps`
    quintic Newton-Schulz iterations; returns a new tensor of `g`'s dtype.

    The iteration runs on the wide orientation (rows <= cols) so `X X^T` is the small Gram
    matrix. `dtype` is the compute dtype (default: bfloat16 on CUDA as in the reference, the
    input's dtype, at least float32, elsewhere).
    """
    assert g.ndim == 2, g.shape
    if dtype is None:
        dtype = torch.bfloat16 if g.is_cuda else torch.promote_types(g.dtype, torch.float32)
    a, b, c = NS_COEFFS
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.mT
    x = x / (x.norm() + NS_EPS)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x  # X <- aX + b(XX^T)X + c(XX^T)^2 X
    if tall:
        x = x.mT
    return x.to(g.dtype)


def lr_scale(rows: int, cols: int, scale: str) -> float:
    """Multiplier of the matrix LR for a `rows x cols` matrix (see the module docstring)."""
    if scale == "original":
        return math.sqrt(max(1.0, rows / cols))
    assert scale == "match_rms", scale
    return 0.2 * math.sqrt(max(rows, cols))


@torch.no_grad()
def muon_update(
    p: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    scale: str,
) -> None:
    """One Muon step on the matrix `p`, in place on `p` and `momentum_buffer`; `grad` is read only."""
    momentum_buffer.lerp_(grad, 1.0 - momentum)  # B_t = mu B + (1 - mu) g
    update = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer  # look-ahead
    mat = update.reshape(update.size(0), -1)
    ortho = newton_schulz(mat, ns_steps)  # O_t = NS5(update)
    p.mul_(1.0 - lr * weight_decay)  # decoupled decay with the unscaled LR (Moonshot, torch)
    p.add_(ortho.view_as(p), alpha=-lr * lr_scale(mat.size(0), mat.size(1), scale))


class Muon(CompositeOptimizer):
    """Muon for groups with `algo='muon'`, AdamW for groups with `algo='adamw'`.

    Muon groups need `lr, weight_decay, momentum, nesterov, ns_steps, scale`; AdamW groups need
    `lr, betas, eps, weight_decay`. Build it with `stalepipe.training.optim.build_optimizer`; use it
    directly only for custom groupings. Never modifies `p.grad`.
    """

    algo = "muon"

    def _algo_update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        assert p.ndim >= 2, "Muon groups hold matrices only"
        zero_state(state, p, "momentum_buffer")
        muon_update(
            p,
            p.grad,
            state["momentum_buffer"],
            **group_hyper(group, "momentum", "nesterov", "ns_steps", "scale"),
        )
