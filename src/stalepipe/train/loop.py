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
from stalepipe.models import Transformer, build_model
from stalepipe.optim import build_optimizer, resolve_config
from stalepipe.optim.schedules import apply_lr, lr_multiplier, set_peak_lr
from stalepipe.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_model_state,
    save_checkpoint,
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
) -> float:
    """Mean loss over the first `num_batches` validation batches (the same ones every time)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(num_batches):
        x, y = loader.batch(i, batch_size)
        with autocast:
            total += model(x.to(device), y.to(device)).item()
    model.train(was_training)
    return total / num_batches


def _autocast(cfg: ExperimentConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.train.dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train(
    cfg: ExperimentConfig, *, resume: bool = False, overwrite: bool = False, verbose: bool = True
) -> TrainResult:
    """Train `cfg` end to end in `cfg.out_dir/cfg.name`; see the module docstring."""
    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(tc.threads)
    device = torch.device(tc.device)
    data_dir = ensure_prepared(cfg.data)
    check_vocab(data_dir, cfg.model.vocab_size)
    cfg = _with_resolved_optim(cfg)
    run_dir = open_run_dir(cfg, resume=resume, overwrite=overwrite)

    train_data = TokenLoader(data_dir, "train", cfg.data.seq_len, cfg.data.seed)
    val_data = TokenLoader(data_dir, "val", cfg.data.seq_len, EVAL_SEED)  # same val set for all
    model = build_model(cfg.model, tc.seed, device)
    optimizer = build_optimizer(cfg.optim, model.named_parameters())
    set_peak_lr(optimizer)
    engine = DelayEmulator(
        model,
        optimizer,
        resolve_delay_config(cfg.delay, tc),
        cfg.pipeline.num_stages,
        tc.steps,
        seq_len=cfg.data.seq_len,
        seed=tc.seed,
    )
    autocast = _autocast(cfg, device)

    start = 0
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        state = load_checkpoint(ckpt)
        load_model_state(model, state["model"], ckpt)
        engine.load_state_dict(state["engine"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
        if verbose:
            print(f"resuming {run_dir} from step {start} ({ckpt.name})")

    metrics = MetricsWriter(run_dir, start)
    tokens_per_step = tc.batch_size * cfg.data.seq_len
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
            x, y = train_data.batch(step, tc.batch_size)
            micro = split_microbatches(x.to(device), y.to(device), tc.num_microbatches)
            with autocast:
                loss = engine.forward_backward(step, micro)
            if not math.isfinite(loss):
                _diverged(f"non-finite loss ({loss})", step, last_ckpt)
            grad_norm = engine.clip_grad_norm_(tc.grad_clip) if tc.grad_clip > 0 else math.nan
            delay = engine.step(step)
            losses.append(loss)

            # log -> eval -> checkpoint
            done = step + 1
            tok_s = (done - start) * tokens_per_step / max(time.perf_counter() - t0, 1e-9)
            record: dict[str, Any] = {"step": step, "loss": loss}
            if done % tc.log_every == 0 or done == tc.steps:
                record.update(
                    lr=optimizer.param_groups[0]["lr"],
                    lr_mult=lr_mult,
                    grad_norm=grad_norm,
                    tau=delay["tau"],
                    tokens=done * tokens_per_step,
                    tokens_per_s=tok_s,
                )
            if (tc.eval_every and done % tc.eval_every == 0) or done == tc.steps:
                val_loss = evaluate(
                    model, val_data, tc.eval_batches, tc.batch_size, device, autocast
                )
                record["val_loss"] = val_loss
            metrics.write(record)
            progress.update(loss=loss, val_loss=val_loss, tok_s=tok_s)
            if (tc.ckpt_every and done % tc.ckpt_every == 0) or done == tc.steps:
                if not all(torch.isfinite(p).all() for p in model.parameters()):
                    _diverged("non-finite weights", step, last_ckpt)
                last_ckpt = save_checkpoint(
                    run_dir,
                    done,
                    {
                        "config": cfg.to_dict(),
                        "model": model.state_dict(),
                        "engine": engine.state_dict(),
                        "rng": torch.get_rng_state(),
                    },
                    tc.keep_last,
                )
    finally:
        progress.close()
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


def _with_resolved_optim(cfg: ExperimentConfig) -> ExperimentConfig:
    """Fill the optimizer's defaults in so config.json records the values actually used."""
    import dataclasses

    return dataclasses.replace(cfg, optim=resolve_config(cfg.optim))
