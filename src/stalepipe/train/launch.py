"""`stalepipe train --pipeline.engine distributed` on one machine: open the run directory,
spawn one process per (stage, replica) and supervise them (`pipeline.processes.supervise`). Under
torchrun the process is already one of the workers and runs it directly."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import sys

import torch.distributed as dist

from stalepipe.config import ExperimentConfig
from stalepipe.data import check_vocab, ensure_prepared
from stalepipe.errors import UserError
from stalepipe.optim import resolve_config
from stalepipe.pipeline.comm import PeerError, under_torchrun
from stalepipe.pipeline.processes import free_port, supervise
from stalepipe.train.pipelined import PREPARED_ENV, check_config, error_line, run_worker
from stalepipe.train.rundir import open_run_dir


def _child(cfg: ExperimentConfig, rank: int, env: dict[str, str], resume: bool, verbose: bool):
    os.environ.update(env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    sys.exit(main_worker(cfg, resume=resume, overwrite=False, verbose=verbose))


def launch_train(
    cfg: ExperimentConfig, *, resume: bool = False, overwrite: bool = False, verbose: bool = True
) -> int:
    """Run `cfg` on the distributed engine; returns the exit status (0 = success)."""
    if under_torchrun():
        return main_worker(cfg, resume=resume, overwrite=overwrite, verbose=verbose)
    check_config(cfg)
    data_dir = ensure_prepared(cfg.data)
    check_vocab(data_dir, cfg.model.vocab_size)
    cfg = dataclasses.replace(cfg, optim=resolve_config(cfg.optim))
    run_dir = open_run_dir(cfg, resume=resume, overwrite=overwrite)
    world = cfg.pipeline.num_stages * cfg.pipeline.data_parallel
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        PREPARED_ENV: "1",
    }
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_child, args=(cfg, r, env, resume, verbose), name=f"stalepipe-rank{r}")
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return supervise(procs, run_dir, cfg.pipeline.timeout_s)


def main_worker(cfg: ExperimentConfig, resume: bool, overwrite: bool, verbose: bool = True) -> int:
    """Process entry: run the worker; on any failure print one line naming the rank, record it
    for the others, and exit non-zero without waiting for peers (no hang): 2 for bad input,
    `launch.PEER_EXIT` when a peer failed, 1 otherwise."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = run_worker(cfg, resume=resume, overwrite=overwrite, verbose=verbose)
    except BaseException as e:  # noqa: BLE001 - every failure must end the process
        msg = error_line(e, rank)
        from stalepipe.pipeline.comm import _default_store, first_failure, report_failure
        from stalepipe.pipeline.processes import PEER_EXIT

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
    if result.result is not None and verbose:
        print(result.result.summary(), flush=True)
    return 0
