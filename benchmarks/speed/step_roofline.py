"""How close a study's training step comes to this core's matmul rate, and where its time goes.

For cpu-regime (0.43M; the overhead ladder's width 96 has the same shape) and the overhead
ladder's widths 48, 64 and 136 (`studies/overhead_ladder.py` `overhead_rung`), with AdamW and
Muon at the scale's LRs, and the three arms sync, 2bw and 2bw+EF: one full training step as
`train.emulated.EmulatorEngine.steps` runs it (LR, forward and backward through
`delay.DelayEmulator`, gradient clipping, the delayed optimizer step, the LR read back), timed
step by step with the contenders in turns (the machine is shared), on one thread. Printed per
contender: the median step time, the achieved model FLOP/s (`models.flops_per_token`, backward
= 2x forward, causal attention counted at half) and its fraction of the fp32 matmul rate
measured in the same run at that model's GEMM shapes (every linear layer's forward, input-
gradient and weight-gradient products at B*T rows, weighted by their FLOPs, best of
`--gemm-repeats`); and the split of a step's time from torch.profiler (`--profile-steps`
steps per contender, after the timed ones):

    gemm   matrix products (mm, addmm, bmm; each ATen op's own time) outside the optimizer
    attn   every ATen op in scaled_dot_product_attention and its backward
    elem   every other ATen op outside the optimizer and the delay step (norms, RoPE,
           SwiGLU, cross-entropy, copies, the gradient norm and clipping)
    optim  the base optimizer's `step()` (inclusive: Muon's Newton-Schulz products are here)
    delay  the delayed step outside the base optimizer (versions, EF), inclusive
    py     the rest of the profiled step's wall time: Python, dispatch, autograd's engine

The profiler's own cost inflates small ops, so the split is of the profiled time (shares),
while the step times and FLOP/s come from the unprofiled steps. Batches are random tokens (the
data loader is not timed: it is a slice of a memory-mapped array).

    OMP_NUM_THREADS=1 python benchmarks/speed/step_roofline.py [--steps 6] [--warmup 2]
        [--profile-steps 2] [--widths 48 64 136] [--optims adamw muon]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from stalepipe.config import ExperimentConfig, apply_overrides
from stalepipe.lab.studies.overhead_ladder import OVERHEAD_LR, overhead_rung
from stalepipe.lab.studies.scales import LRS, base_config
from stalepipe.training.delay import DelayEmulator, DelaySchedule
from stalepipe.training.models import build_model, compile_blocks, flops_per_token
from stalepipe.training.optim import build_optimizer
from stalepipe.training.optim.lr_schedule import apply_lr, lr_multiplier

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import parser, pin_threads, print_load, random_tokens, round_robin

ARMS = {"sync": {"delay.policy": "sync"}, "2bw": {"delay.policy": "2bw"},
        "2bw+ef": {"delay.policy": "2bw", "delay.ef": "true"}}  # fmt: skip
CATEGORIES = ("gemm", "attn", "elem", "optim", "delay", "py")
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


def scale_config(width: int | None, optim: str, arm: str, extra: dict | None = None):
    """cpu-regime (`width` None) or the overhead ladder's rung at `width` (1x its budget),
    with `optim` at its LR there (the scale's tuned LR; the ladder's Muon LR) and `arm`."""
    cfg = base_config("cpu-regime")
    o = {"optim.name": optim, "optim.lr": LRS["cpu-regime"][optim], **ARMS[arm]}
    if width is not None:
        o |= {k: v for k, v in overhead_rung(width, 1.0)[1].items() if not k.startswith("data.")}
        o |= {"optim.lr": OVERHEAD_LR} if optim == "muon" else {}
    return apply_overrides(cfg, o | (extra or {}))


class StudyStep:
    """One training run's state and its step, as `EmulatorEngine.steps` computes it (no
    data loader, no metrics): `step()` trains the next step on a fixed random batch."""

    def __init__(self, cfg: ExperimentConfig, compile_model: bool = False) -> None:
        tc = cfg.train
        self.cfg = cfg
        self.model = build_model(cfg.model, tc.seed)
        if compile_model:  # what train.compile does
            compile_blocks(self.model)
        self.optimizer = build_optimizer(cfg.optim, self.model.named_parameters())
        delay = DelaySchedule.build(cfg.delay, cfg.pipeline.num_stages, tc.num_steps, train=tc)
        self.emulator = DelayEmulator(
            self.model, self.optimizer, cfg.delay, delay=delay, seq_len=cfg.data.seq_len
        )
        self.batch = random_tokens(cfg, 0)
        self.k = 0
        self.losses: list[float] = []

    def step(self) -> None:
        tc, k = self.cfg.train, self.k
        apply_lr(self.optimizer, lr_multiplier(k, tc))
        loss = self.emulator.forward_backward(k, [self.batch])
        if tc.grad_clip > 0:
            self.emulator.clip_grad_norm_(tc.grad_clip)
        with torch.profiler.record_function("delay"):
            self.emulator.step(k)
        self.optimizer.param_groups[0]["lr"]
        self.losses.append(loss)
        self.k += 1

    def timed(self) -> float:
        t0 = time.perf_counter()
        self.step()
        return time.perf_counter() - t0


def gemm_shapes(cfg: ExperimentConfig) -> list[tuple[int, int, int]]:
    """(rows, inner, cols) of every matrix product of the model's linear layers in one step:
    forward x W^T, input gradient dY W, weight gradient dY^T X, at B*T rows."""
    m = cfg.model
    rows = cfg.train.batch_size * cfg.data.seq_len
    kv = m.num_kv_heads * m.head_dim
    linears = [
        (m.dim, m.dim),
        (m.dim, kv),
        (m.dim, kv),
        (m.dim, m.dim),
        (m.dim, m.ffn_dim),
        (m.dim, m.ffn_dim),
        (m.ffn_dim, m.dim),
    ] * m.num_layers
    linears.append((m.dim, m.vocab_size))  # fmt: skip
    out = []
    for d_in, d_out in linears:
        out += [(rows, d_in, d_out), (rows, d_out, d_in), (d_out, rows, d_in)]
    return out


def matmul_rate(shapes: list[tuple[int, int, int]], repeats: int) -> float:
    """FLOP/s of fp32 `torch.mm` over `shapes` (their FLOPs over their summed best times)."""
    flops, seconds = 0.0, 0.0
    for (r, k, c), n in Counter(shapes).items():
        a, b = torch.randn(r, k), torch.randn(k, c)
        best = min(_time(torch.mm, a, b) for _ in range(repeats))
        flops += 2 * r * k * c * n
        seconds += best * n
    return flops / seconds


def _time(fn: Callable[..., object], *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def square_rate(n: int = 512, repeats: int = 5) -> float:
    """The core's fp32 matmul rate on a large square product (its practical peak)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / min(_time(torch.mm, a, b) for _ in range(repeats))


