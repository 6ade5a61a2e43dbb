"""The split backward of zero-bubble schedules against a full backward, on one stage.

    python benchmarks/speed/split_backward.py [--dim 256] [--repeats 21]

One middle stage of pipeline_throughput.py's model (a quarter of 4 blocks, 8x64 tokens per
microbatch, one thread). Times, median of `--repeats` fresh graphs each:
- full: one `autograd.grad` for the input and every weight (what B does);
- two calls: the input, then the weights, over the same retained graph (what BI + BW did
  before `runtime.split_backward`);
- split: `backward_input` then `backward_weights` (what BI + BW do now), with BI alone and the
  graph walk that finds the weight branches beside it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.autograd.graph import get_gradient_edge

from stalepipe.config import ModelConfig
from stalepipe.training.models import build_model, partition
from stalepipe.training.models.partition import Reparametrized
from stalepipe.training.runtime.split_backward import (
    _weight_branches,
    backward_input,
    backward_weights,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import parser, pin_threads, timing_args


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--dim", type=int, default=256)
    timing_args(ap, repeats=21)
    args = ap.parse_args()
    pin_threads(1)
    cfg = ModelConfig(
        vocab_size=256, dim=args.dim, num_layers=4, num_heads=8, num_kv_heads=4,
        ffn_dim=int(args.dim * 8 / 3) // 8 * 8, max_seq_len=64, tie_embeddings=False,
    )  # fmt: skip
    stage = partition(build_model(cfg, seed=0), 4)[1]
    run_at = Reparametrized(stage)

    def graph():
        leaves = {
            n: p.detach().clone().requires_grad_() for n, p in stage.owned_parameters().items()
        }
        inp = torch.randn(8, 64, args.dim, requires_grad=True)
        out, _ = run_at(leaves, inp, None)
        return [out], [torch.randn_like(out)], inp, list(leaves.values())

    def median_ms(fn) -> float:
        times = []
        for _ in range(args.repeats):
            outs, gouts, inp, weights = graph()
            t = time.perf_counter()
            fn(outs, gouts, inp, weights)
            times.append(time.perf_counter() - t)
        return 1e3 * sorted(times)[len(times) // 2]

    def two_calls(outs, gouts, inp, weights):
        torch.autograd.grad(outs, [inp], gouts, retain_graph=True)
        torch.autograd.grad(outs, weights, gouts)

    def split(outs, gouts, inp, weights):
        _, kept = backward_input(outs, gouts, inp, weights)
        backward_weights(kept, weights)

    def walk(outs, gouts, inp, weights):
        _weight_branches([outs[0].grad_fn], get_gradient_edge(inp).node, weights)

    rows = {
        "full backward": median_ms(lambda o, g, i, w: torch.autograd.grad(o, [*w, i], g)),
        "two calls (before)": median_ms(two_calls),
        "split (BI + BW)": median_ms(split),
        "  BI alone": median_ms(lambda o, g, i, w: backward_input(o, g, i, w)),
        "  graph walk": median_ms(walk),
    }
    print(f"one stage of {cfg.num_layers // 4} block(s), dim {args.dim}, 8x64 tokens, 1 thread")
    for name, ms in rows.items():
        print(f"  {name:<20}{ms:>8.2f} ms")


if __name__ == "__main__":
    main()
