"""Toy theory study: Muon (an LMO method) with a one-step gradient delay, with and without error
feedback, on matrix least squares where the optimum is known.

Problem: f(X) = 1/2 ||A X - B||_F^2 with B = A X*, so X* is the optimum and f* = 0. A is n x n
with singular values spread log-uniformly over [1, sqrt(kappa)] (condition number kappa of the
Hessian A^T A ⊗ I); X* has spectral norm 1; X_0 = 0.

Update (Muon with the exact polar factor as its LMO over the spectral-norm ball):
    M_t = beta M_{t-1} + (1 - beta) G_t,    U_t = eta_t polar(M_t),    polar(M) = U V^T of M's SVD
    sync:      G_t = grad f(X_t),           X_{t+1} = X_t - U_t
    delay 1:   G_t = grad f(X_{t-1})        X_{t+1} = X_t - U_t            (paper: u_{t-1}(g_{t-1}))
    delay+EF:  G_t = grad f(X_{t-1})        X_{t+1} = X_t - 2 U_t + U_{t-1}  (paper's EF rule)
with eta_t = eta (1 - t / T) (linear decay to 0, so every variant can converge). Every (step size,
seed) pair runs as one batch of SVDs, so the whole study takes seconds.

The measured quantity is the relative suboptimality f(X_T) / f(X_0) (mean over seeds) and the
delay penalty: its ratio to sync at the same step size.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stalepipe.fileio import csv_text, write_files
from stalepipe.lazy import require

if TYPE_CHECKING:  # imported where used: the studies' registry imports this module for --help
    import torch

VARIANTS = ("sync", "delay", "delay+ef")
DEFAULT_ETAS = (0.003, 0.01, 0.03, 0.1, 0.3)


@dataclass(frozen=True)
class ToyProblem:
    """A batch of matrix least-squares problems (one per seed)."""

    A: torch.Tensor  # (S, n, n)
    X_star: torch.Tensor  # (S, n, n)

    @property
    def B(self) -> torch.Tensor:
        return self.A @ self.X_star

    def loss(self, X: torch.Tensor) -> torch.Tensor:
        """f(X) for X of shape (..., S, n, n) -> (..., S)."""
        return 0.5 * ((self.A @ X - self.B) ** 2).sum(dim=(-2, -1))

    def grad(self, X: torch.Tensor) -> torch.Tensor:
        return self.A.transpose(-2, -1) @ (self.A @ X - self.B)


def make_problem(n: int = 16, kappa: float = 100.0, seeds: int = 3, seed: int = 0) -> ToyProblem:
    """Random orthogonal factors, prescribed spectrum; float64 for clean convergence curves."""
    import torch  # here: torch (see the top)

    g = torch.Generator().manual_seed(seed)
    A, X = [], []
    for _ in range(seeds):
        q1, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        q2, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        s = torch.logspace(0, 0.5 * math.log10(kappa), n, dtype=torch.float64)
        A.append(q1 @ torch.diag(s) @ q2)
        x = torch.randn(n, n, generator=g, dtype=torch.float64)
        X.append(x / torch.linalg.matrix_norm(x, ord=2))
    return ToyProblem(torch.stack(A), torch.stack(X))


def polar(M: torch.Tensor) -> torch.Tensor:
    """U V^T of M = U S V^T (the spectral-norm LMO direction; Muon approximates it with
    Newton-Schulz)."""
    import torch  # here: torch (see the top)

    U, _, Vh = torch.linalg.svd(M, full_matrices=False)
    return U @ Vh


def run(
    problem: ToyProblem,
    etas: tuple[float, ...],
    variant: str,
    *,
    beta: float = 0.9,
    steps: int = 500,
) -> torch.Tensor:
    """Relative suboptimality f(X_t) / f(X_0) per step: shape (len(etas), steps + 1), mean over
    the problem's seeds."""
    import torch  # here: torch (see the top)

    assert variant in VARIANTS, variant
    eta = torch.tensor(etas, dtype=torch.float64).view(-1, 1, 1, 1)
    S, n, _ = problem.A.shape
    X = torch.zeros(len(etas), S, n, n, dtype=torch.float64)
    X_prev = X.clone()  # weights the delayed gradient is taken at (indices clamped at 0)
    M = torch.zeros_like(X)
    U_prev = torch.zeros_like(X)
    f0 = problem.loss(X)
    curve = [torch.ones(len(etas), dtype=torch.float64)]
    for t in range(steps):
        G = problem.grad(X if variant == "sync" else X_prev)
        M = beta * M + (1 - beta) * G
        U = eta * (1 - t / steps) * polar(M)
        X_prev = X
        X = X - 2 * U + U_prev if variant == "delay+ef" else X - U
        U_prev = U
        curve.append((problem.loss(X) / f0).mean(dim=1))
    return torch.stack(curve, dim=1)


