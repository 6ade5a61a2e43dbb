"""A Hugging Face `LlamaForCausalLM` trained by transformers' `Trainer` under sync / 2bw /
2bw+EF. `DelayedTrainer` below is the whole integration: it hands the Trainer a
`DelayedOptimizer` (the Trainer builds its LR schedule on it and steps it through accelerate)
and runs each `training_step` (forward and backward) inside `stale_weights()`.

    python examples/hf_trainer_2bw.py                 # ~10 s on CPU at this tiny size
    python examples/hf_trainer_2bw.py --steps 200 --stages 4
"""

from __future__ import annotations

import argparse
import tempfile
from importlib import resources

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from stalepipe.config import DelayConfig
from stalepipe.delay import DelayedOptimizer, split_stages

ARMS = {"sync": ("sync", False), "2bw": ("2bw", False), "2bw+EF": ("2bw", True)}


class DelayedTrainer(Trainer):
    """A `Trainer` whose optimizer is `delayed` (the Trainer adds its LR scheduler to it):
    each training step's forward and backward run at the weights a pipeline under the delay
    policy would use. Nothing else of the Trainer changes (clipping, logging, accumulation).
    Gradient accumulation enters the block once per micro-step, at the same step's weights."""

    def __init__(self, *args, delayed: DelayedOptimizer, **kwargs) -> None:
        super().__init__(*args, optimizers=(delayed, None), **kwargs)
        self.delayed = delayed

    def training_step(self, model, inputs, num_items_in_batch=None):
        with self.delayed.stale_weights():
            return super().training_step(model, inputs, num_items_in_batch)


def examples(seq: int, n: int, offset: int = 0) -> list[dict[str, torch.Tensor]]:
    text = (resources.files("stalepipe") / "training/data/excerpt/sonnets.txt").read_text()
    ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    return [{"input_ids": c, "labels": c} for c in ids[offset:].split(seq)[:n] if len(c) == seq]


def train(arm: str, args: argparse.Namespace) -> float:
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=args.stages,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=args.seq,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    policy, ef = ARMS[arm]
    base = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    delayed = DelayedOptimizer(
        base, split_stages(model, args.stages), DelayConfig(policy=policy, ef=ef), args.steps
    )
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out,
            max_steps=args.steps,
            per_device_train_batch_size=8,
            learning_rate=args.lr,
            lr_scheduler_type="cosine",
            warmup_steps=args.steps // 10,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            log_level="error",
            seed=0,
        )
        trainer = DelayedTrainer(
            model=model, args=targs, train_dataset=examples(args.seq, 400), delayed=delayed
        )
        trainer.train()
    assert delayed.step_count == args.steps, "the Trainer stepped the delayed optimizer"
    held_out = examples(args.seq, 16, offset=400 * args.seq)
    batch = {k: torch.stack([e[k] for e in held_out]) for k in ("input_ids", "labels")}
    model.eval()
    with torch.no_grad():
        return model(**batch).loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    losses = {arm: train(arm, args) for arm in ARMS}
    print("held-out loss (transformers Trainer, DelayedOptimizer)")
    for arm, loss in losses.items():
        print(f"{arm:<7} {loss:.4f}")


if __name__ == "__main__":
    main()
