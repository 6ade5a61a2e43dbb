"""Pipelined training on the multi-process runtime: what each process runs (`run_worker`).

One process per (stage, replica). Every process builds only its own stage
(`models.build_stage`, the values the whole model would have), builds the optimizer from the
stage's named parameters, wraps it in the delay engine's `DelayedOptimizer` (so versions,
Taylor and EF are the emulator's code), generates the schedule (`pipeline.generators`, the
lists the timing simulator times) and executes its own list with `pipeline.stage
.StageExecutor`. Rank 0 writes metrics, prints progress and merges the stage checkpoint parts
into the stage-agnostic checkpoint of single-process training.

Launch with `torchrun ... -m stalepipe train --pipeline.engine distributed ...` or let
`stalepipe train --pipeline.engine distributed` spawn the processes (`train.launch`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stalepipe.config import ConfigError, ExperimentConfig
from stalepipe.data import EVAL_SEED, TokenLoader, check_vocab, ensure_prepared
from stalepipe.delay import DelayedOptimizer, DelaySchedule, resolve_delay_config
from stalepipe.errors import UserError
from stalepipe.models import Transformer, build_stage, flops_per_token, partition
from stalepipe.optim import build_optimizer, resolve_config
from stalepipe.optim.schedules import apply_lr, lr_multiplier, set_peak_lr
from stalepipe.pipeline import ckpt as stage_ckpt
from stalepipe.pipeline.comm import Comm, PeerError, Topology, init_from_env, resolve_backend
from stalepipe.pipeline.generators import one_stage_per_rank, schedule_for
from stalepipe.pipeline.schedule import Schedule, validate
from stalepipe.pipeline.stage import TIED_HEAD, TIED_NAME, StageExecutor
from stalepipe.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from stalepipe.train.loop import TrainResult, _diverged
from stalepipe.train.rundir import MetricsWriter, open_run_dir

# Schedules the runtime executes, and the delay policy each one realises.
RUNTIME_SCHEDULES = {
    "gpipe": "sync",
    "1f1b": "sync",
    "zb-h1": "sync",
    "2bw": "2bw",
    "pipedream": "pipedream",
    "wpipe": "wpipe",
}
PREPARED_ENV = "STALEPIPE_RUN_PREPARED"  # set by the spawning launcher: run dir already open

last_report: dict[str, Any] | None = None  # this process's final state (see `worker_entry`)


def check_config(cfg: ExperimentConfig) -> None:
    """Refuse configurations the runtime cannot run, with the fix in the message."""
    pc, tc = cfg.pipeline, cfg.train
    if pc.schedule not in RUNTIME_SCHEDULES:
        raise ConfigError(
            f"pipeline.schedule {pc.schedule!r} is not run by the distributed engine; choose "
            f"from {', '.join(RUNTIME_SCHEDULES)} (others: `stalepipe simulate`)"
        )
    want = RUNTIME_SCHEDULES[pc.schedule]
    if cfg.delay.policy != want:
        raise ConfigError(
            f"pipeline.schedule {pc.schedule} realises delay policy {want!r}, but delay.policy is "
            f"{cfg.delay.policy!r}; pass --delay.policy {want}"
        )
    if pc.schedule == "pipedream" and tc.num_microbatches != 1:
        raise ConfigError(
            "pipeline.schedule pipedream updates after every microbatch-sized minibatch: set "
            "--train.num_microbatches 1 (and --train.batch_size to the minibatch size)"
        )
    if pc.schedule == "wpipe" and pc.num_stages % 2:
        raise ConfigError(
            f"pipeline.schedule wpipe splits the model into two equal groups of stages (two per "
            f"WPipe worker), so pipeline.num_stages must be even, got {pc.num_stages}; pass "
            f"--pipeline.num_stages {pc.num_stages + 1}"
        )
    if pc.schedule == "2bw" and tc.num_microbatches < pc.num_stages - 1:
        raise ConfigError(
            f"pipeline.schedule 2bw needs train.num_microbatches >= pipeline.num_stages - 1 = "
            f"{pc.num_stages - 1} (a forward would need weights not yet updated), got "
            f"{tc.num_microbatches}; raise --train.num_microbatches or lower "
            f"--pipeline.num_stages"
        )
    if tc.batch_size % (tc.num_microbatches * pc.data_parallel):
        raise ConfigError(
            f"train.batch_size ({tc.batch_size}) must be divisible by train.num_microbatches x "
            f"pipeline.data_parallel ({tc.num_microbatches} x {pc.data_parallel})"
        )
    try:  # whatever else the generator refuses, in the runtime's own option names
        runtime_schedule(cfg, num_steps=min(tc.steps, 2))
    except ConfigError as e:
        raise ConfigError(
            f"pipeline.schedule {pc.schedule} with pipeline.num_stages {pc.num_stages} and "
            f"train.num_microbatches {tc.num_microbatches} is refused by its generator: {e}"
        ) from None


def runtime_schedule(cfg: ExperimentConfig, num_steps: int | None = None) -> Schedule:
    """The schedule the runtime executes for `cfg`: one rank per stage. WPipe's generator puts
    two stages (one of each group) on each of num_stages / 2 ranks; the runtime runs every
    stage in its own process, each in its rank's order (`one_stage_per_rank`)."""
    pc, tc = cfg.pipeline, cfg.train
    steps = tc.steps if num_steps is None else num_steps
    delay = DelaySchedule.from_config(cfg.delay, pc.num_stages, steps, tc)
    sched = schedule_for(pc.schedule, delay, tc.num_microbatches)
    sched = one_stage_per_rank(sched)
    assert sched.num_stages == pc.num_stages, (sched.num_stages, pc.num_stages)
    return sched


