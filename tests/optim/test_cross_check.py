"""Cross-checks against third-party implementations that agree with the authors' code.

pytorch-optimizer (tested with 4.1.0; optional, the tests skip without it) matches the reference
SOAP, Adan and Lion code; torch.optim.Muon is Jordan's algorithm with Newton-Schulz in bfloat16.
The references in test_reference.py remain the primary check; these guard against a shared
misreading of a paper. Note that pytorch-optimizer's Adan negates `p.grad` in place, so every
step here hands it a fresh copy.
"""

from __future__ import annotations

import pytest
import torch

from stalepipe.training.optim import MARS, SOAP, Adan, Lion, Muon

STEPS = 40
SHAPES_2D = [(8, 12), (12, 8), (16, 16)]
SHAPES = [*SHAPES_2D, (10,)]


def problem(seed, shapes=SHAPES, steps=STEPS):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [
        [
            torch.randn(s, generator=gen, dtype=torch.float64) * (0.01 if (t // 4) % 2 else 1.0)
            for s in shapes
        ]
        for t in range(steps)
    ]
    return params, grads


def run(make_opt, params, grads):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = make_opt(ps)
    for step_grads in grads:
        for p, g in zip(ps, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


def assert_same_trajectory(ours, theirs, rtol=1e-7, atol=1e-10):
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def po():
    return pytest.importorskip("pytorch_optimizer")


def test_soap_matches_pytorch_optimizer(po):
    params, grads = problem(0)
    hyper = dict(lr=3e-3, betas=(0.95, 0.95), weight_decay=0.01)
    ours = run(lambda ps: SOAP(ps, precond_freq=10, **hyper), params, grads)
    theirs = run(lambda ps: po.SOAP(ps, precondition_frequency=10, **hyper), params, grads)
    # bitwise-close until the first eigenbasis refresh; pytorch-optimizer then runs its QR in
    # float32, which moves the bases by ~1e-7 (the reference code uses the factor's dtype)
    assert_same_trajectory(ours, theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("no_prox", [False, True])
def test_adan_matches_pytorch_optimizer(po, no_prox):
    params, grads = problem(1)
    hyper = dict(lr=3e-3, betas=(0.98, 0.92, 0.99), weight_decay=0.02, eps=1e-8)
    ours = run(lambda ps: Adan(ps, no_prox=no_prox, **hyper), params, grads)
    theirs = run(
        lambda ps: po.Adan(ps, weight_decouple=no_prox, foreach=False, **hyper), params, grads
    )
    assert_same_trajectory(ours, theirs)


def test_lion_matches_pytorch_optimizer(po):
    params, grads = problem(2)
    hyper = dict(lr=1e-3, betas=(0.95, 0.98), weight_decay=0.3)
    ours = run(lambda ps: Lion(ps, **hyper), params, grads)
    theirs = run(lambda ps: po.Lion(ps, foreach=False, **hyper), params, grads)
    assert_same_trajectory(ours, theirs)


def test_mars_matrices_match_pytorch_optimizer(po):
    """eps = 0: pytorch-optimizer adds eps before the bias correction of sqrt(v), the MARS code
    (and we) after it; everything else must agree."""
    params, grads = problem(3, shapes=SHAPES_2D)
    hyper = dict(lr=3e-3, betas=(0.95, 0.99), weight_decay=0.01, gamma=0.025, eps=0.0)
    ours = run(lambda ps: MARS([{"params": ps, "algo": "mars", **hyper}]), params, grads)
    theirs = run(lambda ps: po.MARS(ps, mars_type="adamw", foreach=False, **hyper), params, grads)
    assert_same_trajectory(ours, theirs)


@pytest.mark.parametrize("scale", ["original", "match_rms"])
def test_muon_matches_torch_muon_to_bfloat16_precision(scale):
    """torch.optim.Muon orthogonalises in bfloat16, so only a coarse agreement is possible."""
    params, grads = problem(4, shapes=SHAPES_2D, steps=3)
    lr, wd, mu = 0.02, 0.01, 0.95
    group = dict(lr=lr, weight_decay=wd, momentum=mu, nesterov=True, ns_steps=5, scale=scale)
    ours = run(lambda ps: Muon([{"params": ps, "algo": "muon", **group}]), params, grads)
    torch_scale = "original" if scale == "original" else "match_rms_adamw"
    theirs = run(
        lambda ps: torch.optim.Muon(
            ps, lr=lr, weight_decay=wd, momentum=mu, adjust_lr_fn=torch_scale
        ),
        params,
        grads,
    )
    for a, b, p0 in zip(ours, theirs, params):
        step_ours, step_theirs = a - p0, b - p0
        rel = (step_ours - step_theirs).norm() / step_ours.norm()
        assert rel < 2e-2, rel
