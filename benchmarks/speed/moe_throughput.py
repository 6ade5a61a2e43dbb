"""MoE throughput: training tokens/s of cpu-moe vs the dense preset with the same active
parameters (cpu-tiny: a token's two experts of width 128 hold exactly cpu-tiny's width-256 MLP
parameters; the MoE adds only the routers), and the dispatch against a dense MLP of the same
active width in isolation.

Run: OMP_NUM_THREADS=1 python benchmarks/speed/moe_throughput.py [--steps 30] [--device cpu]

Timing: the contenders live in one process and take turns step by step (round robin), so
machine noise hits them alike; we report median step times and the ratio MoE / dense. Same
batch (train.batch_size x data.seq_len of the preset), AdamW, forward + backward + step.
Equal FLOPs per token (up to the router), so the ratio is the price of routing and dispatch
(sort, gather, one small matmul per expert instead of one large one).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import parser, random_tokens, round_robin, timing_args


def build(preset: str, device: str):
    from stalepipe.presets import get_preset
    from stalepipe.training.models import build_model

    cfg = get_preset(preset)
    model = build_model(cfg.model, seed=0, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return cfg, model, opt


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_step(cfg, model, opt, k: int, device: str) -> float:
    x, y = random_tokens(cfg, k, device)
    sync(device)
    t = time.perf_counter()
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - t


def mlp_step(mlp, x, device: str) -> float:
    sync(device)
    t = time.perf_counter()
    mlp(x).square().mean().backward()
    sync(device)
    return time.perf_counter() - t


def main() -> None:
    from stalepipe.training.models import count_params
    from stalepipe.training.models.layers import SwiGLU
    from stalepipe.training.models.moe import MoE

    ap = parser(__doc__)
    timing_args(ap, steps=30, warmup=3)
    ap.add_argument("--moe", default="cpu-moe")
    ap.add_argument("--dense", default="cpu-tiny")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.manual_seed(0)

    contenders = {name: build(name, args.device) for name in (args.dense, args.moe)}
    times = round_robin(
        contenders, lambda c, k: train_step(*c, k, args.device), args.steps, args.warmup
    )

    print(
        f"training step, {args.device}, threads={torch.get_num_threads()}, median of {args.steps}"
    )
    print(f"{'preset':<10} {'params':>10} {'active':>10} {'step ms':>9} {'tokens/s':>10}")
    tps = {}
    for name, (cfg, _, _) in contenders.items():
        counts = count_params(cfg.model)
        step = statistics.median(times[name])
        tps[name] = cfg.train.batch_size * cfg.data.seq_len / step
        print(
            f"{name:<10} {counts['total']:>10,} {counts['active']:>10,} {step * 1e3:>9.2f} "
            f"{tps[name]:>10,.0f}"
        )
    print(f"ratio tokens/s {args.moe} / {args.dense}: {tps[args.moe] / tps[args.dense]:.2f}")

    # The MLP alone: MoE (E experts of width Fe, top-k) vs a dense SwiGLU of width k * Fe.
    cfg = contenders[args.moe][0].model
    tokens = contenders[args.moe][0].train.batch_size * contenders[args.moe][0].data.seq_len
    moe = MoE(cfg).to(args.device)
    dense = SwiGLU(cfg.dim, cfg.top_k * cfg.expert_hidden_dim).to(args.device)
    x = torch.randn(1, tokens, cfg.dim, device=args.device)
    mlp_times = round_robin(
        {"dense": dense, "moe": moe},
        lambda mlp, k: mlp_step(mlp, x, args.device),
        args.steps,
        args.warmup,
    )
    d, m = (statistics.median(mlp_times[n]) for n in ("dense", "moe"))
    print(
        f"MLP alone, {tokens} tokens, fwd+bwd: dense width {cfg.top_k * cfg.expert_hidden_dim} "
        f"{d * 1e3:.2f} ms, MoE {cfg.num_experts}x{cfg.expert_hidden_dim} top-{cfg.top_k} "
        f"{m * 1e3:.2f} ms, ratio MoE / dense time {m / d:.2f}"
    )


if __name__ == "__main__":
    main()
