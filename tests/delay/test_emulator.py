"""DelayEmulator on a tiny Transformer: sync == bare loop, fast == exact == reference, the
per-stage version trace (tied head included), resume == uninterrupted, every optimizer."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from stalepipe.config import ConfigError, DelayConfig, OptimConfig
from stalepipe.training.delay import DelayEmulator, DelaySchedule
from stalepipe.training.delay.reference import reference_train, stage_of_uses
from stalepipe.training.models import build_model, partition

from .conftest import make_batches, tiny_model_cfg

POLICIES = ["sync", "2bw", "pipedream", "wpipe", "fixed:2"]
MITIGATIONS = {
    "none": {},
    "ef": {"ef": True},
    "taylor": {"taylor": 0.5},
    "taylor_adaptive": {"taylor": 0.05, "taylor_adaptive": True},
    "windows": {"sync_start": 2, "sync_cooldown": 2},
    "weight_pred": {"weight_pred": True, "weight_pred_scale": 0.5, "sync_start": 2},
    "dc_asgd_ema": {"taylor": 0.5, "taylor_curvature": "ema"},
    "lr_momentum": {"lr_correction_steps": 4, "adaptive_momentum": True},
}


def make(policy="2bw", P=4, T=6, dtype=torch.float32, tie=True, opt="adamw", **delay):
    model = build_model(tiny_model_cfg(tie=tie), seed=0, dtype=dtype)
    if opt == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cfg = DelayConfig(policy=policy, **delay)
    return model, DelayEmulator(model, optimizer, cfg, num_stages=P, total_steps=T)


def train(engine, start, stop, clip=0.0):
    losses = []
    for k in range(start, stop):
        losses.append(engine.forward_backward(k, make_batches(k)))
        if clip:
            engine.clip_grad_norm_(clip)
        engine.step(k)
    return losses


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_sync_is_bitwise_the_bare_loop():
    T = 4
    model, engine = make("sync", T=T)
    losses = train(engine, 0, T, clip=0.5)
    bare = build_model(tiny_model_cfg(), seed=0)
    opt = torch.optim.AdamW(bare.parameters(), lr=1e-2, weight_decay=0.1)
    bare_losses = []
    for k in range(T):  # the training loop's own forward_backward, clip and step
        total = torch.zeros(())
        mbs = make_batches(k)
        for x, y in mbs:
            loss = bare(x, y) / len(mbs)
            loss.backward()
            total = total + loss.detach().float().cpu()
        bare_losses.append(total.item())
        torch.nn.utils.clip_grad_norm_(bare.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert losses == bare_losses
    for n, p in bare.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[n]), n


@pytest.mark.filterwarnings("ignore:delay.ef is on")
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mit", ["none", "ef", "taylor_adaptive", "weight_pred", "dc_asgd_ema"])
def test_fast_and_exact_agree_with_the_reference(policy, mit):
    P, T = 4, 5
    got = {}
    for mode in ("fast", "exact"):
        model, engine = make(policy, P, T, torch.float64, mode=mode, **MITIGATIONS[mit])
        got[mode] = (train(engine, 0, T), weights(model))
    model = build_model(tiny_model_cfg(), seed=0, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    cfg = DelayConfig(policy=policy, **MITIGATIONS[mit])
    uses = stage_of_uses(partition(model, P), model)
    versions, ref_losses = reference_train(model, opt, cfg, uses, P, T, make_batches)
    for mode in ("fast", "exact"):
        losses, w = got[mode]
        torch.testing.assert_close(losses, ref_losses, rtol=1e-12, atol=0)
        for n in w:
            torch.testing.assert_close(w[n], versions[-1][n], rtol=1e-10, atol=1e-12)
    # exact mode reproduces the reference's (and the runtime's) arithmetic bit for bit
    assert all(torch.equal(got["exact"][1][n], versions[-1][n]) for n in versions[-1])


@pytest.mark.parametrize("policy", ["pipedream", "wpipe"])
def test_fast_and_exact_agree_in_fp32(policy):
    P, T = 4, 5
    w = {}
    for mode in ("fast", "exact"):
        model, engine = make(policy, P, T, mode=mode, ef=True)
        train(engine, 0, T)
        w[mode] = weights(model)
    for n in w["fast"]:
        torch.testing.assert_close(w["fast"][n], w["exact"][n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_pipedream_trace_per_stage_and_tied_head(mode):
    """Stage s reads W_{k-(P-1-s)}; the tied head (last stage) reads the fresh W_k while the
    embedding (stage 0) reads W_{k-P+1} of the same matrix."""
    P, T = 4, 6
    model, engine = make("pipedream", P, T, mode=mode)
    stages = partition(model, P)
    probes = {s: next(iter(st.owned_parameters().values())) for s, st in enumerate(stages)}
    probe_mods = {s: m for s, st in enumerate(stages) for m in [_module_of(st, probes[s])]}
    seen: dict[str, torch.Tensor] = {}

    def record(key, tensor_of):  # a pre-hook that returns None leaves the input alone
        def hook(mod, args):
            seen.setdefault(key, tensor_of(mod).detach().clone())

        return hook

    hooks = [
        probe_mods[s].register_forward_pre_hook(record(f"stage{s}", lambda m, s=s: probes[s]))
        for s in range(P)
    ]
    hooks.append(model.lm_head.register_forward_pre_hook(record("head", lambda m: m.weight)))
    history = [weights(model)]
    names = {s: _name_of(model, probes[s]) for s in range(P)}
    for k in range(T):
        seen.clear()
        engine.forward_backward(k, make_batches(k))
        tau = engine.step(k)["tau"]
        assert tau == [P - 1 - s for s in range(P)]
        for s in range(P):
            v = DelaySchedule.build("pipedream", P, T).version(s, k)
            assert v == max(k - (P - 1 - s), 0)
            assert torch.equal(seen[f"stage{s}"], history[v][names[s]]), (k, s)
        assert torch.equal(seen["head"], history[k]["tok_emb.weight"])  # last stage: fresh
        history.append(weights(model))
    for h in hooks:
        h.remove()
    assert model.lm_head.weight is model.tok_emb.weight  # tie restored after every step


def _module_of(stage, param):
    return next(m for m in stage.modules() if any(p is param for p in m._parameters.values()))


def _name_of(model, param):
    return next(n for n, p in model.named_parameters() if p is param)


@pytest.mark.parametrize("P", [1, 4])
def test_fixed_1_is_2bw_bit_for_bit(P):
    """The delay study reads 2bw's runs as N = 1 instead of training fixed:1 again: the same
    staleness on every stage gives the same trajectory, with EF and a sync start too."""
    runs = []
    for policy in ("2bw", "fixed:1"):
        model, engine = make(policy, P, T=7, ef=True, sync_start=2)
        runs.append((train(engine, 0, 7), weights(model)))
    (losses, final), (losses1, final1) = runs
    assert losses1 == losses
    assert all(torch.equal(final[n], final1[n]) for n in final)


@pytest.mark.filterwarnings("ignore:delay.ef is on")
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mit", list(MITIGATIONS))
def test_resume_mid_run_is_bitwise(policy, mit):
    P, T, cut = 4, 7, 3
    model, engine = make(policy, P, T, opt="sgd", **MITIGATIONS[mit])
    losses = train(engine, 0, T)
    final = weights(model)

    model, engine = make(policy, P, T, opt="sgd", **MITIGATIONS[mit])
    losses2 = train(engine, 0, cut)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "engine": engine.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    model, engine = make(policy, P, T, opt="sgd", **MITIGATIONS[mit])
    model.load_state_dict(state["model"])
    engine.load_state_dict(state["engine"])
    losses2 += train(engine, cut, T)
    assert losses2 == losses
    assert all(torch.equal(p, final[n]) for n, p in model.named_parameters())


def test_resume_exact_mode_is_bitwise():
    P, T, cut = 4, 6, 2
    model, engine = make("pipedream", P, T, mode="exact", ef=True)
    train(engine, 0, T)
    final = weights(model)
    model, engine = make("pipedream", P, T, mode="exact", ef=True)
    train(engine, 0, cut)
    sd, msd = engine.state_dict(), model.state_dict()
    model, engine = make("pipedream", P, T, mode="exact", ef=True)
    model.load_state_dict(msd)
    engine.load_state_dict(sd)
    train(engine, cut, T)
    assert all(torch.equal(p, final[n]) for n, p in model.named_parameters())


class TwoStageMLP(nn.Module):
    """A user model: not a Transformer, split by the user."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.a = nn.Linear(16, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, x, y):
        return self.stage1(self.stage0(x), y)

    def stage0(self, x):
        return torch.tanh(self.a(self.emb(x)))

    def stage1(self, h, y):
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class _Stage(nn.Module):
    def __init__(self, model, fn, *names):
        super().__init__()
        for n in names:
            setattr(self, n, getattr(model, n))
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def test_user_model_with_explicit_stages():
    w = {}
    for mode in ("fast", "exact"):
        torch.manual_seed(0)
        model = TwoStageMLP()
        stages = [_Stage(model, model.stage0, "emb", "a"), _Stage(model, model.stage1, "head")]
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        engine = DelayEmulator(
            model, opt, DelayConfig(policy="pipedream", mode=mode), 2, 5, stages=stages
        )
        train(engine, 0, 5)
        w[mode] = weights(model)
    for n in w["fast"]:
        torch.testing.assert_close(w["fast"][n], w["exact"][n], rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="pass stages="):
        DelayEmulator(model, opt, DelayConfig(), 2, 5)


