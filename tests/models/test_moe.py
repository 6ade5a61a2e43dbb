"""Mixture of Experts: routing, dispatch vs reference, aux losses, dense parity, partition, counts."""

import dataclasses
import math

import pytest
import torch

from stalepipe.config import ConfigError, ModelConfig
from stalepipe.config.shapes import block_flops, split_layers
from stalepipe.presets import cpu_moe, cpu_tiny, moe_10b
from stalepipe.training.models import (
    Transformer,
    build_model,
    count_params,
    flops_per_token,
    partition,
)
from stalepipe.training.models.layers import SwiGLU
from stalepipe.training.models.moe import (
    MoE,
    dispatch,
    dispatch_reference,
    load_balancing_loss,
    route,
    router_z_loss,
    summarize_router_stats,
)

MOE = ModelConfig(
    vocab_size=128,
    dim=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    ffn_dim=64,
    max_seq_len=16,
    num_experts=4,
    top_k=2,
    expert_ffn_dim=16,
)


def _cfg(**kw) -> ModelConfig:
    return dataclasses.replace(MOE, **kw)


def test_uniform_router_with_all_experts_equals_the_dense_mixture():
    torch.manual_seed(0)
    moe = MoE(_cfg(top_k=4))
    with torch.no_grad():
        moe.router.weight.zero_()  # uniform router: every gate is 1/E
    x = torch.randn(2, 8, 32)
    mean_of_experts = sum(e(x) for e in moe.experts) / 4
    torch.testing.assert_close(moe(x), mean_of_experts, rtol=1e-5, atol=1e-6)
    # ... which is one dense SwiGLU of width E * Fe with the experts' weights side by side
    dense = SwiGLU(32, 4 * 16)
    with torch.no_grad():
        dense.w1.weight.copy_(torch.cat([e.w1.weight for e in moe.experts]))
        dense.w3.weight.copy_(torch.cat([e.w3.weight for e in moe.experts]))
        dense.w2.weight.copy_(torch.cat([e.w2.weight for e in moe.experts], dim=1) / 4)
    torch.testing.assert_close(moe(x), dense(x), rtol=1e-5, atol=1e-6)


def test_routing_is_deterministic_ties_go_to_the_lower_index():
    probs, gates, experts = route(torch.zeros(3, 4), top_k=2)
    assert experts.tolist() == [[0, 1]] * 3
    torch.testing.assert_close(gates, torch.full((3, 2), 0.5))
    torch.testing.assert_close(probs, torch.full((3, 4), 0.25))
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    _, gates, experts = route(logits, top_k=2)
    assert experts.tolist() == [[1, 2]]
    _, gates, experts = route(logits, top_k=3)
    assert experts.tolist() == [[1, 2, 0]]
    p = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(gates[0], p[[1, 2, 0]] / p[[1, 2, 0]].sum())

    torch.manual_seed(0)
    moe = MoE(MOE)
    x = torch.randn(4, 8, 32)
    assert torch.equal(moe(x), moe(x))
    # dropless: a token's experts do not depend on which other tokens share its batch
    _, _, alone = route(moe.router(x[1].reshape(-1, 32)), 2)
    _, _, together = route(moe.router(x.reshape(-1, 32)), 2)
    assert torch.equal(alone, together[8:16])


def test_aux_losses_match_hand_computed_values():
    # probs: token 0 = [3/4, 1/4], token 1 = [1/2, 1/2] (a tie: expert 0); K = 1
    logits = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]])
    probs, _, experts = route(logits, top_k=1)
    assert experts.flatten().tolist() == [0, 0]
    # f = [1, 0], P = [5/8, 3/8]: E * sum f P = 2 * 5/8
    assert load_balancing_loss(probs, experts).item() == pytest.approx(1.25)
    # logsumexp = [log 4, log 2]: mean of squares = (4 + 1) / 2 * log(2)^2
    assert router_z_loss(logits).item() == pytest.approx(2.5 * math.log(2) ** 2)
    # balanced routing gives 1, one expert taking everything gives E (with peaked probs)
    probs, _, experts = route(torch.zeros(8, 4), top_k=4)
    assert load_balancing_loss(probs, experts).item() == pytest.approx(1.0)
    peaked = torch.tensor([[50.0, 0.0, 0.0, 0.0]]).expand(8, 4)
    probs, _, experts = route(peaked, top_k=1)
    assert load_balancing_loss(probs, experts).item() == pytest.approx(4.0)


def test_model_training_loss_adds_the_weighted_mean_of_layer_aux_losses():
    cfg = _cfg(num_layers=3, num_dense_layers=1, aux_loss_weight=0.1, z_loss_weight=0.01)
    model = build_model(cfg, seed=0)
    captured = []
    for i in (1, 2):
        model.layers[i].mlp.router.register_forward_hook(lambda m, a, out: captured.append(out))
    x = torch.randint(0, 128, (2, 16))
    model.train()
    loss = model(x, x)
    model.eval()
    ce = model(x, x)
    expected = 0.0
    for logits in captured[:2]:  # the training forward's two MoE layers
        probs, _, experts = route(logits, 2)
        expected += (
            0.1 * load_balancing_loss(probs, experts) + 0.01 * router_z_loss(logits)
        ).item() / 2
    assert (loss - ce).item() == pytest.approx(expected, rel=1e-5)
    assert model.router_stats()["moe/aux_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_fast_dispatch_equals_slow_reference(top_k):
    torch.manual_seed(0)
    experts_fns = torch.nn.ModuleList(SwiGLU(32, 16) for _ in range(4))
    x = torch.randn(40, 32, requires_grad=True)
    logits = torch.randn(40, 4)
    logits[:, 3] = -30.0  # expert 3 gets no token when top_k < 4: empty groups must work
    _, gates, experts = route(logits, top_k)
    fast = dispatch(x, gates, experts, experts_fns)
    slow = dispatch_reference(x, gates, experts, experts_fns)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)
    (gx_fast,) = torch.autograd.grad(fast.square().sum(), x)
    (gx_slow,) = torch.autograd.grad(slow.square().sum(), x)
    torch.testing.assert_close(gx_fast, gx_slow, rtol=1e-5, atol=1e-5)


