"""Pipelined training on the multi-process runtime: what each process runs (`run_worker`).

One process per (stage, replica), or per `pipeline.num_chunks` stages (interleaved 1F1B, ZB-V,
DualPipeV). Every process builds only its own stages (`models.build_stage`, the values the
whole model would have), builds the optimizer from their named parameters, wraps it in the
delay engine's `DelayedOptimizer` (so versions, Taylor and EF are the emulator's code),
generates the schedule (`schedules.generators`, the lists the timing simulator times) and
executes its own list with `runtime.stage.StageExecutor`. Rank 0 writes metrics and prints
progress; every process of replica 0 writes its own DCP shard of each checkpoint, and rank 0
commits them (`rundir.sharded`).

Launch with `torchrun ... -m stalepipe train --pipeline.engine distributed ...` or let
`stalepipe train --pipeline.engine distributed` spawn the processes (`launch.train`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stalepipe.config import PIPELINE_SCHEDULES, ConfigError, ExperimentConfig
from stalepipe.errors import Preempted, UserError
from stalepipe.training.data import EVAL_SEED, TokenLoader
from stalepipe.training.data.loader import ReplicaBatches
from stalepipe.training.delay import DelayedOptimizer, DelaySchedule, tied
from stalepipe.training.models import Transformer, build_stage, compile_blocks, partition
from stalepipe.training.optim import build_optimizer
from stalepipe.training.optim.lr_schedule import config_peak_lr, set_peak_lr
from stalepipe.training.peers.failures import WorkerFailed
from stalepipe.training.peers.group import (
    PeerError,
    barrier_on_store,
    init_from_env,
    leave_process_group,
    resolve_backend,
)
from stalepipe.training.peers.interrupts import no_requests
from stalepipe.training.peers.topology import Topology
from stalepipe.training.rundir import checkpoint_parts as stage_ckpt
from stalepipe.training.rundir import sharded
from stalepipe.training.rundir.checkpoint import commit_checkpoint, open_checkpoint
from stalepipe.training.rundir.directory import run_data_dir
from stalepipe.training.rundir.hf_checkpoint import load_hf_weights
from stalepipe.training.rundir.startup import FRESH, StartUp, begin_run
from stalepipe.training.runtime.comm import Comm
from stalepipe.training.runtime.stage import StageExecutor
from stalepipe.training.runtime.stage_eval import EvalData
from stalepipe.training.runtime.stage_io import ModelLayout, StageIO
from stalepipe.training.runtime.stage_update import StepVotes, lookahead
from stalepipe.training.runtime.tied import resume_head
from stalepipe.training.schedules.generators import one_stage_per_rank, pipeline_schedule_for
from stalepipe.training.schedules.plan import StepPlan
from stalepipe.training.schedules.schedule import PipelineSchedule, validate
from stalepipe.training.train.devices import check_device, set_tf32
from stalepipe.training.train.distributed import MAIN_WORK_TIMEOUT_S
from stalepipe.training.train.engine import StepResult
from stalepipe.training.train.loop import TrainResult, run_loop, with_resolved_optim
from stalepipe.training.train.ranklog import log_only, tee_rank_log

PREPARED_ENV = "STALEPIPE_RUN_PREPARED"  # set by the spawning launcher: run dir already open


def check_config(cfg: ExperimentConfig) -> None:
    """Refuse configurations the runtime cannot run, with the fix in the message."""
    pc, tc = cfg.pipeline, cfg.train
    want = PIPELINE_SCHEDULES[pc.schedule].policy
    if cfg.delay.policy != want:
        fits = [
            n for n, s in PIPELINE_SCHEDULES.items() if s.runtime and s.policy == cfg.delay.policy
        ]
        fix = f"--pipeline.schedule {' or '.join(fits)}, or " if fits else ""
        raise ConfigError(
            f"pipeline.schedule {pc.schedule} realises delay policy {want!r}, but delay.policy is "
            f"{cfg.delay.policy!r}; pass {fix}--delay.policy {want}"
        )
    # wpipe's even stage count, each schedule's microbatch rule (`ScheduleSpec.sizes`) and the
    # batch split are ExperimentConfig's own checks, so a config that reaches here passed them.
    try:  # whatever else the generator refuses, in the runtime's own option names
        runtime_schedule(cfg, num_steps=min(tc.num_steps, 2))
    except ConfigError as e:
        raise ConfigError(
            f"pipeline.schedule {pc.schedule} with pipeline.num_stages {pc.num_stages} and "
            f"train.num_microbatches {tc.num_microbatches} is refused by its generator: {e}"
        ) from None


def runtime_schedule(cfg: ExperimentConfig, num_steps: int | None = None) -> PipelineSchedule:
    """The schedule the runtime executes for `cfg`: pipeline.num_chunks stages per process.
    Interleaved 1F1B runs its ranks as generated (rank r: stages r, r + R, ...). WPipe's
    generator puts two stages (one of each group) on each of num_stages / 2 ranks; the runtime
    runs every stage in its own process, each in its rank's order (`one_stage_per_rank`)."""
    pc, tc = cfg.pipeline, cfg.train
    steps = tc.num_steps if num_steps is None else num_steps
    delay = DelaySchedule.build(cfg.delay, pc.num_stages, steps, train=tc)
    sched = pipeline_schedule_for(pc.schedule, delay, tc.num_microbatches, num_chunks=pc.num_chunks)
    if pc.num_chunks == 1:
        sched = one_stage_per_rank(sched)
    assert sched.num_stages == pc.num_stages, (sched.num_stages, pc.num_stages)
    assert sched.num_chunks == pc.num_chunks, (sched.num_chunks, pc.num_chunks)
    return sched


