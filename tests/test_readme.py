"""The README's code must run as written."""

import re
from pathlib import Path

import torch

from stalepipe.config import ModelConfig
from stalepipe.models import build_model

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_user_loop_example_runs_and_trains():
    text = README.read_text()
    snippet = re.search(
        r"To add a delay to your own training loop:\n\n```python\n(.*?)```", text, re.S
    )
    assert snippet, "README lost its user-loop example"
    model = build_model(
        ModelConfig(
            vocab_size=64,
            dim=32,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            ffn_dim=64,
            max_seq_len=16,
        ),
        seed=0,
    )
    batch = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))

    def next_batch(step):
        return batch, batch

    namespace = {"torch": torch, "model": model, "next_batch": next_batch, "steps": 20}
    exec(compile(snippet.group(1), "README.md", "exec"), namespace)  # noqa: S102
    opt = namespace["opt"]
    assert opt.step_count == 20
    assert model(batch, batch).item() < 3.5  # it learned the fixed batch (log 64 = 4.16 at init)
