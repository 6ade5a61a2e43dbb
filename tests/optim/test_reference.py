"""Each optimizer against a slow reference written here from its paper's update rule.

The references loop over parameters and steps, and elementwise rules over individual scalars with
Python floats, so they share no code with the fast path. Everything runs in float64 so that a
mismatch means different math, not rounding. 24 steps; 2-D (square, wide, tall) and 1-D tensors;
gradient scales alternate in blocks of 4 steps (1 and 0.01) so norm-dependent branches (MARS clipping) take both arms.
"""

from __future__ import annotations

import math

import pytest
import torch

from stalepipe.training.optim import MARS, SOAP, Adan, Lion, Muon, NAdamW

STEPS = 24
SHAPES = [(8, 12), (12, 8), (16, 16), (30, 6), (10,), (7,)]
RTOL, ATOL = 1e-5, 1e-10


def make_problem(seed: int = 0, shapes=SHAPES, steps: int = STEPS):
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


def run_impl(make_opt, params, grads):
    """Run the fast optimizer; returns (final params, optimizer). Gradients are fresh tensors."""
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = make_opt(ps)
    for step_grads in grads:
        for p, g in zip(ps, step_grads):
            p.grad = g.clone()
        opt.step()
    return ps, opt


def close(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=msg)


# ---- scalar helpers -----------------------------------------------------------------------


def flat(t: torch.Tensor) -> list[float]:
    return t.flatten().tolist()


def unflat(xs: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64).reshape(like.shape)


def sign(x: float) -> float:
    return (x > 0) - (x < 0)


# ---- AdamW (Loshchilov & Hutter, Alg. 2) --------------------------------------------------


def ref_adamw_scalar(p, g, m, v, t, lr, b1, b2, eps, wd):
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    return p - lr * m_hat / (math.sqrt(v_hat) + eps), m, v


def ref_adamw(params, grads, lr, b1, b2, eps, wd):
    out, states = [], []
    for i, p0 in enumerate(params):
        p, m, v = flat(p0), [0.0] * p0.numel(), [0.0] * p0.numel()
        for t, step_grads in enumerate(grads, start=1):
            g = flat(step_grads[i])
            for j in range(len(p)):
                p[j], m[j], v[j] = ref_adamw_scalar(p[j], g[j], m[j], v[j], t, lr, b1, b2, eps, wd)
        out.append(unflat(p, p0))
        states.append({"exp_avg": unflat(m, p0), "exp_avg_sq": unflat(v, p0), "step": len(grads)})
    return out, states


def test_adamw_part_matches_reference_and_torch():
    """The AdamW inside the composites equals the paper's rule and torch.optim.AdamW."""
    params, grads = make_problem(1)
    hyper = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ps, opt = run_impl(lambda ps: MARS([{"params": ps, "algo": "adamw", **hyper}]), params, grads)
    ref, ref_states = ref_adamw(params, grads, 3e-3, 0.9, 0.95, 1e-8, 0.1)
    ps_torch, _ = run_impl(lambda ps: torch.optim.AdamW(ps, **hyper), params, grads)
    for p, r, pt, st, rs in zip(ps, ref, ps_torch, opt.state.values(), ref_states):
        close(p.detach(), r)
        close(pt.detach(), r)
        close(st["exp_avg"], rs["exp_avg"])
        close(st["exp_avg_sq"], rs["exp_avg_sq"])
        assert st["step"] == rs["step"]


