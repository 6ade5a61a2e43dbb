"""Several seeds of one configuration trained as one batched model, against today's engine
training them one after the other: runs per core-hour, and whether each seed's numbers stay the
solo run's (issue 55).

Studies train 3 seeds of every configuration; the seeds differ only in their initial weights
and their data order. Here S seeds' parameters are stacked along a leading dimension ([S, *shape]
per parameter, each seed's slice initialised as `build_model(cfg, seed)` initialises it) and one
step trains all of them:

    forward     `BatchedTransformer`: our Transformer's function per seed, every linear layer
                one `bmm` over the seeds (`_SeedLinear`, whose backward makes the products
                torch's `F.linear` backward makes for one seed), attention one
                `scaled_dot_product_attention` over S x 16 sequences, norms and RoPE
                broadcast; the loss per seed (one `cross_entropy` per seed), their sum
                backpropagated (each seed's gradient is its own loss's)
    clipping    per seed: `clip_grad_norm_`'s global norm of each seed's slices
    optimizer   AdamW: torch's fused AdamW over the stacked tensors (elementwise, so per seed);
                Muon: `BatchedMuon`, Newton-Schulz as batched products over the seeds, its AdamW
                part unchanged (elementwise); groups and hyperparameters are the ones
                `build_optimizer` gives one seed
    delay       the engine's own `DelayedOptimizer` over the stacked tensors (one stage, as the
                studies' P = 1): 2bw keeps the stale version and computes the gradient there,
                EF applies W+ = W - 2U_k + U_{k-1}, both elementwise, so per seed

Today's engine (`step_roofline.StudyStep`: LR, `DelayEmulator.forward_backward`, clipping, the
delayed step) trains each seed alone. Both train the same seeds on the same batches (seed s's
batch at step k: `random_tokens(cfg, 1000 s + k % 4)`), all contenders in turns, one step each
per round, on one thread. Printed per (scale, optimizer, arm) and batch size S:

    solo ms     the median step of one seed trained alone (today's engine)
    batched ms  the median step of S seeds as one model
    runs/core-h S x (solo step time) / (batched step time), read per round (S solo steps and one
                batched step of the same round) as median [range]: the runs per core-hour the
                batched model gives against today's engine (evaluations and start-up left out)
    exact       whether every seed's train loss at every step, and its weights after the last,
                equal the solo run's bit for bit ("yes"), else the largest difference in loss

`--profile-steps N` then profiles N more steps of seed 0 alone and of the largest batch, per
(optimizer, arm), and prints each step's time per seed by `step_roofline.py`'s categories (gemm,
attn, elem, optim, delay, py: that script's docstring defines them), in ms: the profiled split
applied to the median unprofiled step, so where batching saves time and where it does not.

`--check-steps N` then trains N steps of S = max(--sizes) seeds both ways at the first scale
(no timing) and prints, per (optimizer, arm), the first step whose losses differ and the
largest |loss difference| over the N steps.

    OMP_NUM_THREADS=1 python benchmarks/speed/batched_seeds.py [--rounds 5] [--warmup 1]
        [--sizes 2 3 4] [--widths 64 136] [--skip-regime] [--optims adamw muon]
        [--arms sync 2bw 2bw+ef] [--profile-steps 0] [--check-steps 0] [--quick]

`--quick`: a tiny model (width 32, 2 blocks, 32 tokens, 4 sequences) for tests.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from stalepipe.config import ExperimentConfig, apply_overrides
from stalepipe.training.delay import DelayedOptimizer, DelaySchedule
from stalepipe.training.models import Transformer, build_model
from stalepipe.training.optim import build_optimizer
from stalepipe.training.optim.lr_schedule import apply_lr, lr_multiplier
from stalepipe.training.optim.muon import NS_COEFFS, NS_EPS, Muon, lr_scale

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import median_range, parser, pin_threads, print_load, random_tokens
from benchmarks.speed.step_roofline import (
    ARMS,
    CATEGORIES,
    StudyStep,
    profile_split,
    scale_config,
)

DISTINCT_BATCHES = 4  # batches per seed, cycled (the loader is not what is timed)
QUICK = {
    "model.dim": "32",
    "model.num_layers": "2",
    "model.ffn_dim": "96",
    "model.max_seq_len": "32",
    "data.seq_len": "32",
    "train.batch_size": "4",
}


def seed_config(cfg: ExperimentConfig, seed: int) -> ExperimentConfig:
    """`cfg` for seed `seed` (its initial weights; its batches are `seed_batch`'s)."""
    return apply_overrides(cfg, {"train.seed": str(seed)})


def seed_batch(cfg: ExperimentConfig, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seed `seed`'s batch at `step`: its own data order, the same in both engines."""
    return random_tokens(cfg, 1000 * seed + step % DISTINCT_BATCHES)


# ---------------------------------------------------------------------------------------------
# The batched model
# ---------------------------------------------------------------------------------------------


class _SeedLinear(torch.autograd.Function):
    """x [S, N, in] times each seed's w [S, out, in] transposed: one `bmm` for all seeds.

    The backward makes the products torch's `F.linear` makes for one seed: dX = dY W, and
    dW = dY^T X computed as such (torch's `mm_mat2_backward` computes it so because `F.linear`'s
    second operand is the transposed weight), not bmm's own rule (X^T dY)^T, which rounds
    differently."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return torch.bmm(x, w.mT)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        dx = torch.bmm(grad, w) if ctx.needs_input_grad[0] else None
        dw = torch.bmm(grad.mT, x) if ctx.needs_input_grad[1] else None
        return dx, dw


def seed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`F.linear(x[s], w[s])` for every seed s, as one batched product."""
    return _SeedLinear.apply(x, w)


class BatchedTransformer(nn.Module):
    """S seeds of one `Transformer` config as one module: parameter `name` of seed s is
    `self.param(name)[s]`, initialised from `models[s]` (so `build_model(cfg, seed)` per seed);
    `forward(idx [S, B, T], targets [S, B, T])` returns the S training losses, seed s's equal to
    `models[s](idx[s], targets[s])` (dense models without dropout; the test checks it).

    Not for MoE models or dropout (refused): the studies' models have neither."""

    def __init__(self, models: Sequence[Transformer]) -> None:
        super().__init__()
        cfg = models[0].cfg
        if cfg.num_experts or cfg.dropout:
            raise ValueError("BatchedTransformer is dense and without dropout")
        self.cfg, self.num_seeds = cfg, len(models)
        self.names = [name for name, _ in models[0].named_parameters()]  # tied: listed once
        self.stacked = nn.ParameterList(
            nn.Parameter(torch.stack([dict(m.named_parameters())[n].detach() for m in models]))
            for n in self.names
        )
        self._index = {n: i for i, n in enumerate(self.names)}
        self.rope = models[0].rope  # the same tables for every seed

    def param(self, name: str) -> nn.Parameter:
        """The stacked parameter [S, *shape] the solo model calls `name`."""
        if name == "lm_head.weight" and self.cfg.tie_embeddings:
            name = "tok_emb.weight"
        return self.stacked[self._index[name]]

    def named_stacked(self) -> dict[str, nn.Parameter]:
        """Solo name -> stacked parameter, in the solo model's parameter order."""
        return {n: self.stacked[i] for i, n in enumerate(self.names)}

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        xf = x.float()  # RMSNorm, as layers.RMSNorm computes it per seed
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)
        return xf.type_as(x) * self.param(name).unsqueeze(1)

    def _attention(self, h: torch.Tensor, i: int, batch: int) -> torch.Tensor:
        c, p = self.cfg, f"layers.{i}.attn."
        S, N, _ = h.shape
        T = N // batch

        def heads(name: str, n: int) -> torch.Tensor:  # (S * B, n, T, Dh)
            return seed_linear(h, self.param(p + name)).view(S * batch, T, n, c.head_dim).transpose(1, 2)  # fmt: skip

        q, k, v = heads("wq.weight", c.num_heads), heads("wk.weight", c.num_kv_heads), heads("wv.weight", c.num_kv_heads)  # fmt: skip
        q, k = self.rope(q), self.rope(k)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=c.num_kv_heads != c.num_heads
        )
        y = y.transpose(1, 2).reshape(S, N, c.num_heads * c.head_dim)
        return seed_linear(y, self.param(p + "wo.weight"))

    def _mlp(self, h: torch.Tensor, i: int) -> torch.Tensor:
        w = [self.param(f"layers.{i}.mlp.{n}.weight") for n in ("w1", "w3", "w2")]
        return seed_linear(F.silu(seed_linear(h, w[0])) * seed_linear(h, w[1]), w[2])

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        S, B, T = idx.shape
        V, D = self.cfg.vocab_size, self.cfg.dim
        emb = self.param("tok_emb.weight")
        offsets = (torch.arange(S, device=idx.device) * V).view(S, 1, 1)
        x = F.embedding(idx + offsets, emb.view(S * V, D)).view(S, B * T, D)
        for i in range(self.cfg.num_layers):
            x = x + self._attention(self._norm(x, f"layers.{i}.attn_norm.weight"), i, B)
            x = x + self._mlp(self._norm(x, f"layers.{i}.mlp_norm.weight"), i)
        logits = seed_linear(self._norm(x, "norm.weight"), self.param("lm_head.weight"))
        return torch.stack(
            [F.cross_entropy(logits[s].float(), targets[s].reshape(-1)) for s in range(S)]
        )


