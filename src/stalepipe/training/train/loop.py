"""The training loop, explicit and on one screen (docs/design.md, 'Style', rule 9), for both
engines:

    lr -> forward/backward -> (delayed) step -> log -> eval -> checkpoint

`run_loop` drives any `train.engine.Engine`: the delay emulator (`train.emulated`, one process
or data parallel under torchrun) or one stage of the pipeline runtime (`train.pipelined`). It
owns the LR schedule and the log / eval / checkpoint cadence (`StepPlan`), divergence, metrics,
progress and the `TrainResult`; the engines own how a step is computed. Every process of a run
drives the same loop over its own engine; only the main process writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stalepipe.config import ExperimentConfig
from stalepipe.errors import Preempted, TrainingError
from stalepipe.fileio import flatten_dict
from stalepipe.training.models import flops_per_token
from stalepipe.training.optim import resolve_config
from stalepipe.training.optim.lr_schedule import lr_multiplier
from stalepipe.training.peers.interrupts import Interrupts
from stalepipe.training.rundir.checkpoint import (
    checkpoint_config,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
)
from stalepipe.training.rundir.metrics import Meter, MetricsWriter, read_metrics
from stalepipe.training.rundir.startup import StartUp, begin_run
from stalepipe.training.rundir.trackers import open_trackers
from stalepipe.training.schedules.plan import StepPlan
from stalepipe.training.train.devices import (
    check_device,
    machine_warnings,
    peak_flops,
    set_tf32,
)
from stalepipe.training.train.distributed import (
    init_data_parallel,
    local_device,
    on_main_outside_collectives,
    shutdown,
)
from stalepipe.training.train.emulated import EmulatorEngine
from stalepipe.training.train.engine import Engine, StepResult
from stalepipe.training.train.progress import Progress


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

    def summary(self) -> str:
        """The one line `stalepipe train` prints at the end."""
        return (
            f"done: {self.steps} steps in {self.wall_time_s:.1f}s "
            f"({self.tokens_per_s:,.0f} tok/s); final train loss {self.final_train_loss:.4f}, "
            f"val loss {self.final_val_loss:.4f}; run directory {self.run_dir}"
        )


def train(
    cfg: ExperimentConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    verbose: bool = True,
    init_from: Path | None = None,
    leased: bool = False,
    init_hf: Path | None = None,
) -> TrainResult:
    """Train `cfg` with the delay emulator in `cfg.out_dir/cfg.name`, started as `StartUp`
    says, holding the run's lease while it writes (`leased`: the caller holds it, a sweep's
    worker). Under `torchrun` the ranks train one data-parallel replica each
    (train/distributed.py). The pipeline runtime's entry is `train.pipelined.run_worker`."""
    check_device(cfg)  # before anything is written or deleted
    start = StartUp(
        resume=resume, overwrite=overwrite, init_from=init_from, leased=leased, init_hf=init_hf
    )
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    ctx = init_data_parallel(cfg)
    verbose = verbose and ctx.is_main
    try:
        device = local_device(cfg, ctx)
        set_tf32(cfg.train.tf32, device)  # the runtime's run_worker sets the same
        cfg = with_resolved_optim(cfg)  # config.json records the values used
        meta = {"data_parallel_ranks": ctx.world_size}
        with contextlib.ExitStack() as lease:  # the main process's, while the run writes
            begun = begin_run(cfg, start, verbose=verbose, extra_meta=meta)
            begin = lambda: lease.enter_context(begun)  # noqa: E731
            # Data preparation can outlast a collective's timeout: the others wait on the store.
            data_dir, run_dir = on_main_outside_collectives(begin, ctx, "data preparation")
            for warning in [*cfg.warnings(), *machine_warnings(cfg)] if verbose else ():
                print(f"stalepipe: warning: {warning}", file=sys.stderr)
            ckpt, hf = start.checkpoint(run_dir), start.hf_weights(run_dir)
            engine = EmulatorEngine(cfg, ctx, device, data_dir, run_dir, ckpt, hf)
            return run_loop(engine, cfg, run_dir, is_main=ctx.is_main, verbose=verbose)
    finally:
        shutdown(ctx)