def test_bad_input_messages():
    with pytest.raises(ConfigError, match="pipedream with pipeline.num_stages=5 needs"):
        make("pipedream", P=5)
    with pytest.raises(ConfigError, match="wpipe with pipeline.num_stages=6"):
        make("wpipe", P=6)
    with pytest.raises(ConfigError, match="even pipeline.num_stages"):
        make("wpipe", P=3)
    with pytest.warns(UserWarning, match="no delay"):
        make("sync", ef=True)
    with pytest.warns(UserWarning, match="no delay"):
        make("pipedream", P=1, ef=True)
    _, engine = make("2bw")
    with pytest.raises(ValueError, match="at step 0"):
        engine.forward_backward(1, make_batches(1))


def _optimizer_names():
    try:
        from stalepipe.training.optim import OPTIMIZERS
    except ImportError:  # the optimizer registry has not landed
        return []
    return list(OPTIMIZERS)


@pytest.mark.parametrize("name", _optimizer_names())
@pytest.mark.parametrize("policy", POLICIES)
def test_every_optimizer_under_every_policy_runs_3_steps(name, policy):
    from stalepipe.training.optim import build_optimizer, resolve_config

    model = build_model(tiny_model_cfg(), seed=0)
    opt = build_optimizer(resolve_config(OptimConfig(name=name)), model.named_parameters())
    cfg = DelayConfig(policy=policy, ef=policy != "sync")
    engine = DelayEmulator(model, opt, cfg, 4, 3)
    before = weights(model)
    for k in range(3):
        loss = engine.forward_backward(k, make_batches(k))
        assert loss == loss  # finite, not NaN
        engine.step(k)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_moe_fast_and_exact_agree():
    """MoE stages backpropagate their router auxiliary loss with their own backward."""
    import dataclasses

    mcfg = dataclasses.replace(tiny_model_cfg(), num_experts=4, top_k=2)
    w = {}
    for mode in ("fast", "exact"):
        model = build_model(mcfg, seed=0, dtype=torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = DelayEmulator(model, opt, DelayConfig(policy="pipedream", mode=mode), 4, 3)
        w[mode] = (train(engine, 0, 3), weights(model))
    torch.testing.assert_close(w["fast"][0], w["exact"][0], rtol=1e-6, atol=0)  # fp32 CE
    for n in w["fast"][1]:
        torch.testing.assert_close(w["fast"][1][n], w["exact"][1][n], rtol=1e-10, atol=1e-12)
