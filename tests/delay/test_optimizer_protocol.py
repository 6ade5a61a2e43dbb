"""DelayedOptimizer as a torch.optim.Optimizer: the base's groups and state, LR schedulers,
GradScaler and clipping, closures, state_dict round trips, step hooks, and the guard against a
backward outside stale_weights() (an nn.Sequential MLP and a tiny HF LlamaForCausalLM)."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

from stalepipe.config import ConfigError, DelayConfig
from stalepipe.training.delay import DelayedOptimizer, StaleWeightsError, split_stages

T = 6


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)
    )


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def make(policy: str = "2bw", ef: bool = True) -> tuple[nn.Module, DelayedOptimizer]:
    model = mlp()
    base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, DelayedOptimizer(
        base, split_stages(model, 2), DelayConfig(policy=policy, ef=ef), T
    )


def loss_of(model: nn.Module, k: int) -> torch.Tensor:
    x, y = batch(k)
    return (model(x) - y).pow(2).mean()


def train(model, opt, steps=range(T), sched=None) -> list[torch.Tensor]:
    for k in steps:
        with opt.stale_weights():
            loss_of(model, k).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return [p.detach().clone() for p in model.parameters()]


def assert_equal(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_groups_state_and_defaults_are_the_base_optimizers():
    model, opt = make()
    base = opt.optimizer
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is base.param_groups and opt.defaults is base.defaults
    train(model, opt, range(2))
    assert opt.state is base.state and len(opt.state) == len(list(model.parameters()))
    base.load_state_dict(base.state_dict())  # the base replaces its lists: still the same
    assert opt.param_groups is base.param_groups and opt.state is base.state
    with pytest.raises(ConfigError, match="before wrapping"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    with pytest.raises(ConfigError, match="wraps a torch.optim.Optimizer"):
        DelayedOptimizer(object(), [list(model.parameters())], DelayConfig(), T)  # type: ignore


@pytest.mark.parametrize(
    "scheduler",
    [
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1.0 / (k + 1)),
    ],
    ids=["StepLR", "LambdaLR"],
)
def test_a_scheduler_on_the_wrapper_is_one_on_the_base(scheduler):
    model_a, opt_a = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        sched = scheduler(opt_a)
        got = train(model_a, opt_a, sched=sched)
    model_b, opt_b = make()
    want = train(model_b, opt_b, sched=scheduler(opt_b.optimizer))  # the old way
    assert_equal(got, want)
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"] < 1e-2


def test_a_closure_is_the_block():
    model_a, opt_a = make()
    losses = []
    for k in range(T):

        def closure(k=k):
            opt_a.zero_grad()
            loss = loss_of(model_a, k)
            loss.backward()
            return loss

        losses.append(opt_a.step(closure))
    model_b, opt_b = make()
    assert_equal([p.detach() for p in model_a.parameters()], train(model_b, opt_b))
    assert all(isinstance(loss, torch.Tensor) for loss in losses)


def test_grad_scaler_and_clipping_take_it():
    def run(scaled: bool) -> list[torch.Tensor]:
        model, opt = make()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
        for k in range(T):
            with opt.stale_weights():
                scaler.scale(loss_of(model, k)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert opt.step_count == T  # every step was taken (no inf skipped one)
        return [p.detach().clone() for p in model.parameters()]

    assert_equal(run(scaled=True), run(scaled=False))  # power-of-two scaling is exact


def test_state_dict_round_trips_through_torch_save_and_deepcopy():
    model, opt = make(policy="pipedream")
    full = train(*make(policy="pipedream"))
    train(model, opt, range(3))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed, opt2 = make(policy="pipedream")
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    assert_equal(train(resumed, opt2, range(3, T)), full)
    torch.optim.lr_scheduler.StepLR(opt, step_size=10)  # patches opt.step on the instance
    model3, opt3 = copy.deepcopy((model, opt))  # everything but that patch, guard included
    assert_equal(train(model3, opt3, range(3, T)), full)
    assert (opt.step_count, opt3.step_count) == (3, T)  # opt3 stepped itself, not opt
    with pytest.raises(StaleWeightsError):
        loss_of(model3, 0).backward()


def test_step_hooks_run_around_the_delayed_step():
    model, opt = make()
    seen = []
    opt.register_step_pre_hook(lambda o, a, kw: seen.append(("pre", o.step_count)))
    opt.register_step_post_hook(lambda o, a, kw: seen.append(("post", o.step_count)))
    train(model, opt, range(2))
    assert seen == [("pre", 0), ("post", 1), ("pre", 1), ("post", 2)]


def test_a_backward_outside_the_block_is_our_error_on_an_mlp():
    model, opt = make()
    with pytest.raises(StaleWeightsError, match=r"step 0\).*inside that block"):
        loss_of(model, 0).backward()  # no block at all: raised from the backward
    opt.zero_grad()
    train(model, opt, range(1))
    with opt.stale_weights():
        loss = loss_of(model, 1)
    with pytest.raises(StaleWeightsError, match="step 1"):
        loss.backward()  # forward inside, backward outside
    model, opt = make(policy="sync", ef=False)  # no delay: no guard, the bare loop
    loss_of(model, 0).backward()
    opt.step()


def test_a_backward_outside_the_block_is_our_error_on_hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    split = split_stages(model, 2)
    opt = DelayedOptimizer(
        torch.optim.AdamW(model.parameters()), split, DelayConfig(policy="2bw"), 4
    )
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with opt.stale_weights():
        model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(StaleWeightsError, match="step 1"):
        model(ids, labels=ids).loss.backward()  # no block
    opt.zero_grad()
    with opt.stale_weights():
        loss = model(ids, labels=ids).loss
    with pytest.raises(StaleWeightsError, match="step 1"):
        loss.backward()  # forward inside, backward outside: ours, not autograd's


def test_a_model_wrapped_again_is_guarded_by_its_newest_optimizer():
    model, first = make()
    second = DelayedOptimizer(
        torch.optim.AdamW(model.parameters()), split_stages(model, 2), DelayConfig(policy="2bw"), T
    )
    with second.stale_weights():  # the first one's block is closed: it stands down
        loss_of(model, 0).backward()
    second.step()
    with pytest.raises(StaleWeightsError, match="step 1"):  # the second's own guard
        loss_of(model, 1).backward()
    model.zero_grad()
    bare = DelayedOptimizer(torch.optim.AdamW(model.parameters()), [list(model.parameters())])
    loss_of(model, 0).backward()  # sync claims the parameters: no guard speaks
    bare.step()
    assert first.step_count == 0
