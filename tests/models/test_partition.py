"""Partition: every parameter owned exactly once under its global name; stages compose."""

import pytest
import torch

from stalepipe.config import ConfigError, ModelConfig
from stalepipe.presets import smollm_135m
from stalepipe.training.models import build_model, build_stage, partition, split_layers

CFG = ModelConfig(
    vocab_size=128, dim=32, num_layers=6, num_heads=4, num_kv_heads=2, ffn_dim=64, max_seq_len=16
)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 6])
def test_every_parameter_exactly_once_with_global_names(P, tied):
    model = build_model(ModelConfig(**{**CFG.__dict__, "tie_embeddings": tied}), seed=0)
    stages = partition(model, P)
    owned = [(name, p) for s in stages for name, p in s.owned_parameters().items()]
    names = [n for n, _ in owned]
    assert len(names) == len(set(names))
    assert dict(model.named_parameters()).keys() == set(names)
    for name, p in owned:
        assert dict(model.named_parameters())[name] is p  # shared, not copied
    assert "tok_emb.weight" in stages[0].owned_parameters()
    assert "norm.weight" in stages[-1].owned_parameters()
    if not tied:
        assert "lm_head.weight" in stages[-1].owned_parameters()


@pytest.mark.parametrize("P", [1, 2, 3, 6])
def test_stages_compose_to_the_model(P):
    model = build_model(CFG, seed=0)
    x = torch.randint(0, 128, (2, 16))
    h = x
    for stage in partition(model, P):
        h = stage(h, x if stage.spec.is_last else None)
    torch.testing.assert_close(h, model(x, x), rtol=0, atol=0)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("P", [1, 2, 4])
def test_build_stage_equals_the_stage_of_the_whole_model(P, tied):
    """A runtime process builds only its stage: bit for bit the whole model's part, tied
    matrices tied where the stage holds both ends, and the RoPE tables computed."""
    moe = {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "num_dense_layers": 1}
    for cfg in (CFG, ModelConfig(**{**CFG.__dict__, **moe})):
        cfg = ModelConfig(**{**cfg.__dict__, "tie_embeddings": tied})
        whole = partition(build_model(cfg, seed=7), P)
        for s in range(P):
            alone = build_stage(cfg, 7, P, s)
            want, got = dict(whole[s].named_parameters()), dict(alone.named_parameters())
            assert got.keys() == want.keys()
            for name, p in got.items():
                assert torch.equal(p, want[name]), (s, name)
            assert torch.equal(alone.rope.cos, whole[s].rope.cos)
            if tied and P == 1:
                assert alone.lm_head.weight is alone.tok_emb.weight
    assert not torch.equal(build_model(CFG, 7).tok_emb.weight, build_model(CFG, 8).tok_emb.weight)


def test_init_is_the_documented_distribution():
    cfg = ModelConfig(**{**CFG.__dict__, "dim": 256, "ffn_dim": 512, "vocab_size": 512})
    params = dict(build_model(cfg, seed=0).named_parameters())
    assert params["tok_emb.weight"].std().item() == pytest.approx(cfg.init_std, rel=0.02)
    out_proj = params["layers.0.mlp.w2.weight"].std().item()
    assert out_proj == pytest.approx(cfg.init_std / (2 * cfg.num_layers) ** 0.5, rel=0.02)
    assert torch.equal(params["norm.weight"], torch.ones(256))
    assert not torch.equal(params["layers.0.attn.wq.weight"], params["layers.1.attn.wq.weight"])


def test_blocks_contiguous_and_balanced():
    ranges = split_layers(CFG, 3)
    assert [r.start for r in ranges] == [0, 2, 4] and ranges[-1].stop == 6
    big = split_layers(smollm_135m(), 4)
    assert sum(len(r) for r in big) == 30
    assert len(big[-1]) < len(big[0])  # the last stage also carries the large output head


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ConfigError, match="num_stages"):
        split_layers(CFG, 7)


def test_uniform_and_explicit_splits():
    """`pipeline.partition`: uniform gives the first stages the remainder; explicit counts are
    the blocks of each stage; a count list that does not fit is one error naming the fix."""
    L = CFG.num_layers
    uniform = split_layers(CFG, 4, split="uniform")
    assert [len(r) for r in uniform] == [L // 4 + (s < L % 4) for s in range(4)]
    explicit = split_layers(CFG, 2, split=f"1,{L - 1}")
    assert [(r.start, r.stop) for r in explicit] == [(0, 1), (1, L)]
    with pytest.raises(ConfigError, match="needs 2 counts >= 1 adding up"):
        split_layers(CFG, 2, split="1,1")
    model = build_model(CFG, seed=0)
    x = torch.randint(0, 128, (2, 16))
    h = x
    for stage in partition(model, 2, split=f"1,{L - 1}"):
        h = stage(h, x if stage.spec.is_last else None)
    torch.testing.assert_close(h, model(x, x), rtol=0, atol=0)  # any split composes exactly