def _grads(model: Transformer) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_partitioned_moe_equals_unpartitioned_loss_and_gradients(P):
    cfg = _cfg(num_layers=4, num_dense_layers=1, num_shared_experts=1, aux_loss_weight=0.5)
    model = build_model(cfg, seed=0)
    x, y = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
    whole = model(x, y)
    whole.backward()
    expected = _grads(model)

    total, h = torch.zeros(()), x
    for stage in partition(model, P):
        out, aux = stage.forward_with_aux(h, y if stage.spec.is_last else None)
        if stage.spec.is_last:
            out = out + (aux if aux is not None else 0.0)
            total = total + out
        elif aux is not None:
            total = total + aux
        h = out
    torch.testing.assert_close(total, whole, rtol=0, atol=1e-6)
    total.backward()
    got = _grads(model)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7)


def test_stage_forward_refuses_to_drop_aux_losses():
    model = build_model(_cfg(num_layers=2), seed=0)
    first, last = partition(model, 2)
    x = torch.randint(0, 128, (2, 16))
    with pytest.raises(RuntimeError, match="forward_with_aux"):
        first(x)
    with torch.no_grad():
        first(x)  # forward-only: nothing to drop
    model.eval()
    torch.testing.assert_close(last(first(x), x), model(x, x))  # eval: CE only, both ways


def test_router_stats():
    model = build_model(MOE, seed=0)
    assert build_model(dataclasses.replace(MOE, num_experts=0), seed=0).router_stats() == {}
    x = torch.randint(0, 128, (2, 16))
    model(x, x)
    model(x, x)
    stats = model.router_stats()
    for layer in (0, 1):
        loads = [stats[f"moe/load/L{layer}/E{e}"] for e in range(4)]
        assert sum(loads) == pytest.approx(1.0)
    assert stats["moe/dropped"] == 0.0
    assert stats["moe/load_min"] <= 1.0 <= stats["moe/load_max"] <= 4.0
    assert stats["moe/balance_loss"] >= 1.0 - 1e-6  # E * sum f P >= ... ~1 near uniform
    assert model.router_stats() == {}  # reset on read
    model(x, x)
    assert "moe/load/L0/E0" not in model.router_stats(per_expert=False)


def test_stage_raw_router_stats_combine_to_the_model_s():
    """What each pipeline stage sends (raw sums) gives, concatenated, the whole model's metrics."""
    cfg = dataclasses.replace(MOE, num_layers=3)
    model = build_model(cfg, seed=0)
    stages = partition(build_model(cfg, seed=0), 2)
    x = torch.randint(0, 128, (2, 16))
    for _ in range(2):
        model(x, x)
        h, _ = stages[0].forward_with_aux(x)
        stages[1].forward_with_aux(h, x)
    want = model.router_stats()
    parts = [s.raw_router_stats() for s in stages]
    layers = [layer for ls, _ in parts for layer in ls]
    assert [i for i, _ in layers] == [0, 1, 2] and all(len(ls) for ls, _ in parts)
    got = summarize_router_stats(layers, torch.cat([raw.float() for _, raw in parts]))
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k
    assert stages[0].raw_router_stats()[1].abs().sum() == 0  # read resets


def test_param_counter_total_and_active():
    cfg = _cfg(num_layers=3, num_dense_layers=1, num_shared_experts=1)
    counts = count_params(cfg)
    assert counts["total"] == sum(p.numel() for p in Transformer(cfg).parameters())
    expert = 3 * 32 * 16
    assert counts["total"] - counts["active"] == 2 * (4 - 2) * expert  # 2 MoE layers, 2 idle
    dense = count_params(
        dataclasses.replace(cfg, num_experts=0, num_dense_layers=0, num_shared_experts=0)
    )
    assert dense["active"] == dense["total"]
    # FLOPs follow the active parameters: a dense model of the same active size costs the same
    # per token, up to the router matmul
    moe_f = flops_per_token(cpu_moe().model, 64)["forward"]
    dense_f = flops_per_token(cpu_tiny().model, 64)["forward"]
    assert moe_f - dense_f == 2 * 3 * 8 * 96


def test_moe_10b_preset_size():
    counts = count_params(moe_10b().model)
    assert 9.5e9 < counts["total"] < 10.5e9
    assert 1.5e9 < counts["active"] < 2.0e9


def test_split_balances_dense_first_layers_by_flops():
    # dense layers of width 1024 are ~16x costlier than the top-1 MoE layers of width 16
    cfg = _cfg(num_layers=6, num_dense_layers=2, ffn_dim=1024, top_k=1)
    assert block_flops(cfg, 16, 0) > 4 * block_flops(cfg, 16, 5)
    ranges = split_layers(cfg, 2)
    assert ranges[0] == range(0, 1)  # block 0 alone outweighs the rest but one dense block


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"top_k": 5}, "model.top_k"),
        ({"top_k": 0}, "model.top_k"),
        ({"num_dense_layers": 2}, "model.num_dense_layers"),
        ({"num_experts": -1}, "model.num_experts"),
        ({"aux_loss_weight": -0.1}, "model.aux_loss_weight"),
        ({"num_experts": 0, "num_shared_experts": 1}, "model.num_shared_experts"),
    ],
)
def test_moe_config_validation_names_the_field(kw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        _cfg(**kw)
