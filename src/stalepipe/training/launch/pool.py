"""A pool of started workers, for many short multi-process runs (tests, benchmarks).

Not on the training path: `stalepipe train` starts its workers once per run
(`launch.train`). A pooled run pays for a process group, not for starting Python and
importing torch again; `launch.pooled.worker_entry` runs one training worker on it.
"""

from __future__ import annotations

import os
import queue
import time

import torch

from stalepipe.training.launch.processes import host_store, worker_env
from stalepipe.training.launch.server import rank_context
from stalepipe.training.peers.group import leave_process_group


def _pool_worker(index: int, jobs, results) -> None:
    torch.set_num_threads(1)
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, args, env = job
        os.environ.update(env)
        os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(index)
        try:
            out = ("ok", fn(*args))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = ("error", f"{type(e).__name__}: {e}")
        finally:
            leave_process_group()
        results.put((index, out))


class WorkerPool:
    """Up to `size` processes that run world-sized jobs one after another, so that each run
    pays for a process group, not for starting Python and importing torch again. A worker
    starts when the first run that needs it does (a session whose runs use 2 ranks starts 2),
    as the launcher's ranks start (`launch.server.rank_context`: forked from the server that
    imported torch and the training code once, or spawned where there is no forkserver).

    `pool.run(fn, args, world)` calls `fn(*args)` on ranks 0..world-1 with the env://
    variables set and returns the per-rank results; a rank's exception comes back as a
    RuntimeError naming the rank. As under torchrun and `stalepipe train`, this process hosts
    each run's store (a fresh one per run) and every rank joins it as a client: rank 0 leaving
    first cannot take the store from a rank still using it. Not for fault tests (a killed
    worker is gone).
    """

    def __init__(self, size: int) -> None:
        self._ctx = rank_context()
        self.size = size
        self._jobs = [self._ctx.Queue() for _ in range(size)]
        self._results = self._ctx.Queue()
        self._procs: list = []

    def _start(self, world: int) -> None:
        """Start the workers up to rank world - 1 that are not running yet."""
        for i in range(len(self._procs), world):
            p = self._ctx.Process(
                target=_pool_worker, args=(i, self._jobs[i], self._results), daemon=True
            )
            p.start()
            self._procs.append(p)

    def run(self, fn, args: tuple, world: int, timeout_s: float = 300.0) -> list:
        assert world <= self.size, (world, self.size)
        self._start(world)
        store = host_store(timeout_s)  # held until every rank has answered
        env = {**worker_env(store, world), "OMP_NUM_THREADS": "1"}
        for i in range(world):
            self._jobs[i].put((fn, args, env))
        out: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) < world:
            try:
                i, res = self._results.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise TimeoutError(f"worker pool: no result within {timeout_s}s") from None
            out[i] = res
        del store
        errors = [f"rank {i}: {r[1]}" for i, r in sorted(out.items()) if r[0] == "error"]
        if errors:
            raise RuntimeError("; ".join(errors))
        return [out[i][1] for i in range(world)]

    def close(self) -> None:
        for q in self._jobs[: len(self._procs)]:
            q.put(None)
        for p in self._procs:
            p.join(5)
            if p.exitcode is None:
                p.kill()
