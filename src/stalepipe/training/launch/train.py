"""`stalepipe train --pipeline.engine distributed` on one machine: open the run directory,
host the run's store, start one process per (stage, replica) and supervise them
(`launch.processes.supervise`). Under torchrun the process is already one of the workers and
runs it directly (`main_worker`).

Each started worker tees its output into its rank log first thing (`train.ranklog`), and every
worker ends through `run_rank`: on a failure it records its one line in the run's store (so the
other ranks and the launcher name it), prints it (and a bug's traceback) into its log, and exits
with the status docs/runtime.md lists: `UserError.exit_code` (2 bad input, 4 training failed,
75 preempted), `EXIT_PEER` when a peer failed, `EXIT_BUG` for anything else.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from pathlib import Path

from stalepipe.config import ExperimentConfig
from stalepipe.errors import EXIT_BUG, EXIT_PEER, EXIT_PREEMPTED, Preempted, UserError
from stalepipe.training.launch.processes import EXIT_INTERRUPTED, host_store, supervise, worker_env
from stalepipe.training.launch.server import rank_context
from stalepipe.training.peers.failures import Failure, WorkerFailed, launcher_records
from stalepipe.training.peers.group import PeerError
from stalepipe.training.peers.topology import Topology, under_torchrun
from stalepipe.training.rundir.checkpoint import latest_checkpoint
from stalepipe.training.rundir.startup import FRESH, StartUp, begin_run
from stalepipe.training.train.devices import check_device, machine_warnings
from stalepipe.training.train.loop import with_resolved_optim
from stalepipe.training.train.pipelined import PREPARED_ENV, check_config, error_line, run_worker
from stalepipe.training.train.ranklog import log_header, log_only, rank_log_path, tee_rank_log


def launch_train(cfg: ExperimentConfig, start: StartUp = FRESH, *, verbose: bool = True) -> int:
    """Run `cfg` on the distributed engine, started as `start` says; returns the exit status
    (0 = success, `EXIT_PREEMPTED` after a forwarded SIGTERM / SIGUSR1 stopped every rank with
    a checkpoint); a failed rank raises `TrainingError` (or `UserError`) naming it."""
    if under_torchrun():
        return main_worker(cfg, start, verbose)
    check_device(cfg)  # before anything is written or deleted
    check_config(cfg)
    cfg = with_resolved_optim(cfg)  # config.json records the values used
    with begin_run(cfg, start, verbose=verbose) as (_, run_dir):  # the lease: while ranks run
        for warning in [*cfg.warnings(), *machine_warnings(cfg)] if verbose else ():
            print(f"stalepipe: warning: {warning}", file=sys.stderr)
        pc = cfg.pipeline
        topo = Topology.of(pc)
        jobs = [(_train_rank, (cfg, start, verbose))] * topo.world_size  # PREPARED_ENV: opened
        return spawn_ranks(jobs, run_dir, pc.timeout_s, topo=topo, console=verbose)


def spawn_ranks(
    jobs: list[tuple[Callable, tuple]],
    run_dir: Path,
    timeout_s: float,
    *,
    topo: Topology | None = None,
    console: bool = True,
) -> int:
    """Host the run's store, start rank r running `jobs[r]` = (fn, args) (a module-level
    function: it is pickled, `rank_context`) through `run_rank`, teeing into its rank log under
    `run_dir`, and supervise them (`launch.processes.supervise`: its return value, or its
    error naming the rank that stopped first). After a preemption (`EXIT_PREEMPTED`) prints
    the one line saying where the checkpoint is and that `--resume` continues."""
    world = len(jobs)
    store = host_store()
    # The whole environment as it is now: a forkserver's child starts from the server's, which
    # was the launcher's when its first run started.
    env = {**os.environ, **worker_env(store, world), PREPARED_ENV: "1"}
    ctx = rank_context()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, _Stdio(), env, Path(run_dir), console and r == 0, fn, args),
            name=f"stalepipe-rank{r}",
        )
        for r, (fn, args) in enumerate(jobs)
    ]
    for p in procs:
        p.start()

    def kept() -> str:
        last = latest_checkpoint(run_dir)
        if last is None:
            return "no checkpoint was written"
        return f"the last complete checkpoint {last} stays loadable (--resume)"

    # A preempted run (exit 75): rank 0 has printed the step, the checkpoint and the command.
    return supervise(
        procs,
        timeout_s,
        log_path=functools.partial(rank_log_path, run_dir),
        store=store,
        topo=topo,
        checkpoint_note=kept,
    )


class _Stdio:
    """The launcher's stdout and stderr at the rank's start, handed to the rank: a forkserver's
    child would otherwise write where the server's went (the first launch's). Multiprocessing
    hands over the working directory and sys.path itself."""

    def __reduce__(self):
        return (_Stdio.Inherited, (reduction.DupFd(1), reduction.DupFd(2)))

    class Inherited:
        def __init__(self, out, err) -> None:
            self.fds = {1: out, 2: err}

        def enter(self) -> None:
            for fd, dup in self.fds.items():
                got = dup.detach()
                if got != fd:  # spawn passes the descriptor itself
                    os.dup2(got, fd)
                    os.close(got)


def _child(
    rank: int,
    stdio: _Stdio.Inherited,
    env: dict[str, str],
    run_dir: Path,
    console: bool,
    fn: Callable,
    args: tuple,
) -> None:
    """A started rank: the launcher's output and environment, its rank log from the first line
    on, then `run_rank`."""
    stdio.enter()
    os.environ.clear()
    os.environ.update(env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    tee_rank_log(rank_log_path(run_dir, rank), console=console, header=log_header(rank))
    _exit(run_rank(rank, fn, *args))  # no C++ teardown at exit (see stalepipe.__main__)


def _train_rank(cfg: ExperimentConfig, start: StartUp, verbose: bool) -> int:
    result = run_worker(cfg, start, verbose=verbose, wrapped=True)
    if result.result is not None and verbose:
        print(result.result.summary(), flush=True)
    return 0


def main_worker(cfg: ExperimentConfig, start: StartUp, verbose: bool = True) -> int:
    """Process entry under torchrun: run this rank's worker through `run_rank`."""
    rank = int(os.environ.get("RANK", "0"))
    log = rank_log_path(Path(cfg.out_dir) / cfg.name, rank)
    return run_rank(rank, _train_rank, cfg, start, verbose, log=log)