def run_worker(
    cfg: ExperimentConfig, start: StartUp = FRESH, *, verbose: bool = True, wrapped: bool = False
) -> WorkerResult:
    """Run this process's stage of `cfg` (environment from torchrun or `launch.train`) through
    the training loop. Any failure exits through an exception whose message names the rank;
    `main_worker` turns it into a non-zero exit. `wrapped`: a failure once training started
    (not a stop) is printed into the rank log and raised wrapped in `failures.WorkerFailed`."""
    check_config(cfg)
    pc, tc = cfg.pipeline, cfg.train
    topo = Topology.of(pc)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != topo.world_size:
        per = f" / pipeline.num_chunks {pc.num_chunks}" if pc.num_chunks > 1 else ""
        raise ConfigError(
            f"{world} processes for pipeline.num_stages {pc.num_stages}{per} x "
            f"pipeline.num_replicas {pc.num_replicas} = {topo.world_size}; start "
            f"{topo.world_size} processes (torchrun --nproc-per-node {topo.world_size})"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    check_device(cfg)  # every rank, before it touches a GPU: not "invalid device ordinal"
    device = torch.device(f"cuda:{local_rank}" if tc.device.startswith("cuda") else tc.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(tc.threads or 1)  # one thread per process unless asked
    set_tf32(tc.tf32, device)  # the emulator's policy (train.loop.train sets the same)
    backend = resolve_backend(pc.backend, str(device))
    joined = init_from_env(backend, pc.timeout_s)
    rank, records = joined.rank, joined.records
    cfg = with_resolved_optim(cfg)
    run_dir = Path(cfg.out_dir) / cfg.name
    with contextlib.ExitStack() as lease:  # under torchrun, rank 0's while the run writes
        if rank == 0 and not os.environ.get(PREPARED_ENV):  # no launcher did it
            lease.enter_context(begin_run(cfg, start, verbose=verbose))
        if rank == 0:  # shards of an interrupted save (maybe of another split): never commit them
            sharded.clear_staging(run_dir)
        # Before the groups are made (which waits only pipeline.timeout_s): under torchrun rank 0
        # may have prepared data for long.
        what = "the start-up (data preparation on rank 0)"
        t = max(pc.timeout_s, MAIN_WORK_TIMEOUT_S)
        barrier_on_store(topo, rank, "start-up", what, t, records)
        comm = Comm(topo, rank, backend, pc.timeout_s, device, records)
        restore = tee_rank_log(run_dir / "logs" / f"rank{rank}.log", console=rank == 0 and verbose)
        try:
            ckpt, hf = start.checkpoint(run_dir), start.hf_weights(run_dir)
            engine = PipelineEngine(cfg, comm, device, run_dir, ckpt, hf)
            result = run_loop(
                engine, cfg, run_dir, is_main=rank == 0, verbose=verbose and rank == 0
            )
            comm.barrier("the end of training")
            leave_process_group()
            return engine.worker_result(result if rank == 0 else None)
        except Preempted as e:  # every rank stops alike: rank 0 says so
            # ... but not at the same moment: a peer may still be receiving what this one sent
            # last (gloo completes a small send before it is read), so no one leaves before all.
            comm.barrier("the end of a stopped run", via_store=True)
            leave_process_group()
            if rank == 0:
                print(f"stalepipe: {e}", file=sys.stderr, flush=True)
            raise
        except KeyboardInterrupt:  # a second Ctrl-C: every rank stops at once, nothing to add
            raise
        except BaseException as e:
            # Into this rank's log while stdout/stderr still go there; main_worker does the rest.
            # Bad input under stalepipe's launcher: the log only, as the launcher says it once
            # (its ranks would each repeat the launcher's one line on the console).
            line = f"stalepipe: error: {error_line(e, rank)}"
            if isinstance(e, UserError) and os.environ.get(PREPARED_ENV):
                log_only(line)
            else:
                print(line, file=sys.stderr, flush=True)
            if wrapped:
                raise WorkerFailed(e, records) from e
            raise
        finally:
            restore()


def error_line(e: BaseException, rank: int) -> str:
    """The one line a failed rank prints: a peer error as is, anything else with its rank."""
    return str(e) if isinstance(e, PeerError) else f"rank {rank}: {type(e).__name__}: {e}"


@dataclass
class WorkerResult:
    """What one runtime process ends with: its final owned weights, the last stage's copy of a
    tied matrix, the most weight versions it kept, and (rank 0) the run's `TrainResult`."""

    rank: int
    stage: int  # its first stage
    stages: list[int]  # every stage it ran (several with chunks)
    weights: dict[str, torch.Tensor]
    tied_head: torch.Tensor | None
    peak_versions: int
    peak_sends: int  # the most sends to other processes held at once (bounded, not growing)
    losses: list[tuple[int, float]]
    val_losses: dict[int, float]
    result: TrainResult | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class PipelineEngine:
    """One process of the pipeline runtime (its stage, or its stages with chunks) as a
    training engine (`train.engine.Engine`).

    Builds only its own stages (`models.build_stage`, the values the whole model would have),
    the optimizer over their named parameters, wrapped in the delay engine's
    `DelayedOptimizer` (so versions, Taylor and EF are the emulator's code), and the schedule
    (`schedules.generators`, the lists the timing simulator times); `steps` executes this rank's
    list with `runtime.stage.StageExecutor`. Checkpoints: every process of replica 0 writes
    its stages' DCP shard under global names, rank 0 commits the checkpoint; a load reads only
    this process's parameters, from a checkpoint of any split (`rundir.checkpoint_parts`)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        comm: Comm,
        device: torch.device,
        run_dir: Path,
        start_from: Path | None = None,
        init_hf: Path | None = None,
    ) -> None:
        pc, tc = cfg.pipeline, cfg.train
        self.cfg, self.comm, self.device, self.run_dir = cfg, comm, device, run_dir
        self.rank, topo = comm.rank, comm.topo
        self.stages, self.replica = list(topo.stages_of(self.rank)), topo.replica_of(self.rank)
        self.pipe_rank = topo.pipe_rank(self.rank)
        P = pc.num_stages
        # The whole model only as shapes and names (meta device); this process materialises and
        # initialises its own stages, with the values the whole model would have.
        with torch.device("meta"):
            full = Transformer(cfg.model)
        split = pc.partition
        stages = partition(full, P, cfg.data.seq_len, split)
        self.modules = {
            s: build_stage(cfg.model, tc.seed, P, s, cfg.data.seq_len, device, split)
            for s in self.stages
        }
        for module in self.modules.values() if tc.compile else ():
            compile_blocks(module)  # the emulator's graphs: bitwise equal within the setting
        self.names_per_stage = [list(s.owned_parameters()) for s in stages]
        self.router_layers = [s.router_layers() for s in stages]
        own = {s: m.owned_parameters() for s, m in self.modules.items()}
        self.owned = {n: p for s in self.stages for n, p in own[s].items()}  # stage order
        if init_hf is not None:  # an HF model's weights: this process's stages, a tied head too
            mine = {n: p for m in self.modules.values() for n, p in m.named_parameters()}
            load_hf_weights(mine, cfg.model, init_hf)
        self.optimizer = build_optimizer(cfg.optim, list(self.owned.items()))
        set_peak_lr(self.optimizer)
        self.sched = runtime_schedule(cfg)
        self.delayed = DelayedOptimizer(
            self.optimizer,
            [own.get(s, {}) for s in range(P)],
            cfg.delay,
            delay=self.sched.delay,
        )
        self.start_step, self.resumed_from, self.tied_versions = 0, None, None
        if start_from is not None:  # a checkpoint (rundir.startup.StartUp.checkpoint)
            self._resume(start_from)
        if len(self.sched.ranks[0]) * P <= 20000:
            validate(self.sched)
        # collective (a process group): every process builds its engine at the same point
        self.votes = StepVotes(comm, max(lookahead(list(acts)) for acts in self.sched.ranks))
        self.executor: StageExecutor | None = None
        self.val_losses: dict[int, float] = {}
        self.losses: list[tuple[int, float]] = []

    def _resume(self, ckpt: Path) -> None:
        """A checkpoint of either format, engine and split: this process reads its own
        parameters' keys (and a tied head's owner's), re-split by name."""
        flat = open_checkpoint(ckpt)
        start = stage_ckpt.saved_split(flat)[0]
        needed = self.delayed.versions_to_keep(start)
        aliases = tied.aliases(self.cfg.model.tie_embeddings)
        extra = list(aliases.values()) if self.cfg.pipeline.num_stages - 1 in self.stages else []
        weights, dstate, per_param = stage_ckpt.stage_state(
            flat, self.stages, self.names_per_stage, self.optimizer.state_dict(), needed, extra
        )
        if dstate["policy"] is None:  # a checkpoint without delay state
            dstate["policy"] = self.cfg.delay.policy
        heads = {key: weights[source] for key, source in aliases.items() if source in weights}
        with torch.no_grad():
            for n, p in self.owned.items():
                p.copy_(weights[n])
            self.tied_versions = resume_head(
                self.cfg.model.tie_embeddings, self.modules, heads, per_param
            )
        with config_peak_lr(self.optimizer):
            self.delayed.load_state_dict(dstate)
        self.start_step, self.resumed_from = start, ckpt

    def _executor(self, plan: StepPlan, requests: Callable[[], int]) -> StageExecutor:
        cfg, tc, P = self.cfg, self.cfg.train, self.cfg.pipeline.num_stages
        B, D, m = tc.batch_size, cfg.pipeline.num_replicas, tc.num_microbatches
        get_batch = self._batch_reader()
        ios = [
            StageIO(
                module=self.modules[s],
                stage=s,
                comm=self.comm,
                get_batch=get_batch if s in (0, P - 1) else None,
                act_shape=(B // D // m, cfg.data.seq_len, cfg.model.dim),
                act_dtype=torch.float32,
                seed=tc.seed,
                autocast=(
                    (lambda: torch.autocast(device_type=self.device.type, dtype=torch.bfloat16))
                    if tc.dtype == "bfloat16"
                    else contextlib.nullcontext
                ),
            )
            for s in self.stages
        ]
        layout = ModelLayout(
            param_counts=[len(n) for n in self.names_per_stage],
            router_layers=self.router_layers,
            tied=cfg.model.tie_embeddings and P > 1,
            grad_clip=tc.grad_clip,
            per_expert=cfg.model.num_experts * cfg.model.num_layers <= 64,
        )
        return StageExecutor(
            ios,
            layout,
            self.delayed,
            self.sched,
            plan,
            self._eval_data(),
            self.tied_versions,
            self.votes,
            requests,
        )

    def _batch_reader(self) -> ReplicaBatches | None:
        """step -> this replica's microbatches (first and last stage only: inputs, targets)."""
        cfg, tc = self.cfg, self.cfg.train
        if not self._reads_data():
            return None
        loader = TokenLoader(self._data_dir(), "train", cfg.data.seq_len, cfg.data.seed)
        D, m = cfg.pipeline.num_replicas, tc.num_microbatches
        return ReplicaBatches(loader, tc.batch_size, self.replica, D, m, self.device)

    def _eval_data(self) -> EvalData:
        """The batches `train.emulated.evaluate` reads (whole batches of train.batch_size
        rows, replicas take turns), each run as chunks of the microbatch's size."""
        cfg, tc = self.cfg, self.cfg.train
        chunks = tc.num_microbatches * cfg.pipeline.num_replicas
        if not self._reads_data():
            return EvalData(None, tc.num_eval_batches)
        loader = TokenLoader(self._data_dir(), "val", cfg.data.seq_len, EVAL_SEED)

        def batch(i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            x, y = loader.batch(i, tc.batch_size)
            x, y = x.to(self.device).chunk(chunks), y.to(self.device).chunk(chunks)
            return list(zip(x, y, strict=True))

        return EvalData(batch, tc.num_eval_batches)

    def _reads_data(self) -> bool:
        return bool({0, self.cfg.pipeline.num_stages - 1} & set(self.stages))

    def _data_dir(self) -> Path:
        return run_data_dir(self.run_dir, self.cfg)  # the dir meta.json recorded

    # ---- the Engine interface ------------------------------------------------------------

    def steps(
        self, plan: StepPlan, requests: Callable[[], int] = no_requests
    ) -> Iterator[StepResult]:
        self.executor = self._executor(plan, requests)
        own = self.sched.ranks[self.pipe_rank]
        actions = [a for a in own if a.step >= self.start_step]
        for r in self.executor.run(actions):
            self.losses.append((r.step, r.loss))
            tau = self.sched.delay.taus(r.step)
            plan = self.executor.plan  # with what the processes agreed on so far
            agreed = plan.agreed_at(r.step)
            yield StepResult(r.step, r.loss, r.grad_norm, tau, r.lr, r.router, agreed)
            if plan.stops(r.step):  # checkpointed: end here, with every peer (runtime.stage_update)
                self.executor.settle()
                return

    def evaluate(self) -> float:
        assert self.executor is not None
        val = self.executor.evaluate()
        val = math.nan if val is None else val
        self.val_losses[self.delayed.step_count - 1] = val
        return val

    def evaluate_full(self) -> tuple[float, int]:
        raise NotImplementedError("refused by the config (ExperimentConfig._ignored)")

    def nonfinite_weights(self) -> str | None:
        # Non-finite weights are never checkpointed: this rank stops (its peers follow within
        # the timeout) and the newest complete checkpoint stays the last good one.
        ok = all(bool(torch.isfinite(p).all()) for p in self.owned.values())
        where = "stage" if len(self.stages) == 1 else "stages"
        return None if ok else f"non-finite weights on {where} {', '.join(map(str, self.stages))}"

    def checkpoint(self, step: int) -> Path | None:
        if self.replica == 0:  # the other replicas hold the same stage state
            tensors, meta = stage_ckpt.flatten_part(
                self.delayed.state_dict(),
                self.stages,
                {n: p.detach() for n, p in self.owned.items()},
                torch.get_rng_state() if self.pipe_rank == 0 else None,
            )
            sharded.save_part(self.run_dir, step, self.pipe_rank, tensors, meta)
        path = self._commit(step) if self.rank == 0 else None
        # The others wait for rank 0's commit here, with a deadline for long work, not in their
        # next receive (pipeline.timeout_s): a slow save is not a dead peer.
        timeout_s = max(self.cfg.pipeline.timeout_s, MAIN_WORK_TIMEOUT_S)
        self.comm.barrier(f"the checkpoint of step {step}", timeout_s, via_store=True)
        return path

    def _commit(self, step: int) -> Path:
        """Wait for every shard of replica 0 (failure records end the wait at once), then
        rename the staging directory into place and prune."""
        cfg, topo = self.cfg, self.comm.topo
        for r in range(topo.num_ranks):
            stage_ckpt.wait_part(
                self.run_dir, step, r, topo, cfg.pipeline.timeout_s, self.comm.records
            )
        manifest = {"config": cfg.to_dict(), "ranks": list(range(topo.num_ranks))}
        return commit_checkpoint(self.run_dir, step, manifest, cfg.train.keep_last)

    def worker_result(self, result: TrainResult | None) -> WorkerResult:
        ex = self.executor
        head = None if ex is None or ex.tied_live() is None else ex.tied_live().cpu()
        return WorkerResult(
            rank=self.rank,
            stage=self.stages[0],
            stages=self.stages,
            weights={n: p.detach().cpu().clone() for n, p in self.owned.items()},
            tied_head=head,
            peak_versions=0 if ex is None else ex.peak_versions,
            peak_sends=self.comm.peak_sends,
            losses=list(self.losses),
            val_losses={k: v for k, v in self.val_losses.items() if not math.isnan(v)},
            result=result,
        )
