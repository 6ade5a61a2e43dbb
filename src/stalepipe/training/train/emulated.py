"""`EmulatorEngine`: the delay emulator as a training engine (`train.engine.Engine`).

One process trains the whole model; the delay engine (`delay.DelayEmulator`) computes each step's
gradient at the weights an asynchronous pipeline would use (docs/design.md, 'The delay contract');
with `delay.policy sync` it is the plain training step. Under `torchrun` every process is one
data-parallel replica: it reads its rows of each batch, gradients and losses are averaged across
replicas, the main process writes the checkpoint.

The data position is the step itself: batch k is a pure function of (data.seed, k), so a
resumed run reads exactly the batches an uninterrupted one would have read.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from stalepipe.config import ExperimentConfig
from stalepipe.training.data import EVAL_SEED, TokenLoader
from stalepipe.training.delay import DelayEmulator, DelaySchedule, tied
from stalepipe.training.models import Transformer, build_model, compile_blocks
from stalepipe.training.optim import build_optimizer
from stalepipe.training.optim.lr_schedule import apply_lr, config_peak_lr, lr_multiplier
from stalepipe.training.peers.interrupts import agreement, no_requests
from stalepipe.training.rundir.checkpoint import (
    commit_checkpoint,
    load_model_state,
    open_checkpoint,
)
from stalepipe.training.rundir.checkpoint_parts import emulator_state, flatten_part, saved_split
from stalepipe.training.rundir.hf_checkpoint import load_hf_weights
from stalepipe.training.rundir.sharded import clear_staging, save_part
from stalepipe.training.schedules.plan import StepPlan
from stalepipe.training.train.distributed import (
    SINGLE_PROCESS,
    DistContext,
    allreduce_grads_,
    mean_across_ranks,
    on_main_outside_collectives,
    or_across_ranks,
    shard_rows,
)
from stalepipe.training.train.engine import StepResult
from stalepipe.training.train.staleness import StalenessProbe

Microbatches = list[tuple[torch.Tensor, torch.Tensor]]


def split_microbatches(x: torch.Tensor, y: torch.Tensor, num_microbatches: int) -> Microbatches:
    """Split a global batch (B, T) into `num_microbatches` equal, ordered microbatches."""
    return list(zip(x.chunk(num_microbatches), y.chunk(num_microbatches), strict=True))


def autocast_for(cfg: ExperimentConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for `train.dtype bfloat16` (fp32 master weights and optimizer state)."""
    if cfg.train.dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(
    model: Transformer,
    loader: TokenLoader,
    num_batches: int,
    batch_size: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager,
    ctx: DistContext = SINGLE_PROCESS,
) -> float:
    """Mean loss over the first `num_batches` validation batches (the same ones every time);
    data-parallel ranks split the batches between them."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(ctx.rank, num_batches, ctx.world_size):
        x, y = loader.batch(i, batch_size)
        with autocast:
            total += model(x.to(device), y.to(device)).item()
    model.train(was_training)
    return mean_across_ranks(total * ctx.world_size / num_batches, ctx, device)


def evaluate_full(
    model: Transformer,
    loader: TokenLoader,
    batch_size: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager,
) -> tuple[float, int]:
    """(mean loss per target token, tokens scored) over the whole split, in non-overlapping
    windows (`TokenLoader.full_split`)."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for x, y in loader.full_split(batch_size):
            with autocast:
                total += model(x.to(device), y.to(device)).item() * y.numel()
            tokens += y.numel()
    model.train(was_training)
    return total / tokens, tokens