def run_rank(rank: int, fn: Callable, *args, log: Path | None = None, **kwargs) -> int:
    """Run `fn(*args, **kwargs)` as rank `rank`; return its status (0 when it returns None).
    On any failure: record it in the run's store for the other ranks and the launcher, print
    one line (and a bug's traceback) into this rank's log (`log`, joined when it exists: under
    torchrun the worker's own tee has ended by now) and exit at once with the documented status,
    without waiting for peers (no hang)."""
    try:
        return fn(*args, **kwargs) or 0
    except BaseException as e:  # noqa: BLE001 - every failure must end the process
        if log is not None and log.parent.is_dir():
            tee_rank_log(log, console=False)
        _exit_failed(rank, e)


def _exit_failed(rank: int, e: BaseException) -> None:
    logged, records = False, None
    if isinstance(e, WorkerFailed):  # run_worker printed it, and had joined the run's records
        logged, records, e = True, e.records, e.error
    if isinstance(e, SystemExit) and isinstance(e.code, int | None):
        _exit(e.code or 0)
    if isinstance(e, KeyboardInterrupt | Preempted):
        # Not a failure: nothing recorded. The launcher prints the run's one line.
        what = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else str(e)
        if rank == 0 and not os.environ.get(PREPARED_ENV):  # torchrun: nobody else says it
            print(f"stalepipe: {what}", file=sys.stderr, flush=True)
        else:
            log_only(f"stalepipe: rank {rank}: {what}")
        _exit(EXIT_INTERRUPTED if isinstance(e, KeyboardInterrupt) else EXIT_PREEMPTED)
    msg = error_line(e, rank)
    code = EXIT_BUG
    if isinstance(e, UserError):
        code = e.exit_code
    elif isinstance(e, PeerError):
        code = EXIT_PEER
    records = launcher_records() if records is None or records.store is None else records
    root = records.first()
    kind, peer = ("peer", e.peer) if isinstance(e, PeerError) else ("error", None)
    records.report(Failure(rank, kind, msg, peer=peer, code=code))
    if not logged:
        print(f"stalepipe: error: {msg}", file=sys.stderr, flush=True)
    if root is not None and root.line != msg:
        print(f"stalepipe: first failure reported: {root.line}", file=sys.stderr, flush=True)
    if code == EXIT_BUG:
        traceback.print_exception(e)
    _exit(code)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