# ---- NAdamW (Dozat 2016, Alg. 2 with constant mu = b1; decoupled decay) -------------------


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_nadamw_matches_reference_and_torch(wd):
    """Dozat's Nesterov-Adam rule, and torch's NAdam where its momentum schedule is constant
    (momentum_decay so large that mu_t = b1; its psi = 0 would give b1 / 2)."""
    params, grads = make_problem(7)
    lr, b1, b2, eps = 3e-3, 0.99, 0.999, 1e-8
    hyper = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    ps, opt = run_impl(lambda ps: NAdamW(ps, **hyper), params, grads)
    torch_nadam = lambda ps: torch.optim.NAdam(  # noqa: E731
        ps, **hyper, momentum_decay=1e9, decoupled_weight_decay=True
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # torch keeps prod(mu_t) in the default dtype
    try:
        ps_torch, _ = run_impl(torch_nadam, params, grads)
    finally:
        torch.set_default_dtype(default)
    for i, p0 in enumerate(params):
        p, m, v = flat(p0), [0.0] * p0.numel(), [0.0] * p0.numel()
        for t, step_grads in enumerate(grads, start=1):
            g = flat(step_grads[i])
            for j in range(len(p)):
                p[j] *= 1 - lr * wd
                m[j] = b1 * m[j] + (1 - b1) * g[j]
                v[j] = b2 * v[j] + (1 - b2) * g[j] ** 2
                m_hat = b1 * m[j] / (1 - b1 ** (t + 1)) + (1 - b1) * g[j] / (1 - b1**t)
                p[j] -= lr * m_hat / (math.sqrt(v[j] / (1 - b2**t)) + eps)
        close(ps[i].detach(), unflat(p, p0))
        close(ps_torch[i].detach(), unflat(p, p0))
        close(opt.state[ps[i]]["exp_avg"], unflat(m, p0))
    # torch's default schedule (psi = 0.004) is another optimizer: the test can tell them apart
    ps_sched, _ = run_impl(
        lambda ps: torch.optim.NAdam(ps, **hyper, decoupled_weight_decay=True), params, grads
    )
    assert not torch.allclose(ps_sched[0].detach(), ps[0].detach(), rtol=RTOL, atol=ATOL)


# ---- Lion (Chen et al. 2023, Program 1) ---------------------------------------------------


@pytest.mark.parametrize("wd", [0.0, 0.5])
def test_lion_matches_reference(wd):
    params, grads = make_problem(2)
    lr, b1, b2 = 1e-3, 0.95, 0.98
    ps, opt = run_impl(lambda ps: Lion(ps, lr=lr, betas=(b1, b2), weight_decay=wd), params, grads)
    for i, p0 in enumerate(params):
        p, m = flat(p0), [0.0] * p0.numel()
        for step_grads in grads:
            g = flat(step_grads[i])
            for j in range(len(p)):
                c = b1 * m[j] + (1 - b1) * g[j]
                p[j] = p[j] * (1 - lr * wd) - lr * sign(c)
                m[j] = b2 * m[j] + (1 - b2) * g[j]
        close(ps[i].detach(), unflat(p, p0))
        close(opt.state[ps[i]]["exp_avg"], unflat(m, p0))


# ---- Adan (Xie et al., Alg. 1, code convention for the betas) -----------------------------


@pytest.mark.parametrize("no_prox", [False, True])
def test_adan_matches_reference(no_prox):
    params, grads = make_problem(3)
    lr, b1, b2, b3, eps, wd = 2e-3, 0.98, 0.92, 0.99, 1e-8, 0.02
    ps, opt = run_impl(
        lambda ps: Adan(ps, lr=lr, betas=(b1, b2, b3), eps=eps, weight_decay=wd, no_prox=no_prox),
        params,
        grads,
    )
    for i, p0 in enumerate(params):
        n_el = p0.numel()
        p, m, e, n = flat(p0), [0.0] * n_el, [0.0] * n_el, [0.0] * n_el
        prev = flat(grads[0][i])  # g_0 := g_1, so d_1 = 0
        for t, step_grads in enumerate(grads, start=1):
            g = flat(step_grads[i])
            for j in range(n_el):
                d = g[j] - prev[j]
                m[j] = b1 * m[j] + (1 - b1) * g[j]
                e[j] = b2 * e[j] + (1 - b2) * d
                z = g[j] + b2 * d
                n[j] = b3 * n[j] + (1 - b3) * z * z
                eta = lr / (math.sqrt(n[j] / (1 - b3**t)) + eps)
                u = m[j] / (1 - b1**t) + b2 * e[j] / (1 - b2**t)
                if no_prox:
                    p[j] = p[j] * (1 - lr * wd) - eta * u
                else:
                    p[j] = (p[j] - eta * u) / (1 + lr * wd)
            prev = g
        st = opt.state[ps[i]]
        close(ps[i].detach(), unflat(p, p0))
        close(st["exp_avg"], unflat(m, p0))
        close(st["exp_avg_diff"], unflat(e, p0))
        close(st["exp_avg_sq"], unflat(n, p0))
        close(st["prev_grad"], grads[-1][i])


# ---- MARS-AdamW (Yuan et al., Alg. 1 with the approximate previous gradient) --------------


def test_mars_matches_reference():
    params, grads = make_problem(4)
    lr, b1, b2, eps, wd, gamma = 3e-3, 0.95, 0.99, 1e-8, 0.01, 0.025
    aux = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    mats = [i for i, p in enumerate(params) if p.ndim == 2]
    vecs = [i for i, p in enumerate(params) if p.ndim == 1]

    def make(ps):
        return MARS(
            [
                {"params": [ps[i] for i in mats], "algo": "mars", "lr": lr, "betas": (b1, b2),
                 "eps": eps, "weight_decay": wd, "gamma": gamma},
                {"params": [ps[i] for i in vecs], "algo": "adamw", **aux},
            ]
        )  # fmt: skip

    ps, opt = run_impl(make, params, grads)
    clipped = unclipped = 0
    for i in mats:
        p0 = params[i]
        n_el = p0.numel()
        p, m, v, last = flat(p0), [0.0] * n_el, [0.0] * n_el, [0.0] * n_el
        for t, step_grads in enumerate(grads, start=1):
            g = flat(step_grads[i])
            c = [g[j] + gamma * b1 / (1 - b1) * (g[j] - last[j]) for j in range(n_el)]
            norm = math.sqrt(sum(x * x for x in c))
            if norm > 1:
                c = [x / norm for x in c]
                clipped += 1
            else:
                unclipped += 1
            for j in range(n_el):
                p[j], m[j], v[j] = ref_adamw_scalar(p[j], c[j], m[j], v[j], t, lr, b1, b2, eps, wd)
            last = g
        st = opt.state[ps[i]]
        close(ps[i].detach(), unflat(p, p0))
        close(st["exp_avg"], unflat(m, p0))
        close(st["exp_avg_sq"], unflat(v, p0))
        close(st["last_grad"], grads[-1][i])
        assert st["step"] == len(grads)
    assert clipped and unclipped, "both branches of the norm clip must be exercised"
    ref_vec, _ = ref_adamw([params[i] for i in vecs], [[g[i] for i in vecs] for g in grads],
                           aux["lr"], 0.9, 0.95, 1e-8, 0.0)  # fmt: skip
    for i, r in zip(vecs, ref_vec):
        close(ps[i].detach(), r)


# ---- Muon (Jordan et al. 2024; Moonshot's RMS matching) -----------------------------------


def ref_orthogonalise(u: torch.Tensor, steps: int) -> torch.Tensor:
    """Quintic Newton-Schulz: X <- aX + b (XX^T) X + c (XX^T)^2 X on the wide orientation."""
    a, b, c = 3.4445, -4.7750, 2.0315
    transpose = u.shape[0] > u.shape[1]
    x = u.T if transpose else u
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.T if transpose else x


@pytest.mark.parametrize(
    ("scale", "nesterov"), [("original", True), ("match_rms", True), ("original", False)]
)
def test_muon_matches_reference(scale, nesterov):
    params, grads = make_problem(5)
    lr, mu, wd, ns_steps = 0.02, 0.95, 0.01, 5
    aux = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    mats = [i for i, p in enumerate(params) if p.ndim == 2]
    vecs = [i for i, p in enumerate(params) if p.ndim == 1]

    def make(ps):
        return Muon(
            [
                {"params": [ps[i] for i in mats], "algo": "muon", "lr": lr, "weight_decay": wd,
                 "momentum": mu, "nesterov": nesterov, "ns_steps": ns_steps, "scale": scale},
                {"params": [ps[i] for i in vecs], "algo": "adamw", **aux},
            ]
        )  # fmt: skip

    ps, opt = run_impl(make, params, grads)
    for i in mats:
        p, buf = params[i].clone(), torch.zeros_like(params[i])
        rows, cols = p.shape
        mult = (
            math.sqrt(max(1, rows / cols))
            if scale == "original"
            else 0.2 * math.sqrt(max(rows, cols))
        )
        for step_grads in grads:
            g = step_grads[i]
            buf = mu * buf + (1 - mu) * g
            u = (1 - mu) * g + mu * buf if nesterov else buf
            p = p * (1 - lr * wd) - lr * mult * ref_orthogonalise(u, ns_steps)
        close(ps[i].detach(), p)
        close(opt.state[ps[i]]["momentum_buffer"], buf)
    ref_vec, _ = ref_adamw([params[i] for i in vecs], [[g[i] for i in vecs] for g in grads],
                           aux["lr"], 0.9, 0.95, 1e-8, 0.0)  # fmt: skip
    for i, r in zip(vecs, ref_vec):
        close(ps[i].detach(), r)


# ---- SOAP (Vyas et al., Alg. 3; first reference version: momentum kept in the eigenbasis) -


def ref_soap(params, grads, lr, b1, b2, eps, wd, freq, max_dim):
    out, states = [], []
    for i, p0 in enumerate(params):
        p = p0.clone()
        matrix = p.ndim == 2
        q = {}  # side -> eigenbasis
        gg = {}  # side -> factor
        m_rot = v = None
        t = 0
        for step_grads in grads:
            g = step_grads[i]
            if m_rot is None:  # first call: statistics only
                m_rot, v = torch.zeros_like(g), torch.zeros_like(g)
                if matrix:
                    for side, size, outer in (
                        ("left", g.shape[0], g @ g.T),
                        ("right", g.shape[1], g.T @ g),
                    ):
                        if size <= max_dim:
                            gg[side] = (1 - b2) * outer
                            eye = torch.eye(size, dtype=g.dtype)
                            q[side] = torch.linalg.eigh(gg[side] + 1e-30 * eye)[1].flip(1)
                continue
            t += 1
            ql, qr = q.get("left"), q.get("right")

            def rot(x, ql=ql, qr=qr):
                x = x if ql is None else ql.T @ x
                return x if qr is None else x @ qr

            def unrot(x, ql=ql, qr=qr):
                x = x if ql is None else ql @ x
                return x if qr is None else x @ qr.T

            g_rot = rot(g) if matrix else g
            m_rot = b1 * m_rot + (1 - b1) * g_rot
            v = b2 * v + (1 - b2) * g_rot**2
            n = m_rot / (v.sqrt() + eps)
            p = p - lr * math.sqrt(1 - b2**t) / (1 - b1**t) * (unrot(n) if matrix else n)
            p = p - lr * wd * p
            if not matrix:
                continue
            for side, outer in (("left", g @ g.T), ("right", g.T @ g)):
                if side in gg:
                    gg[side] = b2 * gg[side] + (1 - b2) * outer
            if t % freq == 0:
                m_orig = unrot(m_rot)
                for dim, side in enumerate(("left", "right")):
                    if side not in q:
                        continue
                    est = torch.diagonal(q[side].T @ gg[side] @ q[side])
                    order = torch.argsort(est, descending=True)
                    v = v.index_select(dim, order)
                    q[side] = torch.linalg.qr(gg[side] @ q[side][:, order])[0]
                m_rot = rot(m_orig, q.get("left"), q.get("right"))
        exp_avg = unrot(m_rot, q.get("left"), q.get("right")) if matrix else m_rot
        out.append(p)
        states.append({"exp_avg": exp_avg, "exp_avg_sq": v, "step": t, "q": q, "gg": gg})
    return out, states


def test_soap_matches_reference():
    params, grads = make_problem(6)
    lr, b1, b2, eps, wd, freq, max_dim = 3e-3, 0.95, 0.95, 1e-8, 0.01, 3, 20
    ps, opt = run_impl(
        lambda ps: SOAP(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, precond_freq=freq,
                        max_precond_dim=max_dim),
        params,
        grads,
    )  # fmt: skip
    ref, ref_states = ref_soap(params, grads, lr, b1, b2, eps, wd, freq, max_dim)
    for p, r, rs in zip(ps, ref, ref_states):
        st = opt.state[p]
        close(p.detach(), r)
        close(st["exp_avg"], rs["exp_avg"])
        close(st["exp_avg_sq"], rs["exp_avg_sq"])
        assert st["step"] == rs["step"] == len(grads) - 1
        for side in ("left", "right"):
            assert (f"q_{side}" in st) == (side in rs["q"])
            if side in rs["q"]:
                close(st[f"gg_{side}"], rs["gg"][side])
                signs = torch.sign((st[f"q_{side}"] * rs["q"][side]).sum(0))  # eigenvector sign
                close(st[f"q_{side}"] * signs, rs["q"][side])
    assert "q_left" not in opt.state[ps[3]], "rows > max_precond_dim must not be rotated"


def test_soap_first_call_only_collects_statistics():
    params, grads = make_problem(7, steps=1)
    ps, _ = run_impl(lambda ps: SOAP(ps, lr=1.0, weight_decay=0.5), params, grads)
    for p, p0 in zip(ps, params):
        assert torch.equal(p.detach(), p0)