class EmulatorEngine:
    """The delay emulator over the whole model in this process (one data-parallel replica).

    Build it after the run directory is open; it continues from `start_from`, a checkpoint
    (`rundir.startup.StartUp.checkpoint`: the run's own, or its parent's; of either engine, any
    stage split the policy allows), or starts at step 0: from `init_hf`'s weights when given
    (an HF model directory, `rundir.hf_checkpoint`), else from the seeded initialisation."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        ctx: DistContext,
        device: torch.device,
        data_dir: Path,
        run_dir: Path,
        start_from: Path | None = None,
        init_hf: Path | None = None,
    ) -> None:
        tc = cfg.train
        self.cfg, self.ctx, self.device, self.run_dir = cfg, ctx, device, run_dir
        self.train_data = TokenLoader(data_dir, "train", cfg.data.seq_len, cfg.data.seed)
        self.val_data = TokenLoader(data_dir, "val", cfg.data.seq_len, EVAL_SEED)
        self.model = build_model(cfg.model, tc.seed, device)
        if init_hf is not None:  # before the optimizer and the delay keep any version
            load_hf_weights(dict(self.model.named_parameters()), cfg.model, init_hf)
        if tc.compile:  # per block: the graphs the runtime's stages compile too
            compile_blocks(self.model)
        self.optimizer = build_optimizer(cfg.optim, self.model.named_parameters())
        self.delay = DelaySchedule.build(cfg.delay, cfg.pipeline.num_stages, tc.num_steps, train=tc)
        self.emulator = DelayEmulator(
            self.model,
            self.optimizer,
            cfg.delay,
            delay=self.delay,
            seq_len=cfg.data.seq_len,
            seed=tc.seed,
            replica=ctx.rank,
            split=cfg.pipeline.partition,
        )
        self.autocast = autocast_for(cfg, device)
        self.staleness = self._probe() if cfg.log.staleness else None
        self.start_step, self.resumed_from = 0, None
        if (ckpt := start_from) is not None:
            self._resume(ckpt)

    def _probe(self) -> StalenessProbe:
        """`log.staleness`: the probe over each pipeline stage's parameters."""
        params = dict(self.model.named_parameters())
        delayed = self.emulator.delayed
        names = [delayed.stage_param_names(s) for s in range(delayed.num_stages)]
        return StalenessProbe([[params[n] for n in stage if n in params] for stage in names])

    def _resume(self, ckpt: Path) -> None:
        """Continue from a checkpoint of either engine and format, any split the policy allows
        (its keys re-split by name, `rundir.checkpoint_parts`)."""
        flat = open_checkpoint(ckpt)
        weights, engine_state = emulator_state(flat, self.emulator.delayed)
        aliases = tied.aliases(self.cfg.model.tie_embeddings)
        weights |= {key: weights[source] for key, source in aliases.items()}
        load_model_state(self.model, weights, ckpt)
        with config_peak_lr(self.optimizer):
            self.emulator.load_state_dict(engine_state)
        if "rng" in flat.stored_keys():
            torch.set_rng_state(flat.read(["rng"])["rng"])
        self.start_step, self.resumed_from = saved_split(flat)[0], ckpt

    def steps(
        self, plan: StepPlan, requests: Callable[[], int] = no_requests
    ) -> Iterator[StepResult]:
        """lr -> forward/backward at the stale point -> (clip) -> delayed update, per step."""
        tc, ctx, m = self.cfg.train, self.ctx, self.cfg.model
        per_expert = m.num_experts * m.num_layers <= 64
        for step in range(self.start_step, plan.total_steps):
            apply_lr(self.optimizer, lr_multiplier(step, tc))
            x, y = self.train_data.batch(step, tc.batch_size)
            x, y = shard_rows(x, ctx).to(self.device), shard_rows(y, ctx).to(self.device)
            micro = split_microbatches(x, y, tc.num_microbatches // ctx.world_size)
            with self.autocast:
                loss = self.emulator.forward_backward(step, micro)
            allreduce_grads_(self.model.parameters(), ctx)
            loss = mean_across_ranks(loss, ctx, self.device)
            grad_norm = math.nan
            if tc.grad_clip > 0:
                grad_norm = self.emulator.clip_grad_norm_(tc.grad_clip)
            if self.staleness is not None:
                self.staleness.before_update(step, plan.logs(step), plan.logs(step + 1))
            tau = self.emulator.step(step)["tau"]
            stale = self.staleness.after_update(step, plan.logs(step)) if self.staleness else {}
            # MoE: router load / aux losses since the last log line ({} for dense models)
            router = self.model.router_stats(per_expert=per_expert) if plan.logs(step) else {}
            lr = self.optimizer.param_groups[0]["lr"]
            # One process acts at once; replicas agree through one small collective.
            agreed = agreement(step, or_across_ranks(requests(), ctx, self.device))
            plan = plan.with_agreed(agreed)
            yield StepResult(step, loss, grad_norm, tau, lr, router, agreed, stale)
            if plan.stops(step):
                return

    def evaluate(self) -> float:
        tc = self.cfg.train
        return evaluate(
            self.model,
            self.val_data,
            tc.num_eval_batches,
            tc.batch_size,
            self.device,
            self.autocast,
            self.ctx,
        )

    def evaluate_full(self) -> tuple[float, int]:
        """The whole validation split (`train.final_eval_full`), on the main process: every
        replica holds the same weights."""
        return evaluate_full(
            self.model, self.val_data, self.cfg.train.batch_size, self.device, self.autocast
        )

    def nonfinite_weights(self) -> str | None:
        ok = all(bool(torch.isfinite(p).all()) for p in self.model.parameters())
        return None if ok else "non-finite weights"

    def checkpoint(self, step: int) -> Path | None:
        return on_main_outside_collectives(
            lambda: self._save(step), self.ctx, f"the checkpoint of step {step}"
        )

    def _save(self, step: int) -> Path:
        """The main process writes every stage as one DCP shard and commits it
        (`rundir.sharded`); the other replicas hold the same state."""
        aliases = tied.aliases(self.cfg.model.tie_embeddings)
        weights = {n: t for n, t in self.model.state_dict().items() if n not in aliases}
        delayed = self.emulator.delayed.state_dict()
        stages = list(range(len(delayed["names"])))
        tensors, meta = flatten_part(delayed, stages, weights, torch.get_rng_state())
        clear_staging(self.run_dir, step)
        save_part(self.run_dir, step, 0, tensors, meta)
        manifest = {"config": self.cfg.to_dict(), "ranks": [0]}
        return commit_checkpoint(self.run_dir, step, manifest, self.cfg.train.keep_last)