# ---------------------------------------------------------------------------------------------
# Clipping and the optimizers, per seed
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def clip_per_seed_(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_(seed s's parameters, max_norm)` for every seed s of stacked `params`;
    returns the S norms. Each seed's per-tensor norms are its own slices' (S small reductions
    per tensor, as the solo run makes them), so each seed's coefficient is its solo value."""
    grads = [p.grad for p in params if p.grad is not None]
    S = grads[0].shape[0]
    totals = torch.stack(
        [torch.linalg.vector_norm(torch.stack([g[s].norm() for g in grads])) for s in range(S)]
    )
    coef = torch.clamp(max_norm / (totals + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.view(S, *[1] * (g.ndim - 1)))
    return totals


def newton_schulz_seeds(g: torch.Tensor, steps: int) -> torch.Tensor:
    """`muon.newton_schulz` of every seed's matrix g[s] (g: [S, rows, cols], fp32 on the CPU),
    its products batched over the seeds; each seed's norm its own."""
    a, b, c = NS_COEFFS
    x = g.mT if g.size(1) > g.size(2) else g
    norms = torch.stack([x[s].norm() for s in range(x.size(0))]).view(-1, 1, 1)
    x = x / (norms + NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.mT if g.size(1) > g.size(2) else x


class BatchedMuon(Muon):
    """`Muon` over stacked [S, rows, cols] matrices: `muon.muon_update` per seed, its
    Newton-Schulz batched (`newton_schulz_seeds`); the AdamW part is Muon's own (elementwise)."""

    @torch.no_grad()
    def _algo_update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        assert p.ndim == 3, "stacked matrices"
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, grad = state["momentum_buffer"], p.grad
        momentum, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        buf.lerp_(grad, 1.0 - momentum)  # as muon.muon_update, per seed
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        ortho = newton_schulz_seeds(update, group["ns_steps"])
        p.mul_(1.0 - lr * wd)
        p.add_(ortho, alpha=-lr * lr_scale(p.size(1), p.size(2), group["scale"]))


def batched_optimizer(
    cfg: ExperimentConfig, solo: nn.Module, stacked: dict[str, nn.Parameter]
) -> torch.optim.Optimizer:
    """The optimizer `build_optimizer` makes for one seed (its groups, their hyperparameters),
    over the stacked tensors: torch's fused AdamW, or `BatchedMuon`."""
    one = build_optimizer(cfg.optim, solo.named_parameters())
    groups = [
        {k: v for k, v in g.items() if k not in ("params", "param_names")}
        | {"params": [(n, stacked[n]) for n in g["param_names"]]}
        for g in one.param_groups
    ]
    if isinstance(one, Muon):
        return BatchedMuon(groups)
    assert isinstance(one, torch.optim.AdamW), type(one)
    return torch.optim.AdamW(groups, fused=one.defaults["fused"])


# ---------------------------------------------------------------------------------------------
# The two engines' runs
# ---------------------------------------------------------------------------------------------


class SoloRun(StudyStep):
    """One seed trained alone, as today's engine trains it, on `seed_batch`'s batches."""

    def __init__(self, cfg: ExperimentConfig, seed: int) -> None:
        super().__init__(seed_config(cfg, seed))
        self.seed = seed
        self.batches = [seed_batch(cfg, seed, k) for k in range(DISTINCT_BATCHES)]

    def timed(self) -> float:  # type: ignore[override]
        self.batch = self.batches[self.k % DISTINCT_BATCHES]
        return super().timed()

    def weights(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.model.parameters()]


class BatchedRun:
    """Seeds 0..S-1 of `cfg` as one `BatchedTransformer`, its step as `SoloRun`'s per seed:
    LR, forward and backward at the stale weights (`DelayedOptimizer.stale_weights`),
    per-seed clipping, the delayed step."""

    def __init__(self, cfg: ExperimentConfig, num_seeds: int) -> None:
        tc = cfg.train
        self.cfg = cfg
        solos = [build_model(cfg.model, seed_config(cfg, s).train.seed) for s in range(num_seeds)]
        self.model = BatchedTransformer(solos)
        stacked = self.model.named_stacked()
        self.optimizer = batched_optimizer(cfg, solos[0], stacked)
        delay = DelaySchedule.build(cfg.delay, 1, tc.num_steps, train=tc)
        self.delayed = DelayedOptimizer(self.optimizer, [stacked], cfg.delay, delay=delay)
        self.params = list(stacked.values())
        self.batches = []
        for k in range(DISTINCT_BATCHES):
            xy = [seed_batch(cfg, s, k) for s in range(num_seeds)]
            self.batches.append(tuple(torch.stack(t) for t in zip(*xy, strict=True)))
        self.k = 0
        self.losses: list[list[float]] = []  # [step][seed]

    def step(self) -> None:
        tc, k = self.cfg.train, self.k
        apply_lr(self.optimizer, lr_multiplier(k, tc))
        x, y = self.batches[k % DISTINCT_BATCHES]
        self.delayed.zero_grad(set_to_none=True)
        with self.delayed.stale_weights(k):
            losses = self.model(x, y)
            losses.sum().backward()
        if tc.grad_clip > 0:
            clip_per_seed_(self.params, tc.grad_clip)
        with torch.profiler.record_function("delay"):  # step_roofline's category
            self.delayed.step()
        self.delayed.zero_grad(set_to_none=True)
        self.losses.append(losses.detach().tolist())
        self.k += 1

    def timed(self) -> float:
        t0 = time.perf_counter()
        self.step()
        return time.perf_counter() - t0

    def weights(self, seed: int) -> list[torch.Tensor]:
        return [p.detach()[seed] for p in self.params]


def differences(batched: BatchedRun, solos: Sequence[SoloRun]) -> tuple[int | None, float, bool]:
    """Seeds 0..S-1 of `batched` against their solo runs over the steps both trained: (the
    first step whose losses differ or None, the largest |loss difference|, whether the current
    weights are equal bit for bit)."""
    first, worst = None, 0.0
    for k, row in enumerate(batched.losses):
        for s, loss in enumerate(row):
            solo = solos[s].losses[k]
            if loss != solo:
                first = k if first is None else first
                worst = max(worst, abs(loss - solo))
    same = all(
        torch.equal(a, b)
        for s, solo in enumerate(solos[: batched.model.num_seeds])
        for a, b in zip(batched.weights(s), solo.weights(), strict=True)
    )
    return first, worst, same


# ---------------------------------------------------------------------------------------------
# The measurement
# ---------------------------------------------------------------------------------------------


def scale_cfg(width: int | None, optim: str, arm: str, quick: bool) -> ExperimentConfig:
    """The scale's config (`step_roofline.scale_config`), or the tiny `--quick` one."""
    return scale_config(width, optim, arm, QUICK if quick else None)


def scale_rows(width: int | None, args) -> None:
    """Time one scale's contenders in turns and print its rows (module docstring)."""
    label = "quick" if args.quick else "cpu-regime" if width is None else f"d{width}"
    solos: dict[tuple[str, str], list[SoloRun]] = {}
    batched: dict[tuple[str, str, int], BatchedRun] = {}
    for optim in args.optims:
        for arm in args.arms:
            cfg = scale_cfg(width, optim, arm, args.quick)
            solos[optim, arm] = [SoloRun(cfg, s) for s in range(max(args.sizes))]
            for size in args.sizes:
                batched[optim, arm, size] = BatchedRun(cfg, size)
    solo_t = {key: [[] for _ in runs] for key, runs in solos.items()}
    batch_t: dict[tuple[str, str, int], list[float]] = {key: [] for key in batched}
    for r in range(args.warmup + args.rounds):
        for (optim, arm), runs in solos.items():
            for s, run in enumerate(runs):
                t = run.timed()
                if r >= args.warmup:
                    solo_t[optim, arm][s].append(t)
            for size in args.sizes:
                t = batched[optim, arm, size].timed()
                if r >= args.warmup:
                    batch_t[optim, arm, size].append(t)
    pooled: dict[int, list[float]] = {size: [] for size in args.sizes}
    for (optim, arm), runs in solos.items():
        solo_ms = statistics.median(t for ts in solo_t[optim, arm] for t in ts) * 1e3
        for size in args.sizes:
            times = batch_t[optim, arm, size]
            ratios = [
                sum(solo_t[optim, arm][s][r] for s in range(size)) / times[r]
                for r in range(args.rounds)
            ]
            pooled[size] += ratios
            first, worst, same = differences(batched[optim, arm, size], runs)
            exact = "yes" if first is None and same else f"NO {worst:.1e}"
            print(f"{label:<10} {optim:<6} {arm:<7} {size:>2} {solo_ms:8.1f} "
                  f"{statistics.median(times) * 1e3:10.1f}  {median_range(ratios, '.2f'):<18} "
                  f"{exact}", flush=True)  # fmt: skip
    for size in args.sizes:
        print(f"{label:<10} all: S = {size}: {median_range(pooled[size], '.2f')}x runs per "
              f"core-hour", flush=True)  # fmt: skip
    size = max(args.sizes)
    if args.profile_steps:
        print(f"{'model':<10} {'optim':<6} {'arm':<7} {'run':>5}  "
              + " ".join(f"{c:>6}" for c in CATEGORIES) + "  ms/seed")  # fmt: skip
    for (optim, arm), runs in solos.items() if args.profile_steps else ():
        solo_s = statistics.median(t for ts in solo_t[optim, arm] for t in ts)
        per_seed = statistics.median(batch_t[optim, arm, size]) / size
        for name, run, t in (("solo", runs[0], solo_s), (f"S={size}", batched[optim, arm, size], per_seed)):  # fmt: skip
            split = profile_split(run, args.profile_steps)
            ms = " ".join(f"{split[c] * t * 1e3:6.1f}" for c in CATEGORIES)
            print(f"{label:<10} {optim:<6} {arm:<7} {name:>5}  {ms}  {t * 1e3:6.1f}", flush=True)


def check_rows(width: int | None, args) -> None:
    """`--check-steps`: N steps of S seeds both ways, no timing; per (optimizer, arm) the first
    step whose losses differ and the largest difference."""
    label = "quick" if args.quick else "cpu-regime" if width is None else f"d{width}"
    size = max(args.sizes)
    for optim in args.optims:
        for arm in args.arms:
            cfg = scale_cfg(width, optim, arm, args.quick)
            solos = [SoloRun(cfg, s) for s in range(size)]
            run = BatchedRun(cfg, size)
            for _ in range(args.check_steps):
                run.step()
                for solo in solos:
                    solo.timed()
            first, worst, same = differences(run, solos)
            where = "never" if first is None else f"at step {first}"
            print(f"check {label:<10} {optim:<6} {arm:<7} S={size} {args.check_steps} steps: "
                  f"losses differ {where}, max |dloss| {worst:.3e}, final weights "
                  f"{'equal' if same else 'differ'}", flush=True)  # fmt: skip


def main() -> None:
    ap = parser(__doc__, whole=True)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (one step each)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--sizes", type=int, nargs="*", default=[2, 3, 4], help="seeds batched")
    ap.add_argument("--widths", type=int, nargs="*", default=[64, 136])
    ap.add_argument("--skip-regime", action="store_true", help="only the --widths")
    ap.add_argument("--optims", nargs="*", default=["adamw", "muon"])
    ap.add_argument("--arms", nargs="*", default=list(ARMS))
    ap.add_argument("--check-steps", type=int, default=0, help="numerics check length")
    ap.add_argument("--profile-steps", type=int, default=0, help="profiled steps per run")
    ap.add_argument("--quick", action="store_true", help="a tiny model (tests)")
    args = ap.parse_args()
    pin_threads(1)
    print_load("before")
    print(f"torch {torch.__version__}, 1 thread")
    scales = [None] if args.quick else [*([] if args.skip_regime else [None]), *args.widths]
    print(f"{'model':<10} {'optim':<6} {'arm':<7} {'S':>2} {'solo ms':>8} {'batched ms':>10}  "
          f"{'runs/core-h':<18} exact")  # fmt: skip
    for width in scales:
        scale_rows(width, args)
    if args.check_steps:
        check_rows(scales[0], args)
    print_load("after")


if __name__ == "__main__":
    main()