def _trackers(cfg: ExperimentConfig, run_dir: Path, start: int) -> list:
    """The run's trackers (`--log.tracker`; `train.tensorboard` adds TensorBoard), started
    with its config."""
    names = cfg.log.trackers + (("tensorboard",) if cfg.train.tensorboard else ())
    if not names:
        return []
    config = flatten_dict(cfg.to_dict())
    names = tuple(dict.fromkeys(names))
    return open_trackers(names, run_dir, project=cfg.log.project, config=config, start_step=start)


def run_loop(
    engine: Engine, cfg: ExperimentConfig, run_dir: Path, *, is_main: bool, verbose: bool
) -> TrainResult:
    """Drive `engine` from its start step to the end of the run (module docstring). A signal
    ends it early at an agreed step, after a checkpoint, with `Preempted` (peers.interrupts)."""
    tc, start = cfg.train, engine.start_step
    if start >= tc.num_steps:
        return _finished(run_dir, tc.num_steps, verbose)
    if verbose and (ckpt := engine.resumed_from) is not None:
        own = Path(ckpt).resolve().parent == Path(run_dir).resolve()
        whence = ckpt.name if own else f"--init-from {ckpt}"
        print(f"resuming {run_dir} from step {start} ({whence})")
    metrics = MetricsWriter(run_dir, start, _trackers(cfg, run_dir, start)) if is_main else None
    meter = run_meter(cfg, start, engine.device)
    progress = Progress(total=tc.num_steps, initial=start, enabled=tc.progress and verbose)
    losses: list[float] = []
    val_loss, saved = math.nan, None
    with Interrupts(tc.ckpt_every_s, verbose=verbose) as interrupts:
        plan = StepPlan(tc)
        try:
            for r in engine.steps(plan, interrupts.requests):
                plan = plan.with_agreed(r.agreed)  # a checkpoint (and stop) voted on
                meter.step_done(r.step)
                if not math.isfinite(r.loss):
                    _diverged(f"non-finite loss ({r.loss})", r.step, run_dir, cfg, engine, saved)
                losses.append(r.loss)
                record: dict[str, Any] = {"step": r.step, "loss": r.loss}
                if plan.logs(r.step):
                    record.update(_log_fields(r, plan, meter))
                if plan.evaluates(r.step):
                    with meter.paused():  # steady-state throughput: training steps only
                        val_loss = record["val_loss"] = engine.evaluate()
                if r.step == tc.num_steps - 1 and tc.final_eval_full and is_main:
                    with meter.paused():
                        loss, tokens = engine.evaluate_full()
                    record.update(val_loss_full=loss, val_tokens_full=tokens)
                    if verbose:
                        print(f"val loss {loss:.4f} over the whole val split ({tokens:,} tokens)")
                if metrics:
                    metrics.write(record)
                progress.update(loss=r.loss, val_loss=val_loss, tok_s=meter.tokens_per_s(r.step))
                if plan.checkpoints(r.step):
                    if bad := engine.nonfinite_weights():
                        _diverged(bad, r.step, run_dir, cfg, engine, saved)
                    with meter.paused():
                        saved = engine.checkpoint(r.step + 1)
                    interrupts.checkpointed()
        finally:
            progress.close()
            if metrics:
                metrics.close()
    if (stop := plan.stop_step) is not None:
        raise Preempted(
            f"stopped by {interrupts.signal or 'a signal to another process'} after {stop + 1} of "
            f"{tc.num_steps} steps; checkpoint "
            f"{saved or run_dir}; continue with the same command and --resume"
        )
    return TrainResult(
        run_dir=run_dir,
        steps=tc.num_steps,
        final_train_loss=losses[-1] if losses else math.nan,
        final_val_loss=val_loss,
        train_losses=losses,
        wall_time_s=meter.elapsed(),
        tokens_per_s=meter.tokens_per_s(tc.num_steps - 1),
    )


def _finished(run_dir: Path, steps: int, verbose: bool) -> TrainResult:
    """A resumed run that has already trained all its steps: nothing to do (requeue scripts
    may resume a finished run); the result comes from its metrics."""
    if verbose:
        print(f"{run_dir} has trained all {steps} steps; a larger --train.num_steps extends it")
    rows = read_metrics(run_dir)
    losses = [r["loss"] for r in rows if "loss" in r]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    return TrainResult(
        run_dir=run_dir,
        steps=steps,
        final_train_loss=losses[-1] if losses else math.nan,
        final_val_loss=vals[-1] if vals else math.nan,
        train_losses=[],
        wall_time_s=0.0,
        tokens_per_s=0.0,
    )