def _tee(path: Path, console: bool):
    """Send this process's stdout/stderr to `path` (and to the console for rank 0; stderr of
    other ranks too, so failures show up)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    class Tee:
        def __init__(self, stream, show: bool) -> None:
            self.stream, self.show = stream, show

        def write(self, s: str) -> int:
            f.write(s)
            if self.show:
                self.stream.write(s)
            return len(s)

        def flush(self) -> None:
            f.flush()
            if self.show:
                self.stream.flush()

        def isatty(self) -> bool:
            return self.show and self.stream.isatty()

        def fileno(self) -> int:
            return self.stream.fileno()

    saved = sys.stdout, sys.stderr
    sys.stdout = Tee(saved[0], console)
    sys.stderr = Tee(saved[1], True)

    def restore() -> None:
        sys.stdout, sys.stderr = saved
        f.close()

    return restore


def run_worker(
    cfg: ExperimentConfig, *, resume: bool = False, overwrite: bool = False, verbose: bool = True
) -> TrainResult | None:
    """Run this process's stage of `cfg` (environment from torchrun or `launch.spawn`).
    Returns the TrainResult on rank 0, None elsewhere. Any failure exits through an exception
    whose message names the rank; `main_worker` turns it into a non-zero exit."""
    check_config(cfg)
    pc, tc = cfg.pipeline, cfg.train
    topo = Topology(pc.num_stages, pc.data_parallel)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != topo.world_size:
        raise ConfigError(
            f"{world} processes for pipeline.num_stages x pipeline.data_parallel = "
            f"{pc.num_stages} x {pc.data_parallel} = {topo.world_size}; start "
            f"{topo.world_size} processes (torchrun --nproc-per-node {topo.world_size})"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    device = torch.device(f"cuda:{local_rank}" if tc.device.startswith("cuda") else tc.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(tc.threads or 1)  # one thread per process unless asked
    backend = resolve_backend(pc.backend, str(device))
    rank, _, _ = init_from_env(backend, pc.timeout_s)
    cfg = dataclasses.replace(cfg, optim=resolve_config(cfg.optim))
    run_dir = Path(cfg.out_dir) / cfg.name
    if rank == 0 and not os.environ.get(PREPARED_ENV):
        data_dir = ensure_prepared(cfg.data)
        check_vocab(data_dir, cfg.model.vocab_size)
        open_run_dir(cfg, resume=resume, overwrite=overwrite)
    if rank == 0:  # parts of an interrupted save (maybe of another split): never merge them
        shutil.rmtree(run_dir / stage_ckpt.PARTS_DIR, ignore_errors=True)
    comm = Comm(topo, rank, backend, pc.timeout_s, device)
    comm.barrier("start-up (data preparation on rank 0)", timeout_s=max(pc.timeout_s, 3600))
    restore = _tee(run_dir / "logs" / f"rank{rank}.log", console=rank == 0 and verbose)
    try:
        return _run(cfg, comm, topo, rank, device, run_dir, resume, verbose)
    except BaseException as e:
        # Into this rank's log while stdout/stderr still go there; main_worker does the rest.
        print(f"stalepipe: error: {_message(e, rank)}", file=sys.stderr, flush=True)
        e.stalepipe_logged = True  # type: ignore[attr-defined]
        raise
    finally:
        restore()


def _message(e: BaseException, rank: int) -> str:
    return str(e) if isinstance(e, PeerError) else f"rank {rank}: {type(e).__name__}: {e}"


def _run(cfg, comm, topo, rank, device, run_dir, resume, verbose) -> TrainResult | None:
    pc, tc = cfg.pipeline, cfg.train
    stage, replica = topo.stage_of(rank), topo.replica_of(rank)
    data_dir = ensure_prepared(cfg.data)
    t0 = time.perf_counter()

    # Model, stage, optimizer, delay engine.
    P, m, N = pc.num_stages, tc.num_microbatches, tc.steps
    # The whole model only as shapes and names (meta device); this process materialises and
    # initialises its own stage, with the values the whole model would have.
    with torch.device("meta"):
        full = Transformer(cfg.model)
    stages = partition(full, P, cfg.data.seq_len)
    module = build_stage(cfg.model, tc.seed, P, stage, cfg.data.seq_len, device)
    names_per_stage = [list(s.owned_parameters()) for s in stages]
    owned = module.owned_parameters()
    optimizer = build_optimizer(cfg.optim, list(owned.items()))
    set_peak_lr(optimizer)
    delay_cfg = resolve_delay_config(cfg.delay, tc)
    delayed = DelayedOptimizer(
        optimizer, [owned if s == stage else {} for s in range(P)], delay_cfg, N
    )
    skeleton = (
        build_optimizer(cfg.optim, list(full.named_parameters())).state_dict()
        if rank == 0
        else None
    )
    model_keys = list(full.state_dict())
    tied = cfg.model.tie_embeddings and P > 1

    # Resume: the newest complete (merged) checkpoint, re-split for this stage.
    start, tied_versions = 0, None
    ckpt_path = latest_checkpoint(run_dir) if resume else None
    if ckpt_path is not None:
        state = load_checkpoint(ckpt_path)
        start = int(state["step"])
        needed = delayed.versions_to_keep(start)[stage]
        weights, dstate, per_param = stage_ckpt.stage_state(
            state, stage, names_per_stage, optimizer.state_dict(), needed
        )
        if dstate["policy"] is None:  # a checkpoint without delay state
            dstate["policy"] = delay_cfg.policy
        with torch.no_grad():
            for n, p in owned.items():
                p.copy_(weights[n])
            if tied and stage == P - 1:
                module.get_parameter(TIED_HEAD).copy_(state["model"][TIED_HEAD])
                tied_versions = {v: t.to(device) for v, t in per_param.get(TIED_NAME, {}).items()}
        delayed.load_state_dict(dstate)
        if verbose and rank == 0:
            print(f"resuming {run_dir} from step {start} ({ckpt_path.name})")

    sched = runtime_schedule(cfg)
    if N * m * P <= 20000:
        validate(sched)
    actions = [a for a in sched.ranks[stage] if a.step >= start]

    # Data: stage 0 reads inputs, the last stage targets; each replica its slice.
    B, D = tc.batch_size, pc.data_parallel
    rows = slice(replica * B // D, (replica + 1) * B // D)
    loader = (
        TokenLoader(data_dir, "train", cfg.data.seq_len, cfg.data.seed)
        if stage in (0, P - 1)
        else None
    )

    def get_batch(step: int) -> tuple[list, list]:
        x, y = loader.batch(step, B)
        x, y = x[rows].to(device), y[rows].to(device)
        return list(x.chunk(m)), list(y.chunk(m))

    # Validation: the batches train.loop.evaluate reads (whole batches of train.batch_size
    # rows, replicas take turns), each run as chunks of the microbatch's size.
    val_loader = (
        TokenLoader(data_dir, "val", cfg.data.seq_len, EVAL_SEED) if stage in (0, P - 1) else None
    )

    def val_batch(i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, y = val_loader.batch(i, B)
        return list(zip(x.to(device).chunk(m * D), y.to(device).chunk(m * D), strict=True))

    eval_steps = {
        k for k in range(start, N) if (tc.eval_every and (k + 1) % tc.eval_every == 0) or k + 1 == N
    }

    def set_lr(step: int) -> None:
        apply_lr(optimizer, lr_multiplier(step, tc))

    autocast = (
        (lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16))
        if tc.dtype == "bfloat16"
        else contextlib.nullcontext
    )
    executor = StageExecutor(
        module=module,
        stage=stage,
        delayed=delayed,
        comm=comm,
        sched=sched,
        get_batch=get_batch,
        grad_clip=tc.grad_clip,
        seed=tc.seed,
        lr_fn=set_lr,
        param_counts=[len(n) for n in names_per_stage],
        tied=tied,
        act_shape=(B // D // m, cfg.data.seq_len, cfg.model.dim),
        act_dtype=torch.float32,
        tied_versions=tied_versions,
        autocast=autocast,
        val_batch=val_batch,
        num_val_batches=tc.eval_batches,
        eval_steps=eval_steps,
        replica=replica,
        router_layers=[s.router_layers() for s in stages],
        stats_steps={k for k in range(start, N) if (k + 1) % tc.log_every == 0 or k + 1 == N},
        per_expert=cfg.model.num_experts * cfg.model.num_layers <= 64,  # as train.loop
    )
    del full, stages  # only this stage's modules stay referenced

    logger = _RankZeroLog(cfg, run_dir, start, verbose) if rank == 0 else None
    last_ckpt = [ckpt_path]

    def on_step(k: int) -> None:
        done = k + 1
        if logger is not None:  # stops at a non-finite loss, as train.loop does
            logger.drain(executor.results, executor.val_losses)
        if ((tc.ckpt_every and done % tc.ckpt_every == 0) or done == N) and replica == 0:
            # Non-finite weights are never checkpointed: this rank stops (its peers follow
            # within the timeout) and the newest complete checkpoint stays the last good one.
            if not all(bool(torch.isfinite(p).all()) for p in owned.values()):
                _diverged(f"non-finite weights on stage {stage}", k, latest_checkpoint(run_dir))
            _save(done)

    def _save(done: int) -> None:
        part = {
            "stage": stage,
            "num_stages": P,
            "step": done,
            "model": {n: p.detach().cpu() for n, p in owned.items()},
            "delayed": delayed.state_dict(),
            "rng": torch.get_rng_state(),
        }
        stage_ckpt.save_part(run_dir, done, stage, part)
        if rank == 0:
            parts = [_wait_part(run_dir, done, s, topo, pc.timeout_s) for s in range(P)]
            body = stage_ckpt.merge_parts(parts, skeleton, model_keys, cfg.model.tie_embeddings)
            last_ckpt[0] = save_checkpoint(
                run_dir, done, {"config": cfg.to_dict(), **body}, tc.keep_last
            )
            step_dir = stage_ckpt.part_path(run_dir, done, 0).parent
            shutil.rmtree(step_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                step_dir.parent.rmdir()  # only when no other step's parts are left

    executor.on_step = on_step
    executor.eager_steps = {
        k - 1 for k in range(1, N + 1) if (tc.ckpt_every and k % tc.ckpt_every == 0) or k == N
    }
    try:
        executor.run(actions)
    finally:
        if logger is not None:
            logger.drain(executor.results, executor.val_losses)
            logger.close()
    comm.barrier("the end of training")
    wall = time.perf_counter() - t0
    _check_finite(executor, last_ckpt[0])
    global last_report
    last_report = {
        "rank": rank,
        "stage": stage,
        "weights": {n: p.detach().cpu().clone() for n, p in owned.items()},
        "tied_head": None if executor.tied_live() is None else executor.tied_live().cpu(),
        "peak_versions": executor.peak_versions,
        "losses": [(r.step, r.loss) for r in executor.results],
        "val_losses": dict(executor.val_losses),
    }
    dist.destroy_process_group()
    if logger is None:
        return None
    losses = [r.loss for r in logger.results]
    tokens = (N - start) * tc.batch_size * cfg.data.seq_len
    return TrainResult(
        run_dir=run_dir,
        steps=N,
        final_train_loss=losses[-1] if losses else math.nan,
        final_val_loss=logger.val_loss,
        train_losses=losses,
        wall_time_s=wall,
        tokens_per_s=tokens / max(wall, 1e-9),
    )


def _check_finite(executor: StageExecutor, last_ckpt: Path | None) -> None:
    bad = [r for r in executor.results if not math.isfinite(r.loss)]
    if bad:
        _diverged(f"non-finite loss ({bad[0].loss})", bad[0].step, last_ckpt)


def _wait_part(run_dir: Path, step: int, stage: int, topo: Topology, timeout_s: float) -> dict:
    path = stage_ckpt.part_path(run_dir, step, stage)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise PeerError(
                f"rank 0: {topo.describe(topo.rank(stage))} did not write its checkpoint part "
                f"{path} within {timeout_s:g}s"
            )
        time.sleep(0.02)
    return torch.load(path, map_location="cpu", weights_only=True)


class _RankZeroLog:
    """Metrics lines and the progress bar, written by rank 0 as step results arrive."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path, start: int, verbose: bool) -> None:
        from stalepipe.train.progress import Progress

        self.cfg, self.start, self.run_dir = cfg, start, run_dir
        self.metrics = MetricsWriter(run_dir, start, cfg.train.tensorboard)
        tc = cfg.train
        self.progress = Progress(total=tc.steps, initial=start, enabled=tc.progress and verbose)
        self.results: list = []
        self.val_loss = math.nan  # the newest validation loss (shown in the progress bar)
        self.t0 = time.perf_counter()
        self.tokens_per_step = tc.batch_size * cfg.data.seq_len
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)["total"]
        self.num_stages = cfg.pipeline.num_stages
        self.delay = DelaySchedule.from_config(cfg.delay, self.num_stages, tc.steps, tc)

    def drain(self, results: list, val_losses: dict[int, float]) -> None:
        """Write the records of steps whose results arrived since the last call (the
        record format of `train.loop`, `val_loss` at evaluation steps)."""
        tc = self.cfg.train
        d = self.delay
        while len(self.results) < len(results):
            r = results[len(self.results)]
            self.results.append(r)
            done = r.step + 1
            tok_s = (
                (done - self.start)
                * self.tokens_per_step
                / max(time.perf_counter() - self.t0, 1e-9)
            )
            record: dict[str, Any] = {"step": r.step, "loss": r.loss}
            if done % tc.log_every == 0 or done == tc.steps:
                record.update(
                    lr_mult=lr_multiplier(r.step, tc),
                    grad_norm=r.grad_norm,
                    tau=self.delay.taus(r.step),
                    tokens=done * self.tokens_per_step,
                    tokens_per_s=tok_s,
                    model_flops_per_s=tok_s * self.flops_per_token,
                )
                record.update(r.router)  # MoE router metrics ({} for dense models)
            if r.step in val_losses:
                self.val_loss = record["val_loss"] = val_losses[r.step]
            self.metrics.write(record)
            self.progress.update(loss=r.loss, val_loss=self.val_loss, tok_s=tok_s)
            if not math.isfinite(r.loss):
                _diverged(f"non-finite loss ({r.loss})", r.step, latest_checkpoint(self.run_dir))

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()


