"""DelayedOptimizer on quadratics: closed-form delayed SGD, sync == bare, EF, Taylor, versions."""

from __future__ import annotations

import pytest
import torch

from stalepipe.config import ConfigError, DelayConfig
from stalepipe.training.delay import DelayedOptimizer, DelaySchedule


def version_used(policy: str, stage: int, step: int, P: int, T: int) -> int:
    return DelaySchedule.build(policy, P, T).version(stage, step)


P = 3
LR = 0.1


def loss_fn(ws: list[torch.Tensor]) -> torch.Tensor:
    """A coupled quadratic: each stage's gradient depends on its neighbours' (stale) weights."""
    a = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    loss = sum(0.5 * (a * (w - 1.0) ** 2).sum() for w in ws)
    return loss + sum(0.3 * (ws[i] * ws[i + 1]).sum() for i in range(len(ws) - 1))


def grad_at(point: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves = [w.clone().requires_grad_(True) for w in point]
    return list(torch.autograd.grad(loss_fn(leaves), leaves))


def init(n: int = P) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, generator=g, dtype=torch.float64)) for _ in range(n)]


def run(cfg: DelayConfig, T: int, n: int = P, opt_fn=None):
    ws = init(n)
    opt = (opt_fn or (lambda ps: torch.optim.SGD(ps, lr=LR)))(ws)
    dopt = DelayedOptimizer(opt, [[w] for w in ws], cfg, T)
    traj = [[w.detach().clone() for w in ws]]
    taus = []
    for _ in range(T):
        with dopt.stale_weights():
            loss_fn(ws).backward()
        taus.append(dopt.step()["tau"])
        dopt.zero_grad()
        traj.append([w.detach().clone() for w in ws])
    return traj, taus, dopt


def closed_form(cfg: DelayConfig, T: int, n: int = P):
    """W_{k+1} = W_k - lr * grad(W^0_{v_0(k)}, ..., W^{n-1}_{v_{n-1}(k)}), v_s = version_used."""
    delay = DelaySchedule.build(cfg, n, T)
    traj = [[w.detach().clone() for w in init(n)]]
    for k in range(T):
        point = [traj[delay.version(s, k)][s] for s in range(n)]
        g = grad_at(point)
        # SGD's own arithmetic for W_k - lr * g (p.add_(g, alpha=-lr)), so equality is bitwise
        traj.append([w.add(gi, alpha=-LR) for w, gi in zip(traj[k], g, strict=True)])
    return traj


def assert_traj_equal(a, b):
    for k, (wa, wb) in enumerate(zip(a, b, strict=True)):
        for s, (x, y) in enumerate(zip(wa, wb, strict=True)):
            assert torch.equal(x, y), f"step {k} stage {s}: {x} != {y}"


@pytest.mark.parametrize(
    "cfg",
    [
        DelayConfig(policy="2bw"),
        DelayConfig(policy="fixed:2"),
        DelayConfig(policy="fixed:4"),
        DelayConfig(policy="pipedream"),
        DelayConfig(policy="2bw", sync_start=3, sync_cooldown=2),
        DelayConfig(policy="pipedream", sync_start=2, sync_cooldown=0.3),
    ],
    ids=lambda c: f"{c.policy}-s{c.sync_start}-c{c.sync_cooldown}",
)
def test_sgd_matches_closed_form_bitwise(cfg):
    T = 10
    traj, _, _ = run(cfg, T)
    assert_traj_equal(traj, closed_form(cfg, T))


def test_2bw_closed_form_single_stage():
    # the statement verbatim: W_{k+1} = W_k - lr * grad(W_{max(k-1,0)})
    T = 8
    traj, _, _ = run(DelayConfig(policy="2bw"), T, n=1)
    ws = [traj[0]]
    for k in range(T):
        g = grad_at(ws[max(k - 1, 0)])
        ws.append([ws[k][0].add(g[0], alpha=-LR)])
    assert_traj_equal(traj, ws)


def test_sync_is_bitwise_the_bare_optimizer():
    T = 6
    opt_fn = lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1)  # noqa: E731
    traj, _, dopt = run(DelayConfig(policy="sync"), T, opt_fn=opt_fn)
    ws = init()
    opt = opt_fn(ws)
    for k in range(T):
        loss_fn(ws).backward()
        opt.step()
        opt.zero_grad()
        assert all(torch.equal(w, t) for w, t in zip(ws, traj[k + 1], strict=True))
    assert dopt.kept_versions() == [[T]] * P  # nothing stored, ever


