"""The correctors beyond the paper on a quadratic: weight prediction, PipeMare's LR schedule,
DC-ASGD-EMA and adaptive momentum against hand-written closed forms (SGD and momentum SGD),
their pure functions on hand-computed values, and their bookkeeping and refusals."""

from __future__ import annotations

import math

import pytest
import torch

from stalepipe.config import ConfigError, DelayConfig
from stalepipe.training.delay import DelayedOptimizer, DelaySchedule
from stalepipe.training.delay.correctors import (
    adaptive_momentum,
    pipemare_lr_factor,
    predict_weights,
)

P = 3
LR = 0.1
MU = 0.5
A = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)


def loss_fn(ws: list[torch.Tensor]) -> torch.Tensor:
    """A coupled quadratic: each stage's gradient depends on its neighbours' (stale) weights."""
    loss = sum(0.5 * (A * (w - 1.0) ** 2).sum() for w in ws)
    return loss + sum(0.3 * (ws[i] * ws[i + 1]).sum() for i in range(len(ws) - 1))


def grad_at(point: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves = [w.clone().requires_grad_(True) for w in point]
    return list(torch.autograd.grad(loss_fn(leaves), leaves))


def init() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, generator=g, dtype=torch.float64)) for _ in range(P)]


def run(cfg: DelayConfig, T: int, momentum: float = 0.0):
    """The DelayedOptimizer over SGD (one param group spanning the stages)."""
    ws = init()
    dopt = DelayedOptimizer(
        torch.optim.SGD(ws, lr=LR, momentum=momentum), [[w] for w in ws], cfg, T
    )
    traj = [[w.detach().clone() for w in ws]]
    for _ in range(T):
        with dopt.stale_weights():
            loss_fn(ws).backward()
        dopt.step()
        dopt.zero_grad()
        traj.append([w.detach().clone() for w in ws])
    return traj, dopt


def closed_form(cfg: DelayConfig, T: int, momentum: float = 0.0):
    """Delayed (momentum) SGD with every corrector written out by hand, per stage s and step k:
    v = max(k - tau, 0); point = W_v + c tau (W_v - W_{v-1}) (W_{-1} = W_0);
    g += lam V (W_k - point), V = ema V + (1 - ema) g^2;
    mu_s = mu + tau (0.99 - mu) / P;  buf = mu_s buf + g (buf = g first);
    W_{k+1} = W_k - lr tau^-(1 - min(k/K, 1)) buf."""
    delay = DelaySchedule.build(cfg, P, T)
    c = cfg.weight_pred_scale if cfg.weight_pred else 0.0
    traj = [[w.detach().clone() for w in init()]]
    bufs: list[torch.Tensor | None] = [None] * P
    ema = [torch.zeros(3, dtype=torch.float64) for _ in range(P)]
    for k in range(T):
        taus = delay.taus(k)
        point = []
        for s, tau in enumerate(taus):
            v = max(k - tau, 0)
            prev = traj[max(v - 1, 0)][s]
            point.append(traj[v][s] + c * tau * (traj[v][s] - prev))
        grads = grad_at(point)
        new = []
        for s, (tau, g) in enumerate(zip(taus, grads, strict=True)):
            if cfg.taylor > 0:
                ema[s] = cfg.taylor_ema * ema[s] + (1 - cfg.taylor_ema) * g * g
                if tau > 0:
                    g = g + cfg.taylor * ema[s] * (traj[k][s] - point[s])
            mu = momentum
            if cfg.adaptive_momentum:
                mu = momentum + tau * (0.99 - momentum) / P
            if momentum or cfg.adaptive_momentum:
                bufs[s] = g.clone() if bufs[s] is None else mu * bufs[s] + g
                g = bufs[s]
            lr = LR
            if cfg.lr_correction_steps and tau > 0:
                lr = LR * tau ** -(1 - min(k / cfg.lr_correction_steps, 1))
            new.append(traj[k][s] - lr * g)
        traj.append(new)
    return traj


def assert_close(a, b):
    for k, (wa, wb) in enumerate(zip(a, b, strict=True)):
        for s, (x, y) in enumerate(zip(wa, wb, strict=True)):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12, msg=f"step {k} stage {s}")