def profile_split(run: StudyStep, steps: int) -> dict[str, float]:
    """Shares of `steps` profiled steps' time by category (module docstring)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            run.step()
        wall = (time.perf_counter() - t0) * 1e6
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for ev in prof.events():
        cat = _category(ev)
        if cat == "range":
            if ev.name == "delay":
                totals["delay"] += ev.cpu_time_total
            elif not _under(ev, "Optimizer.step#"):  # the base step, inside the delayed one
                totals["optim"] += ev.cpu_time_total
                totals["delay"] -= ev.cpu_time_total
        elif cat in totals:
            totals[cat] += ev.self_cpu_time_total
    totals["py"] = max(wall - sum(totals.values()), 0.0)
    return {k: v / wall for k, v in totals.items()}


def _under(ev, prefix: str) -> bool:
    p = ev.cpu_parent
    while p is not None:
        if p.name.startswith(prefix):
            return True
        p = p.cpu_parent
    return False


def _category(ev) -> str | None:
    """The category of a profiler event's own time: "range" for the delay step and the base
    optimizer's (counted inclusively), "inside" for what runs within them, None for wrapper
    events (their time is the rest: Python and dispatch)."""
    if ev.name == "delay" or ev.name.startswith("Optimizer.step#"):
        return "range"
    names = []
    p = ev.cpu_parent
    while p is not None:
        names.append(p.name)
        p = p.cpu_parent
    if any(n.startswith("Optimizer.step#") or n == "delay" for n in names):
        return "inside"  # counted inclusively through its range
    if any("scaled_dot_product" in n or "ScaledDotProduct" in n for n in [ev.name, *names]):
        return "attn" if ev.name.startswith("aten::") else None
    if not ev.name.startswith("aten::"):
        return None
    return "gemm" if ev.name in GEMM_OPS else "elem"


def sdpa_backend() -> str:
    """Which kernel SDPA runs on this CPU for the study's shapes (what the profiler names)."""
    q = torch.randn(16, 4, 128, 24, requires_grad=True)
    kv = torch.randn(16, 2, 128, 24)
    with torch.profiler.profile() as prof:
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True).sum().backward()
    names = {e.name for e in prof.events() if "attention" in e.name}
    return ", ".join(sorted(n for n in names if not n.startswith("aten::scaled_dot")))


def main() -> None:
    ap = parser(__doc__, whole=True)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per contender")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per contender")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--gemm-repeats", type=int, default=5)
    ap.add_argument("--widths", type=int, nargs="*", default=[48, 64, 136])
    ap.add_argument("--optims", nargs="*", default=["adamw", "muon"])
    ap.add_argument("--arms", nargs="*", default=list(ARMS))
    args = ap.parse_args()
    pin_threads(1)
    print_load("before")
    print(f"torch {torch.__version__}, 1 thread; SDPA kernel here: {sdpa_backend()}; fp32 mm "
          f"512^3: {square_rate() / 1e9:.1f} GFLOP/s")  # fmt: skip
    header = (f"{'model':<11} {'optim':<6} {'arm':<7} {'step ms':>8} {'GFLOP/s':>8} "
              f"{'mm GF/s':>8} {'of mm':>6}  " + " ".join(f"{c:>5}" for c in CATEGORIES))  # fmt: skip
    print(header)
    for width in [None, *args.widths]:
        label = "cpu-regime" if width is None else f"d{width}"
        runs = {
            (o, a): StudyStep(scale_config(width, o, a)) for o in args.optims for a in args.arms
        }
        cfg = next(iter(runs.values())).cfg
        mm = matmul_rate(gemm_shapes(cfg), args.gemm_repeats)
        times = round_robin(runs, lambda r, _: r.timed(), args.steps, args.warmup)
        flops = flops_per_token(cfg.model, cfg.data.seq_len)["total"]
        tokens = cfg.train.batch_size * cfg.data.seq_len
        for (optim, arm), run in runs.items():
            t = statistics.median(times[optim, arm])
            split = profile_split(run, args.profile_steps)
            rate = flops * tokens / t
            shares = " ".join(f"{split[c]:5.0%}" for c in CATEGORIES)
            print(f"{label:<11} {optim:<6} {arm:<7} {t * 1e3:8.1f} {rate / 1e9:8.1f} "
                  f"{mm / 1e9:8.1f} {rate / mm:6.0%}  {shares}", flush=True)  # fmt: skip
    print_load("after")


if __name__ == "__main__":
    main()
