"""Emulator throughput check: sync vs 2bw vs 2bw+EF, tokens/s, MFU and peak memory, one table.

On a GPU: smollm-135m, bf16 autocast, the packaged excerpt with the GPT-2 tokenizer (no network
needed). On a CPU (`--reduced`, or automatically without CUDA): cpu-small, float32, a few steps,
so the script itself is tested everywhere.

    python benchmarks/gpu_check.py [--steps 30] [--reduced] [--compile]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from stalepipe.config import apply_overrides
from stalepipe.presets import get_preset
from stalepipe.train.loop import train
from stalepipe.train.metrics import read_metrics

VARIANTS = {
    "sync": {"delay.policy": "sync"},
    "2bw": {"delay.policy": "2bw", "pipeline.num_stages": "4"},
    "2bw+EF": {"delay.policy": "2bw", "delay.ef": "true", "pipeline.num_stages": "4"},
}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reduced", action="store_true", help="CPU-sized check (default without CUDA)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.reduced
    if cuda:
        base = get_preset("smollm-135m")
        common = {
            "data.corpus": "excerpt",
            "data.tokenizer": "gpt2",
            "train.batch_size": "32",
            "train.num_microbatches": "4",
            "train.device": "cuda",
            "train.dtype": "bfloat16",
        }
    else:
        base = get_preset("cpu-small")
        common = {"data.corpus": "excerpt", "train.batch_size": "8"}
        args.steps = min(args.steps, 6)
    common |= {
        "train.num_steps": str(args.steps),
        "train.log_every": str(args.steps),
        "train.eval_every": "0",
        "train.num_eval_batches": "1",
        "train.warmup_steps": "2",
        "train.progress": "false",
        "train.compile": str(args.compile),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in VARIANTS.items():
            cfg = apply_overrides(
                base, {**common, **overrides, "name": name.replace("+", "_"), "out_dir": tmp}
            )
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            result = train(cfg, verbose=False)
            last = [r for r in read_metrics(result.run_dir) if "tokens_per_s" in r][-1]
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
            rows.append(
                (
                    name,
                    last["tokens_per_s"],
                    last.get("mfu", float("nan")),
                    peak,
                    result.final_train_loss,
                )
            )
    device = torch.cuda.get_device_name() if cuda else "cpu (reduced mode)"
    print(f"{base.name} on {device}, {args.steps} steps, compile={args.compile}")
    print(f"{'variant':<10}{'tokens/s':>14}{'MFU':>8}{'peak GiB':>10}{'vs sync':>9}{'loss':>9}")
    for name, tps, mfu, peak, loss in rows:
        print(
            f"{name:<10}{tps:>14,.0f}{mfu:>8.3f}{peak:>10.2f}{tps / rows[0][1]:>9.3f}{loss:>9.4f}"
        )


if __name__ == "__main__":
    main()
