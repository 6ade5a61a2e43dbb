"""Model parity: shapes, causal masking, GQA, RoPE, tying, init determinism, counters."""

import math

import pytest
import torch
import torch.nn.functional as F

from stalepipe.config import ModelConfig
from stalepipe.presets import cpu_small, cpu_tiny, smollm_135m, smollm_360m
from stalepipe.training.models import Transformer, build_model, count_params, flops_per_token
from stalepipe.training.models.layers import Attention, Rotary

TINY = ModelConfig(
    vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128, max_seq_len=32
)


def test_logits_shape_and_loss():
    model = build_model(TINY, seed=0)
    x = torch.randint(0, 256, (3, 32))
    assert model(x).shape == (3, 32, 256)
    loss = model(x, torch.randint(0, 256, (3, 32)))
    # a freshly initialised model predicts roughly uniformly
    assert abs(loss.item() - math.log(256)) < 0.1


def test_causal_masking_future_tokens_do_not_matter():
    model = build_model(TINY, seed=0)
    x = torch.randint(0, 256, (2, 20))
    y = x.clone()
    y[:, 10:] = torch.randint(0, 256, (2, 10))
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gqa_equals_attention_with_repeated_kv_heads():
    """GQA through SDPA == explicit softmax attention with each kv head repeated H/Hkv times."""
    torch.manual_seed(0)
    attn = Attention(TINY)
    rope = Rotary(TINY.head_dim, 32, 10000.0)
    x = torch.randn(2, 16, 64)
    B, T, _ = x.shape
    H, Hkv, Dh = 4, 2, 16
    q = rope(attn.wq(x).view(B, T, H, Dh).transpose(1, 2))
    k = rope(attn.wk(x).view(B, T, Hkv, Dh).transpose(1, 2)).repeat_interleave(H // Hkv, dim=1)
    v = attn.wv(x).view(B, T, Hkv, Dh).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(Dh)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    ref = attn.wo((F.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, T, H * Dh))
    torch.testing.assert_close(attn(x, rope), ref, rtol=1e-5, atol=1e-5)


def test_rope_preserves_norm_and_encodes_relative_position():
    rope = Rotary(16, 64, 10000.0)
    q = torch.randn(1, 1, 1, 16).expand(1, 1, 64, 16).contiguous()
    k = torch.randn(1, 1, 1, 16).expand(1, 1, 64, 16).contiguous()
    rq, rk = rope(q), rope(k)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    dots = (rq * rk).sum(-1)[0, 0]  # <R_t q, R_t k> is independent of t
    torch.testing.assert_close(dots, dots[0].expand(64), rtol=1e-4, atol=1e-4)
    shifted = (rq[..., 5:, :] * rk[..., :-5, :]).sum(-1)[0, 0]  # <R_{t+5} q, R_t k> too
    torch.testing.assert_close(shifted, shifted[0].expand(59), rtol=1e-4, atol=1e-4)


def test_tied_and_untied_embeddings():
    tied = build_model(TINY, seed=0)
    assert tied.lm_head.weight is tied.tok_emb.weight
    untied = build_model(ModelConfig(**{**TINY.__dict__, "tie_embeddings": False}), seed=0)
    assert untied.lm_head.weight is not untied.tok_emb.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 256 * 64


def test_same_seed_same_weights_and_rng_untouched():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(TINY, seed=7)
    after = torch.rand(1)
    b = build_model(TINY, seed=7)
    assert torch.equal(before, after)  # building a model does not consume the global RNG
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    c = build_model(TINY, seed=8)
    assert not torch.equal(a.layers[0].attn.wq.weight, c.layers[0].attn.wq.weight)


def test_dropout_in_training_mode_only_and_seeded():
    from stalepipe.training.delay.rng import seeded

    drop = build_model(ModelConfig(**{**TINY.__dict__, "dropout": 0.2}), seed=0)
    plain = build_model(TINY, seed=0)
    x = torch.randint(0, 256, (2, 16))
    drop.eval()
    assert torch.equal(drop(x, x), plain(x, x))  # eval: no dropout
    drop.train()
    cpu = torch.device("cpu")
    with seeded(1, cpu):
        a = drop(x, x)
    with seeded(1, cpu):
        b = drop(x, x)
    with seeded(2, cpu):
        c = drop(x, x)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, plain(x, x))


def test_no_biases():
    model = build_model(TINY, seed=0)
    assert not any(name.endswith(".bias") for name, _ in model.named_parameters())


@pytest.mark.parametrize(
    "cfg",
    [TINY, cpu_tiny().model, cpu_small().model, smollm_135m(), smollm_360m()],
    ids=["tiny", "cpu-tiny", "cpu-small", "135m", "360m"],
)
def test_param_counter_matches_module(cfg):
    counts = count_params(cfg)
    if cfg.dim <= 256:
        model = Transformer(cfg)
        assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["total"] == counts["embedding"] + counts["head"] + counts["non_embedding"]


def test_published_smollm_sizes():
    # HuggingFaceTB reports 134.5M and 361.8M parameters (tied, vocab 49152)
    assert abs(count_params(smollm_135m())["total"] / 1e6 - 134.5) < 0.2
    assert abs(count_params(smollm_360m())["total"] / 1e6 - 361.8) < 0.2


def test_cpu_presets_sizes():
    assert 0.25e6 < count_params(cpu_tiny().model)["total"] < 0.4e6
    assert 2.5e6 < count_params(cpu_small().model)["total"] < 3.5e6


def test_flops_close_to_6n_rule():
    cfg = smollm_135m()
    f = flops_per_token(cfg, seq_len=2048)
    n = count_params(cfg)["non_embedding"] + cfg.vocab_size * cfg.dim  # head matmul counts
    assert f["total"] == 3 * f["forward"]
    assert 6 * n < f["total"] < 6 * n * 1.5  # attention adds on top of 6N