CASES = [
    DelayConfig(policy="2bw", weight_pred=True),
    DelayConfig(policy="pipedream", weight_pred=True, weight_pred_scale=0.5),
    DelayConfig(policy="fixed:3", weight_pred=True, sync_start=2, sync_cooldown=2),
    DelayConfig(policy="pipedream", lr_correction_steps=6),
    DelayConfig(policy="fixed:3", lr_correction_steps=4, sync_start=2),
    DelayConfig(policy="2bw", taylor=0.5, taylor_curvature="ema", taylor_ema=0.9),
    DelayConfig(policy="pipedream", taylor=0.5, taylor_curvature="ema"),
    DelayConfig(policy="pipedream", adaptive_momentum=True),
    DelayConfig(policy="2bw", adaptive_momentum=True, sync_cooldown=3),
    DelayConfig(
        policy="pipedream",
        weight_pred=True,
        lr_correction_steps=5,
        taylor=0.3,
        taylor_curvature="ema",
        adaptive_momentum=True,
    ),
]


def _id(c: DelayConfig) -> str:
    on = [
        f"wp{c.weight_pred_scale:g}" if c.weight_pred else "",
        f"lr{c.lr_correction_steps}" if c.lr_correction_steps else "",
        "dcema" if c.taylor else "",
        "am" if c.adaptive_momentum else "",
    ]
    return "-".join([c.policy, *filter(None, on)])


@pytest.mark.parametrize("cfg", CASES, ids=_id)
@pytest.mark.parametrize("momentum", [0.0, MU], ids=["sgd", "momentum"])
def test_corrector_matches_closed_form(cfg, momentum):
    if cfg.adaptive_momentum and momentum == 0.0:
        pytest.skip("adaptive momentum needs an optimizer with momentum (refusal tested below)")
    T = 10
    traj, _ = run(cfg, T, momentum)
    want = closed_form(cfg, T, momentum)
    assert_close(traj, want)
    # and the corrector changes the trajectory (the test can fail)
    plain = dict(weight_pred=False, weight_pred_scale=1.0, lr_correction_steps=0)
    plain |= dict(taylor=0.0, taylor_curvature="g2", adaptive_momentum=False)
    base, _ = run(DelayConfig(policy=cfg.policy, sync_start=cfg.sync_start, **plain), T, momentum)
    assert not torch.equal(base[-1][0], traj[-1][0])


def test_weight_prediction_by_hand_2bw_one_stage():
    # 2bw, c = 1, one stage: steps 0 and 1 read W_0; step 2 reads 2 W_1 - W_0.
    w = torch.nn.Parameter(torch.tensor([2.0], dtype=torch.float64))
    dopt = DelayedOptimizer(
        torch.optim.SGD([w], lr=0.5), [[w]], DelayConfig(policy="2bw", weight_pred=True), 4
    )
    seen = []
    for _ in range(3):
        with dopt.stale_weights():
            seen.append(w.item())
            (0.5 * w * w).sum().backward()  # g = w
        dopt.step()
        dopt.zero_grad()
    # W_0 = 2; W_1 = 2 - 0.5 * 2 = 1; W_2 = 1 - 0.5 * 2 = 0; step 2 reads 2 * W_1 - W_0 = 0
    assert seen == [2.0, 2.0, 0.0]
    assert w.item() == 0.0  # W_3 = W_2 - 0.5 * 0


def test_pure_functions_by_hand():
    assert pipemare_lr_factor(0, 0, 10) == 1.0
    assert pipemare_lr_factor(1, 0, 10) == 1.0  # the identity at 2bw's tau = 1
    assert pipemare_lr_factor(4, 0, 10) == 0.25
    assert pipemare_lr_factor(4, 5, 10) == 0.5  # 4^-(1/2)
    assert pipemare_lr_factor(4, 10, 10) == 1.0 == pipemare_lr_factor(4, 99, 10)
    assert adaptive_momentum(0.9, 0, 4) == 0.9
    assert math.isclose(adaptive_momentum(0.9, 2, 4), 0.945)
    assert math.isclose(adaptive_momentum(0.9, 4, 4), 0.99)
    (w,) = predict_weights([torch.tensor([3.0])], [torch.tensor([1.0])], 1.5)
    assert w.item() == 6.0  # 3 + 1.5 * (3 - 1)


def test_groups_restored_and_split_per_stage():
    ws = init()
    opt = torch.optim.AdamW(ws, lr=0.01, betas=(0.9, 0.95))
    cfg = DelayConfig(policy="pipedream", lr_correction_steps=5, adaptive_momentum=True)
    dopt = DelayedOptimizer(opt, [[w] for w in ws], cfg, 4)
    assert [g["params"] for g in opt.param_groups] == [[w] for w in ws]  # one group per stage
    with dopt.stale_weights():
        loss_fn(ws).backward()
    dopt.step()
    assert all(g["lr"] == 0.01 and g["betas"] == (0.9, 0.95) for g in opt.param_groups)