def run_meter(cfg: ExperimentConfig, start: int, device: torch.device) -> Meter:
    """The run's `rundir.metrics.Meter`: tokens of a global batch, model FLOPs per token, and
    the peak of every process's GPU (MFU; the runtime's P x D ranks or the data-parallel
    ranks, each on one GPU like this one)."""
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_initialized() else 1
    return Meter(
        start=start,
        tokens_per_step=cfg.train.batch_size * cfg.data.seq_len,
        flops_per_token=flops_per_token(cfg.model, cfg.data.seq_len)["total"],
        peak_flops=peak_flops(device, world),
        device=device,
    )


def _log_fields(r: StepResult, plan: StepPlan, meter: Meter) -> dict[str, Any]:
    out: dict[str, Any] = {
        "lr": r.lr,
        "lr_mult": lr_multiplier(r.step, plan.train),
        "grad_norm": r.grad_norm,
        "tau": r.tau,
        **meter.fields(r.step),
    }
    return out | r.router | r.staleness  # MoE router metrics, `log.staleness` ({} without)


# A run that diverges this soon after a resume, before it wrote a checkpoint of its own, blames
# the checkpoint it resumed from, not the LR (issue 39: a damaged checkpoint had sent its user
# round a loop of ever lower LRs).
SUSPECT_STEPS = 10


def _diverged(
    what: str, step: int, run_dir: Path, cfg: ExperimentConfig, engine: Engine, saved: Path | None
) -> None:
    """Stop a diverged run with the fix: a lower LR (and clipping) from the last good
    checkpoint; or, when the run resumed from a checkpoint and diverged right after it
    (`SUSPECT_STEPS`) or again after its LR was already lowered, that checkpoint is suspect:
    the one before it is named instead, and no LR advice is repeated."""
    resumed = engine.resumed_from if saved is None else None
    if resumed is not None:
        after = step - engine.start_step + 1
        lowered = _lr_lowered(cfg, resumed)
        if after <= SUSPECT_STEPS or lowered:
            raise TrainingError(_suspect(what, step, after, Path(resumed), lowered))
    last = latest_checkpoint(run_dir)
    where = f"last good checkpoint: {last}" if last else "no checkpoint was written"
    lower = f"--optim.lr {(cfg.optim.lr or 0) / 2:g}" if cfg.optim.lr else "a lower --optim.lr"
    clip = "" if cfg.train.grad_clip > 0 else " --train.grad_clip 1.0"
    again = (
        f"continue from it with the same command and --resume {lower}{clip}"
        if last
        else f"start over with --overwrite {lower}{clip}"
    )
    raise TrainingError(f"{what} at step {step}; {where}; {again}")


def _lr_lowered(cfg: ExperimentConfig, ckpt: Path) -> bool:
    """Whether this invocation resumed `ckpt` with a lower LR than the one it was saved with."""
    saved = (checkpoint_config(ckpt) or {}).get("optim", {}).get("lr")
    return bool(cfg.optim.lr and isinstance(saved, (int, float)) and cfg.optim.lr < saved)


def _suspect(what: str, step: int, after: int, ckpt: Path, lowered: bool) -> str:
    why = "after its LR was lowered" if lowered else f"{after} step(s) after resuming"
    kept = list_checkpoints(ckpt.parent)
    earlier = [p for p in kept if (checkpoint_step(p) or 0) < (checkpoint_step(ckpt) or 0)]
    fix = (
        f"move it aside (mv {ckpt} {ckpt}.suspect) and resume from the one before it, "
        f"{earlier[-1]}, with the same command and --resume"
        if earlier
        else "it is the run's oldest checkpoint: start over with --overwrite"
    )
    return (
        f"{what} at step {step}, {why} from {ckpt}: that checkpoint is suspect (damaged, or "
        f"its state already diverging), not the LR; {fix}"
    )


def with_resolved_optim(cfg: ExperimentConfig) -> ExperimentConfig:
    """Fill the optimizer's defaults in so config.json records the values actually used."""
    return dataclasses.replace(cfg, optim=resolve_config(cfg.optim))
