"""Toy theory study: the LMO, the delayed and EF recursions against a hand-written loop, and
the qualitative results it reports."""

import numpy as np
import torch

from stalepipe.lab.studies import toy


def test_polar_factor():
    q1, _ = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64))
    M = q1 @ torch.diag(torch.tensor([5.0, 3.0, 1.0, 0.5, 0.1], dtype=torch.float64)) @ q2
    torch.testing.assert_close(toy.polar(M), q1 @ q2)


def _reference(problem, eta, variant, beta, steps):
    """The recursions of toy.py's docstring, written out with numpy, one problem."""
    A, Xs = problem.A[0].numpy(), problem.X_star[0].numpy()
    B = A @ Xs

    def grad(X):
        return A.T @ (A @ X - B)

    def polar(M):
        u, _, vt = np.linalg.svd(M)
        return u @ vt

    X = np.zeros_like(Xs)
    hist = [X]  # X_0, X_1, ...
    M = np.zeros_like(X)
    U_prev = np.zeros_like(X)
    for t in range(steps):
        G = grad(X) if variant == "sync" else grad(hist[max(t - 1, 0)])
        M = beta * M + (1 - beta) * G
        U = eta * (1 - t / steps) * polar(M)
        X = X - 2 * U + U_prev if variant == "delay+ef" else X - U
        U_prev = U
        hist.append(X)
    return 0.5 * np.sum((A @ X - B) ** 2) / (0.5 * np.sum(B**2))


def test_run_matches_reference_loop():
    problem = toy.make_problem(n=4, kappa=10.0, seeds=1, seed=3)
    for variant in toy.VARIANTS:
        for beta in (0.0, 0.9):
            curve = toy.run(problem, (0.05,), variant, beta=beta, steps=7)
            assert curve.shape == (1, 8) and curve[0, 0] == 1.0
            ref = _reference(problem, 0.05, variant, beta, 7)
            assert abs(curve[0, -1].item() - ref) < 1e-10 * max(ref, 1.0), (variant, beta)


def test_study_results_are_the_reported_ones(tmp_path):
    """Every variant converges; the delay costs at every converged step size; with momentum,
    EF removes most of that cost (the claims docs/RESULTS.md makes)."""
    etas = (0.03, 0.1)
    res = toy.toy_study(etas, betas=(0.9,), steps=300, seeds=2, n=8)
    sync, delay, ef = (res[(0.9, v)][:, -1] for v in toy.VARIANTS)
    assert (sync < 1e-3).all() and (delay < 1e-2).all() and (ef < 1e-2).all()
    assert (delay > 2 * sync).all()
    assert (ef < delay).all()
    table = toy.toy_main(tmp_path, steps=50, seeds=1, n=4, etas=etas)
    assert table.count("\n") == 2 + 2 * len(etas)
    assert {p.name for p in tmp_path.iterdir()} == {"toy.md", "toy.csv", "toy.png"}