def worker_entry(cfg: ExperimentConfig, resume: bool = False, overwrite: bool = False) -> dict:
    """Run one worker quietly and return its report: rank, stage, final owned weights, the
    last stage's copy of a tied matrix, peak weight versions kept, step losses (tests,
    `WorkerPool`)."""
    run_worker(cfg, resume=resume, overwrite=overwrite, verbose=False)
    assert last_report is not None
    return last_report


def main_worker(cfg: ExperimentConfig, resume: bool, overwrite: bool, verbose: bool = True) -> int:
    """Process entry: run the worker; on any failure print one line naming the rank, record it
    for the others, and exit non-zero without waiting for peers (no hang): 2 for bad input,
    `launch.PEER_EXIT` when a peer failed, 1 otherwise."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = run_worker(cfg, resume=resume, overwrite=overwrite, verbose=verbose)
    except BaseException as e:  # noqa: BLE001 - every failure must end the process
        msg = _message(e, rank)
        from stalepipe.pipeline.comm import _default_store, first_failure, report_failure
        from stalepipe.pipeline.launch import PEER_EXIT

        store = _default_store() if dist.is_initialized() else None
        root = first_failure(store)
        report_failure(store, msg)
        if not getattr(e, "stalepipe_logged", False):
            print(f"stalepipe: error: {msg}", file=sys.stderr, flush=True)
        if root and root != msg:
            print(f"stalepipe: first failure reported: {root}", file=sys.stderr, flush=True)
        if not isinstance(e, PeerError | UserError):
            import traceback

            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2 if isinstance(e, UserError) else PEER_EXIT if isinstance(e, PeerError) else 1)
    if result is not None and verbose:
        print(
            f"done: {result.steps} steps in {result.wall_time_s:.1f}s "
            f"({result.tokens_per_s:,.0f} tok/s); final train loss {result.final_train_loss:.4f}, "
            f"val loss {result.final_val_loss:.4f}; "
            f"run directory {result.run_dir}",
            flush=True,
        )
    return 0
