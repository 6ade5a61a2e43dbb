"""split_stages: the same parameter-to-stage assignment as the emulator's split (our
Transformer, an HF LlamaForCausalLM), and DelayedOptimizer over it trains as the emulator."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stalepipe.config import ConfigError, DelayConfig
from stalepipe.config.shapes import block_flops, head_flops
from stalepipe.training.delay import DelayedOptimizer, DelayEmulator, split_stages, tied
from stalepipe.training.models import build_model, partition, split_layers

from .conftest import make_batches, tiny_model_cfg

T = 5


def assignment(owned, shared):
    """Per stage the ids of the parameters it owns, and (stage, owner, param id) of each read."""
    return [[id(p) for p in ps.values()] for ps in owned], [
        (u.stage, u.owner, id(u.param)) for u in shared
    ]


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_transformer_split_is_the_emulators(num_stages):
    cfg = tiny_model_cfg(num_layers=4, tie=True)
    model = build_model(cfg, seed=0)
    owned, shared = tied.find_shared(partition(model, num_stages))
    flops = [block_flops(cfg, cfg.max_seq_len, i) for i in range(cfg.num_layers)]
    split = split_stages(model, num_stages, blocks="layers", cost=flops, extra=(0, head_flops(cfg)))
    assert [list(ps) for ps in split.params] == [list(ps) for ps in owned]  # names and order
    assert assignment(split.params, split.shared) == assignment(owned, shared)
    assert split.blocks == split_layers(cfg, num_stages)
    counts = [len(r) for r in split_layers(cfg, num_stages)]
    by_count = split_stages(model, num_stages, counts=counts)  # the block list found by itself
    assert assignment(by_count.params, by_count.shared) == assignment(owned, shared)
    assert split.shared_with == ({0: {num_stages - 1}} if num_stages > 1 else {})


@pytest.mark.parametrize(
    "policy,ef", [("2bw", True), ("pipedream", False), ("wpipe", True)], ids=str
)
def test_delayed_optimizer_over_the_split_trains_as_the_emulator(policy, ef):
    """Tied embeddings: under pipedream and wpipe the head reads another version than its
    owner, so the split's tie is untied for the step, as the emulator unties it."""
    cfg = tiny_model_cfg(num_layers=4, tie=True)
    delay_cfg = DelayConfig(policy=policy, ef=ef)
    counts = [len(r) for r in split_layers(cfg, 4)]
    model = build_model(cfg, seed=0)
    opt = DelayedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        split_stages(model, 4, counts=counts),
        delay_cfg,
        T,
    )
    ref_model = build_model(cfg, seed=0)
    engine = DelayEmulator(
        ref_model, torch.optim.AdamW(ref_model.parameters(), lr=3e-3), delay_cfg, 4, T
    )
    for k in range(T):
        ((x, y),) = make_batches(k, num_microbatches=1)
        with opt.stale_weights():
            loss = model(x, y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == engine.forward_backward(k, [(x, y)]), k
        engine.step(k)
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b), name


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class CausalLM(nn.Module):
    """`model(x, y)` -> loss, as the emulator calls a model."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.hf(x, labels=y).loss


def test_hf_llama_split_is_the_emulators_and_trains_as_it():
    hf, ref = tiny_llama(), tiny_llama()
    split = split_stages(hf, 2)  # model.layers found, balanced by parameters
    assert split.blocks == [range(0, 2), range(2, 4)]
    assert split.modules[0][0] == "model.embed_tokens" and split.modules[1][-1] == "lm_head"
    by_names = split_stages(
        hf, names=[["model.embed_tokens", "model.layers.0", "model.layers.1"], ["model", "lm_head"]]
    )
    assert assignment(by_names.params, by_names.shared) == assignment(split.params, split.shared)
    # the emulator's split of the same model: stage modules by hand, owned by its rule
    m = ref.model
    stages = [
        nn.ModuleList([m.embed_tokens, *m.layers[:2]]),
        nn.ModuleList([*m.layers[2:], m.norm, m.rotary_emb, ref.lm_head]),
    ]
    owned, shared = tied.find_shared(stages)
    ids = {id(p): n for n, p in ref.named_parameters()}
    names = [[ids[id(p)] for p in ps.values()] for ps in owned]
    assert [list(ps) for ps in split.params] == names
    assert [(u.stage, u.owner) for u in split.shared] == [(u.stage, u.owner) for u in shared]

    delay_cfg = DelayConfig(policy="pipedream", ef=True)
    opt = DelayedOptimizer(torch.optim.AdamW(hf.parameters(), lr=1e-2), split, delay_cfg, T)
    engine = DelayEmulator(
        CausalLM(ref), torch.optim.AdamW(ref.parameters(), lr=1e-2), delay_cfg, 2, T, stages=stages
    )
    for k in range(T):
        ((x, y),) = make_batches(k, num_microbatches=1)
        with opt.stale_weights():
            loss = hf(x, labels=y).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == engine.forward_backward(k, [(x, y)]), k
        engine.step(k)


def test_bad_splits_name_the_fix():
    model = build_model(tiny_model_cfg(num_layers=2), seed=0)
    with pytest.raises(ConfigError, match="1 <= num_stages <= 2 blocks"):
        split_stages(model, 3)
    with pytest.raises(ConfigError, match="in no stage; list it"):
        split_stages(model, names=[["tok_emb"], ["layers"]])
    with pytest.raises(ConfigError, match="has no module 'layer'"):
        split_stages(model, names=[["tok_emb", "layer"], [""]])
    with pytest.raises(ConfigError, match="counts=.* adding up to 2"):
        split_stages(model, 2, counts=[2, 1])
    with pytest.raises(ConfigError, match="not an nn.ModuleList"):
        split_stages(model, 2, blocks="norm")
    with pytest.raises(ConfigError, match="one per block"):
        split_stages(model, 2, cost=[1.0])
    split = split_stages(model, names=[["tok_emb", "layers.0"], [""]])  # "": everything else
    assert split.stage_of("layers.1.attn.wq.weight") == 1 and split.stage_of("tok_emb.weight") == 0
