"""The runtime's fast paths against the obvious references they replace (docs/design.md, 'Style',
rule 6): `Reparametrized` vs `torch.func.functional_call`, `seeded` vs `fork_rng` + `manual_seed`.
In-process; the multi-process tests check the whole runtime bit for bit on top."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from stalepipe.config import ModelConfig
from stalepipe.training.delay.rng import seeded
from stalepipe.training.models import build_model, partition
from stalepipe.training.models.partition import Reparametrized


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("P", [1, 2])
def test_reparametrized_equals_functional_call(P, tied):
    cfg = ModelConfig(
        vocab_size=64,
        dim=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_dim=64,
        max_seq_len=8,
        tie_embeddings=tied,
    )
    model = build_model(cfg, seed=0)
    x = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(1))
    y = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(2))
    h = x
    for stage in partition(model, P):
        last = stage.spec.is_last
        params = dict(stage.named_parameters())
        before = {n: p for n, p in params.items()}
        # Another version of the weights (what a stale step reads); P=1 tied: one tensor
        # serves both ends, under its first name only.
        weights = {n: (p.detach() * 1.01).requires_grad_() for n, p in params.items()}
        inp = h if stage.spec.is_first else h.detach().requires_grad_()
        targets = y if last else None
        out, aux = Reparametrized(stage)(weights, inp, targets)
        ref = functional_call(stage, weights, (inp, targets) if last else (inp,))
        assert aux is None and torch.equal(out, ref)
        leaves = list(weights.values())
        g_out = None if last else torch.ones_like(out)
        got = torch.autograd.grad(out, leaves, g_out, retain_graph=True, allow_unused=True)
        want = torch.autograd.grad(ref, leaves, g_out, allow_unused=True)
        for n, a, b in zip(weights, got, want, strict=True):
            assert (a is None and b is None) or torch.equal(a, b), n
        assert all(p is before[n] for n, p in stage.named_parameters())  # restored
        h = out


def testseeded_equals_fork_rng_manual_seed():
    torch.manual_seed(123)
    outer = torch.get_rng_state()
    with seeded(42, torch.device("cpu")):
        fast = torch.rand(5)
    assert torch.equal(torch.get_rng_state(), outer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(42)
        ref = torch.rand(5)
    assert torch.equal(fast, ref) and torch.equal(torch.get_rng_state(), outer)
