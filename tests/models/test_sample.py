"""Sampling: greedy is the argmax, top-k never leaves the k best, a seed fixes the draw."""

import torch

from stalepipe.config import ModelConfig
from stalepipe.training.models import build_model
from stalepipe.training.models.sample import next_token, sample

CFG = ModelConfig(vocab_size=64, dim=32, num_layers=1, num_heads=2, num_kv_heads=1, ffn_dim=32,
                  max_seq_len=8)  # fmt: skip


def test_next_token_by_hand():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    g = torch.Generator().manual_seed(0)
    assert next_token(logits, 0.0, 0, g) == 1
    assert {next_token(logits, 1.0, 2, g) for _ in range(200)} == {1, 3}  # only the 2 best
    assert {next_token(logits, 5.0, 0, g) for _ in range(400)} == {0, 1, 2, 3}


def test_sample_is_deterministic_under_a_seed_and_greedy_is_argmax():
    model = build_model(CFG, seed=1).eval()
    prompt = [3, 5, 7]
    a = sample(model, prompt, max_new_tokens=12, max_seq_len=8, seed=4)
    assert a == sample(model, prompt, max_new_tokens=12, max_seq_len=8, seed=4) and len(a) == 12
    assert a != sample(model, prompt, max_new_tokens=12, max_seq_len=8, seed=5)
    greedy = sample(model, prompt, max_new_tokens=10, max_seq_len=8, temperature=0)
    ids = list(prompt)
    for token in greedy:  # by hand: the argmax of the last position, over the last 8 tokens
        with torch.no_grad():
            assert token == int(model(torch.tensor([ids[-8:]]))[0, -1].argmax())
        ids.append(token)
    stop = greedy[2]
    first = greedy.index(stop)
    short = sample(model, prompt, max_new_tokens=10, max_seq_len=8, temperature=0, stop=stop)
    assert short == greedy[: first + 1]
