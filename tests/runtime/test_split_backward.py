"""The split backward (`runtime.split_backward`) against two plain `autograd.grad` calls: the
input gradient at BI and every weight gradient at BW, bit for bit, on real stages."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stalepipe.config import ModelConfig
from stalepipe.presets import PRESETS
from stalepipe.training.models import build_model, partition
from stalepipe.training.models.partition import Reparametrized
from stalepipe.training.runtime.split_backward import backward_input, backward_weights

CFG = ModelConfig(
    vocab_size=64, dim=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=64,
    max_seq_len=16, tie_embeddings=False,
)  # fmt: skip


def _stage_graph(cfg: ModelConfig, stage: int, num_stages: int = 3):
    """A forward of `stage` at fresh weight leaves: (outputs, their gradients, input, leaves)."""
    torch.manual_seed(0)
    part = partition(build_model(cfg, seed=0), num_stages)[stage]
    leaves = {n: p.detach().clone().requires_grad_() for n, p in part.owned_parameters().items()}
    inp = torch.randn(2, 16, cfg.dim, requires_grad=True)
    targets = torch.randint(cfg.vocab_size, (2, 16)) if stage == num_stages - 1 else None
    out, aux = Reparametrized(part)(leaves, inp, targets)
    outs = [out] + ([aux] if aux is not None else [])
    gouts = [None if targets is not None else torch.randn_like(out)] + [None] * (len(outs) - 1)
    return outs, gouts, inp, leaves


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("stage", [1, 2])  # a middle stage and the last (loss) stage
def test_split_backward_equals_two_plain_calls(stage, moe):
    cfg = CFG
    if moe:
        m = PRESETS["cpu-moe"]().model
        cfg = dataclasses.replace(cfg, num_experts=m.num_experts, top_k=m.top_k,
                                  expert_ffn_dim=32, aux_loss_weight=0.01, z_loss_weight=0.001)  # fmt: skip
    outs, gouts, inp, leaves = _stage_graph(cfg, stage)
    weights = list(leaves.values())
    (want_inp,) = torch.autograd.grad(outs, [inp], grad_outputs=gouts, retain_graph=True)
    want = torch.autograd.grad(
        outs, weights, grad_outputs=gouts, allow_unused=True, retain_graph=True
    )
    got_inp, kept = backward_input(outs, gouts, inp, weights)
    got = backward_weights(kept, weights)
    assert torch.equal(got_inp, want_inp)
    assert len(kept.nodes) > 0
    names = list(leaves)
    for name, g, w in zip(names, got, want, strict=True):
        assert (g is None) == (w is None), name
        assert g is None or torch.equal(g, w), name