def test_prediction_keeps_one_more_version():
    for policy, top in [("2bw", 1), ("pipedream", P - 1), ("fixed:3", 3)]:
        T = 9
        ws = init()
        cfg = DelayConfig(policy=policy, weight_pred=True, sync_start=2)
        dopt = DelayedOptimizer(torch.optim.SGD(ws, lr=LR), [[w] for w in ws], cfg, T)
        peak = [0] * P
        for _ in range(T):
            kept = dopt.kept_versions()
            peak = [max(a, len(b)) for a, b in zip(peak, kept, strict=True)]
            with dopt.stale_weights():  # raises KeyError if a version it reads was dropped
                loss_fn(ws).backward()
            dopt.step()
            dopt.zero_grad()
        taus = DelaySchedule.build(policy, P).max_tau
        assert peak == [t + 2 if t else 1 for t in taus], (policy, peak)
        assert max(taus) == top


def test_refusals():
    ws = init()
    with pytest.raises(ConfigError, match="needs an optimizer with momentum"):
        DelayedOptimizer(
            torch.optim.SGD(ws, lr=LR),
            [[w] for w in ws],
            DelayConfig(policy="2bw", adaptive_momentum=True),
            4,
        )
    with pytest.raises(ConfigError, match="delay.adaptive_momentum needs tau_s <= 3"):
        DelayedOptimizer(
            torch.optim.SGD(ws, lr=LR, momentum=0.9),
            [[w] for w in ws],
            DelayConfig(policy="fixed:4", adaptive_momentum=True),
            4,
        )
    with pytest.raises(ConfigError, match="delay.adaptive_momentum does nothing at momentum 0.99"):
        DelayedOptimizer(
            torch.optim.SGD(ws, lr=LR, momentum=0.99),
            [[w] for w in ws],
            DelayConfig(policy="2bw", adaptive_momentum=True),
            4,
        )
    with pytest.raises(ConfigError, match="delay.weight_pred_scale 2 scales weight prediction"):
        DelayConfig(policy="2bw", weight_pred_scale=2.0)
    with pytest.raises(ConfigError, match="delay.taylor_curvature ema"):
        DelayConfig(policy="2bw", taylor_curvature="ema")
    with pytest.raises(ConfigError, match="delay.lr_correction_steps must be >= 0"):
        DelayConfig(policy="2bw", lr_correction_steps=-1)


def test_a_run_recorded_before_the_correctors_resumes():
    """A config.json written before the correctors' fields existed means them at their
    defaults: resuming it is no config change; turning one on is."""
    import copy

    from stalepipe.config import ExperimentConfig
    from stalepipe.training.rundir.resume import config_diff

    current = ExperimentConfig(delay=DelayConfig(policy="2bw")).to_dict()
    old = copy.deepcopy(current)
    for key in ("taylor_curvature", "weight_pred", "weight_pred_scale"):
        del old["delay"][key]
    del old["delay"]["lr_correction_steps"], old["delay"]["adaptive_momentum"]
    assert config_diff(old, current, resumed_step=3) == []
    current["delay"]["weight_pred"] = True
    assert config_diff(old, current, resumed_step=3) == ["delay.weight_pred"]


def test_experiment_config_refuses_before_anything_is_written():
    from stalepipe.config import ExperimentConfig, OptimConfig
    from stalepipe.training.optim import resolve_config

    nadamw = resolve_config(OptimConfig(name="nadamw"))  # what train() records: beta1 0.99
    with pytest.raises(ConfigError, match="which is mu at optim.beta1 0.99; set optim.beta1 to"):
        ExperimentConfig(optim=nadamw, delay=DelayConfig(policy="2bw", adaptive_momentum=True))
    muon = resolve_config(OptimConfig(name="muon", beta1=0.99))  # its AdamW part still moves
    ExperimentConfig(optim=muon, delay=DelayConfig(policy="2bw", adaptive_momentum=True))
    with pytest.raises(ConfigError, match="set delay.policy to fixed:1 or less"):
        ExperimentConfig(delay=DelayConfig(policy="fixed:3", adaptive_momentum=True))
