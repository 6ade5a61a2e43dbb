"""SOAP: Shampoo with Adam in the preconditioner's eigenbasis (Vyas et al., ICLR 2025,
arXiv 2409.11321), following the authors' reference code (github.com/nikhilvyas/SOAP).

For a matrix gradient G (rows x cols) the state holds Shampoo's factors L = EMA(G G^T),
R = EMA(G^T G) and their eigenbases Q_L, Q_R; Adam runs on the rotated gradient
G' = Q_L^T G Q_R:

    m   <- b1 m + (1 - b1) G                      (kept in the original space)
    v   <- b2 v + (1 - b2) G'^2                   (kept in the eigenbasis)
    p   <- p - lr sqrt(1 - b2^t)/(1 - b1^t) * Q_L [(Q_L^T m Q_R) / (sqrt(v) + eps)] Q_R^T
    p   <- p (1 - lr wd)                          (decoupled decay, after the step, as the reference)
    L, R <- lerp toward G G^T, G^T G with weight 1 - shampoo_beta
    every `precond_freq` updates: one power iteration + QR refreshes Q_L, Q_R; the eigenvalue
    estimates diag(Q^T L Q) re-sort the basis and v is permuted with it.

Like the reference: the first call only initialises L, R (from that gradient) and Q_L, Q_R
(by `eigh`) and does not move the parameter (so the projection never uses the gradient it was
computed from); a side longer than `max_precond_dim` gets no rotation (identity), and 1-D
parameters are not preconditioned at all (plain Adam, also with the skipped first call). Tensors
with ndim > 2 are treated as `(shape[0], -1)` matrices. State and math are in at least float32
(bfloat16 parameters keep float32 moments and bases), and on CUDA its matmuls run in full fp32
even when the run allows TF32 (`train.tf32`): TF32's 10-bit mantissa in G G^T, the power
iteration and the projections would perturb the eigenbases the method rests on. `eigh` falls
back to float64 when it fails in float32 (as the reference does: cuSOLVER can fail to converge
on ill-conditioned factors). Storing m in the original space (rather
than rotating it at every basis change, as the first reference version did) is the same algorithm.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from stalepipe.training.optim.base import ParamwiseOptimizer, group_hyper

SIDES = ("left", "right")


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.size(0), -1) if t.ndim >= 2 else t


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    """State and math in at least float32 (`eigh`/`qr` have no bfloat16 kernels)."""
    return torch.promote_types(t.dtype, torch.float32)


def project(x: torch.Tensor, q_left: torch.Tensor | None, q_right: torch.Tensor | None):
    """Q_L^T x Q_R for a matrix `x` (a missing side is the identity)."""
    if q_left is not None:
        x = q_left.mT @ x
    if q_right is not None:
        x = x @ q_right
    return x


def project_back(x: torch.Tensor, q_left: torch.Tensor | None, q_right: torch.Tensor | None):
    """Q_L x Q_R^T: the inverse of `project`."""
    if q_left is not None:
        x = q_left @ x
    if q_right is not None:
        x = x @ q_right.mT
    return x


def _outer(g: torch.Tensor, side: str) -> torch.Tensor:
    return g @ g.mT if side == "left" else g.mT @ g


def soap_init_state(
    grad: torch.Tensor, *, shampoo_beta: float, max_precond_dim: int
) -> dict[str, torch.Tensor | int]:
    """State after SOAP's first call: zero moments, factors from `grad`, eigenbases by `eigh`."""
    grad = grad.to(_work_dtype(grad))
    state: dict[str, torch.Tensor | int] = {
        "step": 0,
        "exp_avg": torch.zeros_like(grad),
        "exp_avg_sq": torch.zeros_like(grad),
    }
    if grad.ndim < 2:
        return state
    g = _as_matrix(grad)
    for side, size in zip(SIDES, g.shape):
        if size > max_precond_dim:
            continue
        factor = torch.zeros(size, size, dtype=grad.dtype, device=grad.device)
        factor.lerp_(_outer(g, side), 1.0 - shampoo_beta)
        state[f"gg_{side}"] = factor
        state[f"q_{side}"] = eigenvectors(factor).flip(1)  # descending eigenvalues
    return state