def toy_study(
    etas: tuple[float, ...] = DEFAULT_ETAS,
    betas: tuple[float, ...] = (0.0, 0.9),
    steps: int = 500,
    seeds: int = 3,
    n: int = 16,
    kappa: float = 100.0,
) -> dict[tuple[float, str], torch.Tensor]:
    """(beta, variant) -> curves (len(etas), steps + 1)."""
    problem = make_problem(n, kappa, seeds)
    return {
        (beta, v): run(problem, etas, v, beta=beta, steps=steps) for beta in betas for v in VARIANTS
    }


def toy_table(
    results: dict[tuple[float, str], torch.Tensor], etas: tuple[float, ...]
) -> tuple[list[str], list[list[str]]]:
    """Rows: (beta, eta); columns: final suboptimality of each variant and the delay penalty
    (ratio to sync) without and with EF."""
    header = [
        "beta",
        "eta",
        "sync f/f0",
        "delay f/f0",
        "delay+EF f/f0",
        "delay / sync",
        "delay+EF / sync",
    ]
    body = []
    for beta in sorted({b for b, _ in results}):
        for i, eta in enumerate(etas):
            s, d, e = (results[(beta, v)][i, -1].item() for v in VARIANTS)
            body.append(
                [
                    f"{beta:g}",
                    f"{eta:g}",
                    f"{s:.2e}",
                    f"{d:.2e}",
                    f"{e:.2e}",
                    f"{d / s:.2f}",
                    f"{e / s:.2f}",
                ]
            )
    return header, body


def toy_plot(
    results: dict[tuple[float, str], torch.Tensor], etas: tuple[float, ...], eta_index: int
) -> bytes:
    """Left: convergence at one step size per momentum; right: final f/f0 vs step size."""
    require("matplotlib", "the toy's plot").use("Agg")
    import matplotlib.pyplot as plt  # optional (the plots extra): required above

    betas = sorted({b for b, _ in results})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    styles = {"sync": "-", "delay": "--", "delay+ef": ":"}
    for j, beta in enumerate(betas):
        color = f"C{j}"
        for v in VARIANTS:
            c = results[(beta, v)]
            axes[0].semilogy(
                c[eta_index].numpy(), styles[v], color=color, label=f"beta {beta:g} {v}"
            )
            axes[1].loglog(
                etas,
                c[:, -1].numpy(),
                styles[v],
                marker="o",
                color=color,
                label=f"beta {beta:g} {v}",
            )
    axes[0].set_title(f"convergence at eta = {etas[eta_index]:g} (linear decay)")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("f(X_t) / f(X_0)")
    axes[1].set_title("final suboptimality vs step size")
    axes[1].set_xlabel("peak step size eta")
    axes[1].set_ylabel("f(X_T) / f(X_0)")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def toy_main(
    out: str | Path = "runs/toy",
    steps: int = 500,
    seeds: int = 3,
    n: int = 16,
    kappa: float = 100.0,
    etas: tuple[float, ...] = DEFAULT_ETAS,
) -> str:
    """Run the toy study, write toy.md, toy.csv and toy.png under `out`, return the table."""
    from stalepipe.lab.analysis.markdown import md_table  # here: off `sweep --help`

    results = toy_study(etas, steps=steps, seeds=seeds, n=n, kappa=kappa)
    header, body = toy_table(results, etas)
    out = Path(out)
    table = md_table(header, body)
    files = {"toy.csv": csv_text([header, *body])}
    files["toy.png"] = toy_plot(results, etas, eta_index=len(etas) // 2)
    files["toy.md"] = (
        f"# Toy study: delayed Muon (polar-factor LMO) on matrix least squares\n\n"
        f"n = {n}, condition number {kappa:g}, {steps} steps, linear decay, mean over {seeds} "
        f"seeds; f/f0 = relative suboptimality at the end.\n\n{table}\n![toy](toy.png)\n"
    )
    write_files(out, files)  # each atomically, none through a link
    return table