def test_pipedream_trace_uses_p_minus_1_minus_s():
    T = 7
    _, taus, _ = run(DelayConfig(policy="pipedream"), T)
    assert taus == [[P - 1 - s for s in range(P)]] * T


def test_at_most_tau_plus_one_versions_per_stage():
    for cfg in [
        DelayConfig(policy="pipedream"),
        DelayConfig(policy="fixed:3"),
        DelayConfig(policy="2bw", sync_start=2, sync_cooldown=2),
    ]:
        T = 10
        ws = init()
        dopt = DelayedOptimizer(torch.optim.SGD(ws, lr=LR), [[w] for w in ws], cfg, T)
        top = DelaySchedule.build(cfg.policy, P).max_tau
        for k in range(T):
            kept = dopt.kept_versions()
            for s in range(P):
                assert len(kept[s]) <= top[s] + 1, (cfg.policy, k, s, kept)
            if cfg.sync_start and k < cfg.sync_start - 1:
                assert kept == [[k]] * P  # no copies inside the sync start
            with dopt.stale_weights() as versions:
                assert all(v in kept[s] for s, v in enumerate(versions))
                loss_fn(ws).backward()
            dopt.step()
            dopt.zero_grad()


class RecordingSGD(torch.optim.SGD):
    """SGD that records the gradient it was handed and the change U_k it made."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.grads: list[list[torch.Tensor]] = []
        self.changes: list[list[torch.Tensor]] = []

    @torch.no_grad()
    def step(self, closure=None):
        ps = [p for g in self.param_groups for p in g["params"]]
        before = [p.clone() for p in ps]
        self.grads.append([p.grad.clone() for p in ps])
        super().step(closure)
        self.changes.append([b - p for b, p in zip(before, ps, strict=True)])


@pytest.mark.parametrize("policy", ["2bw", "pipedream", "sync"])
def test_error_feedback_is_exact(policy):
    T = 8
    opt_fn = lambda ps: RecordingSGD(ps, lr=LR, momentum=0.9, weight_decay=0.05)  # noqa: E731
    with pytest.warns(UserWarning, match="no delay") if policy == "sync" else _nothing():
        traj, _, dopt = run(DelayConfig(policy=policy, ef=True), T, opt_fn=opt_fn)
    U = dopt.optimizer.changes
    for k in range(T):
        for s in range(P):
            prev = U[k - 1][s] if k else torch.zeros(3, dtype=torch.float64)
            expect = traj[k][s].sub(U[k][s], alpha=2).add(prev)  # W_k - 2U_k + U_{k-1}
            assert torch.equal(traj[k + 1][s], expect), (k, s)
            torch.testing.assert_close(traj[k + 1][s] - traj[k][s], -2 * U[k][s] + prev)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("adaptive", [False, True])
def test_taylor_compensation_formula(adaptive):
    T, lam, ema, eps = 5, 0.7, 0.9, 1e-8
    cfg = DelayConfig(
        policy="pipedream", taylor=lam, taylor_adaptive=adaptive, taylor_ema=ema, taylor_eps=eps
    )
    traj, _, dopt = run(cfg, T, opt_fn=lambda ps: RecordingSGD(ps, lr=LR))
    handed = dopt.optimizer.grads
    ms = [torch.zeros(3, dtype=torch.float64) for _ in range(P)]
    for k in range(T):
        point = [traj[version_used("pipedream", s, k, P, T)][s] for s in range(P)]
        raw = grad_at(point)
        for s in range(P):
            g, w_k, w_stale = raw[s], traj[k][s], point[s]
            if adaptive:
                ms[s] = ema * ms[s] + (1 - ema) * g * g
                expect = g + lam / (ms[s].sqrt() + eps) * g * g * (w_k - w_stale)
            else:
                expect = g + lam * g * g * (w_k - w_stale)
            torch.testing.assert_close(handed[k][s], expect, rtol=1e-14, atol=1e-14)
            if version_used("pipedream", s, k, P, T) == k:
                assert torch.equal(handed[k][s], g)  # fresh stage: no correction


def test_backward_outside_the_stale_block_raises():
    """Ours, in one line naming the fix (delay/guard.py), where autograd's in-place error (an
    HF model) or nothing at all (a plain MLP) came before."""
    from stalepipe.training.delay.guard import StaleWeightsError

    ws = init()
    dopt = DelayedOptimizer(
        torch.optim.SGD(ws, lr=LR), [[w] for w in ws], DelayConfig(policy="2bw"), 5
    )
    with dopt.stale_weights():
        loss_fn(ws).backward()
    dopt.step()
    dopt.zero_grad()
    for _ in range(2):  # steps 1 and 2 swap stale weights in
        with dopt.stale_weights():
            loss = (ws[0] * ws[0]).sum() * 1.0
        with pytest.raises(StaleWeightsError, match=r"run the forward AND the backward inside"):
            loss.backward()
        with dopt.stale_weights():
            loss_fn(ws).backward()
        dopt.step()
        dopt.zero_grad()


def test_bad_usage_messages():
    ws = init()
    with pytest.raises(ConfigError, match="in no stage"):
        DelayedOptimizer(torch.optim.SGD(ws, lr=LR), [[ws[0]]], DelayConfig(), 5)
    with pytest.raises(ConfigError, match="appears in two stages"):
        DelayedOptimizer(torch.optim.SGD(ws, lr=LR), [ws, [ws[0]]], DelayConfig(), 5)
    with pytest.raises(ConfigError, match="needs total_steps"):
        DelayedOptimizer(torch.optim.SGD(ws, lr=LR), [ws], DelayConfig(sync_cooldown=3), None)
    with pytest.raises(ConfigError, match="even pipeline.num_stages"):
        DelayedOptimizer(
            torch.optim.SGD(ws, lr=LR), [[w] for w in ws], DelayConfig(policy="wpipe"), 5
        )
    dopt = DelayedOptimizer(torch.optim.SGD(ws, lr=LR), [ws], DelayConfig(policy="2bw"), 5)
    with pytest.raises(ValueError, match="at step 0, got step 3"), dopt.stale_weights(3):
        pass
    with pytest.raises(RuntimeError, match="nested"), dopt.stale_weights(), dopt.stale_weights():
        pass


def test_state_dict_roundtrip_mid_run_is_bitwise():
    cfg = DelayConfig(policy="pipedream", ef=True, taylor=0.3, taylor_adaptive=True)
    T, cut = 9, 4
    opt_fn = lambda ps: torch.optim.AdamW(ps, lr=0.05)  # noqa: E731
    full, _, _ = run(cfg, T, opt_fn=opt_fn)
    ws = init()
    dopt = DelayedOptimizer(opt_fn(ws), [[w] for w in ws], cfg, T)
    for _ in range(cut):
        with dopt.stale_weights():
            loss_fn(ws).backward()
        dopt.step()
        dopt.zero_grad()
    sd = dopt.state_dict()
    weights = [w.detach().clone() for w in ws]
    ws2 = [torch.nn.Parameter(w) for w in weights]
    dopt2 = DelayedOptimizer(opt_fn(ws2), [[w] for w in ws2], cfg, T)
    dopt2.load_state_dict(sd)
    for _ in range(cut, T):
        with dopt2.stale_weights():
            loss_fn(ws2).backward()
        dopt2.step()
        dopt2.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(ws2, full[-1], strict=True))


@pytest.mark.parametrize(
    "cfg", [DelayConfig(policy="2bw"), DelayConfig(policy="pipedream", ef=True), DelayConfig()]
)
def test_live_in_use_keeps_held_tensors_and_the_trajectory(cfg):
    """step(live_in_use=True) (the runtime's forwards in flight hold the live tensors): what
    was held before the step is unchanged after it, the stored W_k is that very storage, and
    the trajectory is bitwise the one of plain steps."""
    T = 6
    ref, _, _ = run(cfg, T, opt_fn=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9))
    ws = init()
    opt = torch.optim.SGD(ws, lr=LR, momentum=0.9)
    dopt = DelayedOptimizer(opt, [[w] for w in ws], cfg, T)
    for k in range(T):
        with dopt.stale_weights():
            loss_fn(ws).backward()
        held = [w.detach() for w in ws]  # what a graph in flight would hold
        values = [h.clone() for h in held]
        dopt.step(live_in_use=True)
        dopt.zero_grad()
        for s, (h, v) in enumerate(zip(held, values, strict=True)):
            assert torch.equal(h, v), (k, s)
            assert h.data_ptr() != ws[s].data_ptr(), (k, s)
            if k in dopt.kept_versions()[s][:-1]:
                assert dopt.weights_at(s, k)[0].data_ptr() == h.data_ptr(), (k, s)
        assert_traj_equal(ref[k + 1 : k + 2], [[w.detach() for w in ws]])