def eigenvectors(factor: torch.Tensor) -> torch.Tensor:
    """Eigenvectors (ascending eigenvalues) of the symmetric `factor` + 1e-30 I, in its dtype;
    computed in float64 when `eigh` fails in the working precision."""
    eye = torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)
    try:
        return torch.linalg.eigh(factor + 1e-30 * eye)[1]
    except RuntimeError:  # torch.linalg.LinAlgError: no convergence (ill-conditioned factor)
        wide = factor.to(torch.float64)
        return torch.linalg.eigh(wide + 1e-30 * eye.to(torch.float64))[1].to(factor.dtype)


@contextlib.contextmanager
def full_fp32_matmuls(device: torch.device) -> Iterator[None]:
    """Turn TF32 off for CUDA matmuls inside (and restore the run's `train.tf32` after)."""
    if device.type != "cuda":
        yield
        return
    flags = torch.backends.cuda.matmul
    try:  # the legacy flag, as train.devices.set_tf32 sets it ...
        name, before, exact = "allow_tf32", flags.allow_tf32, False
    except RuntimeError:  # ... unless someone set torch's new API, which refuses a mix
        name, before, exact = "fp32_precision", flags.fp32_precision, "ieee"
    setattr(flags, name, exact)
    try:
        yield
    finally:
        setattr(flags, name, before)


def _refresh_eigenbasis(state: dict, exp_avg_sq: torch.Tensor) -> torch.Tensor:
    """One power iteration + QR per side; returns `exp_avg_sq` permuted to the new order."""
    for dim, side in enumerate(SIDES):
        if f"q_{side}" not in state:
            continue
        factor, q = state[f"gg_{side}"], state[f"q_{side}"]
        fq = factor @ q
        est_eig = (q * fq).sum(0)  # diag(Q^T L Q)
        order = torch.argsort(est_eig, descending=True)
        exp_avg_sq = exp_avg_sq.index_select(dim, order)
        state[f"q_{side}"] = torch.linalg.qr(fq.index_select(1, order))[0]
    return exp_avg_sq


@torch.no_grad()
def soap_update(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    precond_freq: int,
    shampoo_beta: float,
    max_precond_dim: int,
) -> None:
    """One SOAP call on `p` (in place on `p` and the tensors in `state`); `grad` is read only.

    An empty `state` is initialised from `grad` and `p` is left unchanged (see module docstring).
    """
    if not state:
        state.update(
            soap_init_state(grad, shampoo_beta=shampoo_beta, max_precond_dim=max_precond_dim)
        )
        return
    state["step"] += 1
    t = state["step"]
    g = _as_matrix(grad.to(_work_dtype(grad)))
    q_left, q_right = state.get("q_left"), state.get("q_right")
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    m, v = _as_matrix(exp_avg), _as_matrix(exp_avg_sq)

    g_rot = project(g, q_left, q_right)  # G' = Q_L^T G Q_R
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g_rot, g_rot, value=1.0 - beta2)
    direction = project_back(project(m, q_left, q_right) / (v.sqrt() + eps), q_left, q_right)
    step_size = lr * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)
    p.add_(direction.reshape(p.shape).to(p.dtype), alpha=-step_size)
    p.add_(p, alpha=-lr * weight_decay)  # decay after the step, as in the reference

    for side in SIDES:
        if f"gg_{side}" in state:
            state[f"gg_{side}"].lerp_(_outer(g, side), 1.0 - shampoo_beta)
    if t % precond_freq == 0:
        state["exp_avg_sq"] = _refresh_eigenbasis(state, v).view_as(exp_avg_sq)


class SOAP(ParamwiseOptimizer):
    """SOAP for every parameter (see module docstring). Never modifies `p.grad`.

    `shampoo_beta=None` uses beta2 for the factor EMA (the reference's default).
    """

    def __init__(
        self,
        params,
        *,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precond_freq: int = 10,
        shampoo_beta: float | None = None,
        max_precond_dim: int = 10000,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            precond_freq=precond_freq,
            shampoo_beta=shampoo_beta,
            max_precond_dim=max_precond_dim,
        )
        super().__init__(params, defaults)

    def _update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        shampoo_beta = group["shampoo_beta"]
        with full_fp32_matmuls(p.device):
            soap_update(
                p,
                p.grad,
                state,
                shampoo_beta=group["betas"][1] if shampoo_beta is None else shampoo_beta,
                **group_hyper(group, "eps", "precond_freq", "max_precond_dim"),
            )
