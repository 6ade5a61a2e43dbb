"""The training loop, explicit and on one screen (GUIDE 4.9):

    lr -> forward/backward -> (delayed) step -> log -> eval -> checkpoint

The delay engine (`delay.DelayEmulator`) computes each step's gradient at the weights an
asynchronous pipeline would use (GUIDE section 2); with `delay.policy sync` it is the plain loop.

The data position is the step itself: batch k is a pure function of (data.seed, k), so a resumed
run reads exactly the batches an uninterrupted one would have read.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stalepipe.config import ExperimentConfig
from stalepipe.data import EVAL_SEED, TokenLoader, check_vocab, ensure_prepared
from stalepipe.delay import DelayEmulator, resolve_delay_config
from stalepipe.errors import TrainingError
from stalepipe.models import Transformer, build_model, flops_per_token
from stalepipe.optim import build_optimizer, resolve_config
from stalepipe.optim.schedules import apply_lr, lr_multiplier
from stalepipe.pipeline.ckpt import emulator_state
from stalepipe.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_model_state,
    save_checkpoint,
)
from stalepipe.train.distributed import (
    SINGLE_PROCESS,
    DistContext,
    allreduce_grads_,
    init_data_parallel,
    local_device,
    mean_across_ranks,
    on_main,
    shard_rows,
    shutdown,
)
from stalepipe.train.progress import Progress
from stalepipe.train.rundir import MetricsWriter, open_run_dir

Microbatches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TrainResult:
    """What a finished run reports; the same numbers are in its metrics.jsonl."""

    run_dir: Path
    steps: int
    final_train_loss: float
    final_val_loss: float
    train_losses: list[float]
    wall_time_s: float
    tokens_per_s: float


def split_microbatches(x: torch.Tensor, y: torch.Tensor, num_microbatches: int) -> Microbatches:
    """Split a global batch (B, T) into `num_microbatches` equal, ordered microbatches."""
    return list(zip(x.chunk(num_microbatches), y.chunk(num_microbatches), strict=True))


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


def _autocast(cfg: ExperimentConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.train.dtype == "bfloat16":  # fp32 master weights and optimizer state, bf16 matmuls
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train(
    cfg: ExperimentConfig, *, resume: bool = False, overwrite: bool = False, verbose: bool = True
) -> TrainResult:
    """Train `cfg` end to end in `cfg.out_dir/cfg.name`; see the module docstring. Under
    `torchrun` the ranks train one data-parallel replica each (train/distributed.py)."""
    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(tc.threads)
    ctx = init_data_parallel(cfg)
    try:
        return _train(cfg, ctx, resume=resume, overwrite=overwrite, verbose=verbose and ctx.is_main)
    finally:
        shutdown(ctx)


def _train(
    cfg: ExperimentConfig, ctx: DistContext, *, resume: bool, overwrite: bool, verbose: bool
) -> TrainResult:
    tc = cfg.train
    device = local_device(cfg, ctx)
    if device.type == "cuda":  # explicit, not whatever the process happened to inherit
        torch.backends.cuda.matmul.allow_tf32 = tc.tf32
        torch.backends.cudnn.allow_tf32 = tc.tf32
    data_dir = on_main(lambda: ensure_prepared(cfg.data, progress=verbose), ctx)
    check_vocab(data_dir, cfg.model.vocab_size)
    cfg = _with_resolved_optim(cfg)
    run_dir = on_main(
        lambda: open_run_dir(
            cfg,
            resume=resume,
            overwrite=overwrite,
            extra_meta={"data_parallel_ranks": ctx.world_size},
        ),
        ctx,
    )

    train_data = TokenLoader(data_dir, "train", cfg.data.seq_len, cfg.data.seed)
    val_data = TokenLoader(data_dir, "val", cfg.data.seq_len, EVAL_SEED)  # same val set for all
    model = build_model(cfg.model, tc.seed, device)
    if tc.compile:  # compiles forward only; the emulator's weight swaps keep the same graph
        model.compile()
    optimizer = build_optimizer(cfg.optim, model.named_parameters())
    engine = DelayEmulator(
        model,
        optimizer,
        resolve_delay_config(cfg.delay, tc),
        cfg.pipeline.num_stages,
        tc.steps,
        seq_len=cfg.data.seq_len,
        seed=tc.seed,
        replica=ctx.rank,
    )
    autocast = _autocast(cfg, device)

    start = 0
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        state = load_checkpoint(ckpt)
        load_model_state(model, state["model"], ckpt)
        engine.load_state_dict(emulator_state(state, engine.delayed))  # any engine, any split
        torch.set_rng_state(state["rng"])
        start = state["step"]
        if verbose:
            print(f"resuming {run_dir} from step {start} ({ckpt.name})")

    metrics = MetricsWriter(run_dir, start, tc.tensorboard) if ctx.is_main else None
    tokens_per_step = tc.batch_size * cfg.data.seq_len
    flops_per_step = flops_per_token(cfg.model, cfg.data.seq_len)["total"] * tokens_per_step
    peak = peak_flops(device) * ctx.world_size
    progress = Progress(total=tc.steps, initial=start, enabled=tc.progress and verbose)
    losses: list[float] = []
    val_loss = math.nan
    t0 = time.perf_counter()
    last_ckpt = ckpt
    try:
        for step in range(start, tc.steps):
            # lr -> forward/backward (at the stale point) -> delayed step
            lr_mult = lr_multiplier(step, tc)
            apply_lr(optimizer, lr_mult)
            x, y = (shard_rows(t, ctx).to(device) for t in train_data.batch(step, tc.batch_size))
            micro = split_microbatches(x, y, tc.num_microbatches // ctx.world_size)
            with autocast:
                loss = engine.forward_backward(step, micro)
            allreduce_grads_(model.parameters(), ctx)
            loss = mean_across_ranks(loss, ctx, device)
            if not math.isfinite(loss):
                _diverged(f"non-finite loss ({loss})", step, last_ckpt)
            grad_norm = engine.clip_grad_norm_(tc.grad_clip) if tc.grad_clip > 0 else math.nan
            delay = engine.step(step)
            losses.append(loss)

            # log -> eval -> checkpoint
            done = step + 1
            elapsed = max(time.perf_counter() - t0, 1e-9)
            tok_s = (done - start) * tokens_per_step / elapsed
            record: dict[str, Any] = {"step": step, "loss": loss}
            if done % tc.log_every == 0 or done == tc.steps:
                flops_s = (done - start) * flops_per_step / elapsed
                record.update(
                    lr=optimizer.param_groups[0]["lr"],
                    lr_mult=lr_mult,
                    grad_norm=grad_norm,
                    tau=delay["tau"],
                    tokens=done * tokens_per_step,
                    tokens_per_s=tok_s,
                    model_flops_per_s=flops_s,
                )
                if peak:
                    record["mfu"] = flops_s / peak
                # MoE: router load/aux losses since the last log line ({} for dense models)
                m = cfg.model
                record.update(model.router_stats(per_expert=m.num_experts * m.num_layers <= 64))
            if (tc.eval_every and done % tc.eval_every == 0) or done == tc.steps:
                val_loss = evaluate(
                    model, val_data, tc.eval_batches, tc.batch_size, device, autocast, ctx
                )
                record["val_loss"] = val_loss
            if metrics:
                metrics.write(record)
            progress.update(loss=loss, val_loss=val_loss, tok_s=tok_s)
            if (tc.ckpt_every and done % tc.ckpt_every == 0) or done == tc.steps:
                if not all(torch.isfinite(p).all() for p in model.parameters()):
                    _diverged("non-finite weights", step, last_ckpt)
                last_ckpt = on_main(
                    lambda done=done: save_checkpoint(
                        run_dir,
                        done,
                        {
                            "config": cfg.to_dict(),
                            "model": model.state_dict(),
                            "engine": engine.state_dict(),
                            "rng": torch.get_rng_state(),
                        },
                        tc.keep_last,
                    ),
                    ctx,
                )
    finally:
        progress.close()
        if metrics:
            metrics.close()
    wall = time.perf_counter() - t0
    return TrainResult(
        run_dir=run_dir,
        steps=tc.steps,
        final_train_loss=losses[-1] if losses else math.nan,
        final_val_loss=val_loss,
        train_losses=losses,
        wall_time_s=wall,
        tokens_per_s=(tc.steps - start) * tokens_per_step / max(wall, 1e-9),
    )


def _diverged(what: str, step: int, last_ckpt: Path | None) -> None:
    where = f"last good checkpoint: {last_ckpt}" if last_ckpt else "no checkpoint was written"
    raise TrainingError(
        f"{what} at step {step}; {where}. Lower --optim.lr or enable --train.grad_clip, then "
        f"resume from that checkpoint (--resume) or start over"
    )


def peak_flops(device: torch.device) -> float:
    """Dense bf16 peak FLOP/s of a known CUDA device (0 when unknown, e.g. on CPU): the MFU
    denominator."""
    if device.type != "cuda":
        return 0.0
    from stalepipe.pipeline.devices import DEVICES

    name = torch.cuda.get_device_name(device).lower()
    for key, dev in DEVICES.items():
        if key in name:
            return dev.peak_flops
    return 0.0


def _with_resolved_optim(cfg: ExperimentConfig) -> ExperimentConfig:
    """Fill the optimizer's defaults in so config.json records the values actually used."""
    import dataclasses

    return dataclasses.replace(cfg, optim=resolve_config(cfg.optim))
