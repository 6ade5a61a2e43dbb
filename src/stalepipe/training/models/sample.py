"""Sampling text from a model: temperature, top-k, a seeded generator (`stalepipe generate`).

The whole context is recomputed for each new token (no KV cache): what the models stalepipe
trains need, simple enough to check by hand. The context keeps the last `max_seq_len` tokens,
the longest RoPE is computed for.
"""

from __future__ import annotations

import torch
from torch import nn


def next_token(
    logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator
) -> int:
    """One token from a row of logits: the argmax at `temperature` 0, else a draw from
    softmax(logits / temperature) over the `top_k` largest (all when 0)."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt: list[int],
    *,
    max_new_tokens: int,
    max_seq_len: int,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop: int | None = None,
) -> list[int]:
    """The ids `model` (logits (B, T, V) from ids (B, T), in eval mode) continues `prompt` with:
    up to `max_new_tokens`, ending early after `stop` (the document separator). The same
    (model, prompt, settings, seed) gives the same ids."""
    if not prompt:
        raise ValueError("sample needs a prompt of at least one token")
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-max_seq_len:]], device=device)
        logits = model(context)[0, -1].cpu()
        token = next_token(logits, temperature, top_k, generator)
        out.append(token)
        if token == stop:
            break
        ids.append(token)
    return out
