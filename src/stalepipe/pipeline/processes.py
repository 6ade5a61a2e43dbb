"""Processes of the pipeline runtime: pick a port, supervise spawned workers.

`supervise` waits for workers started with the `spawn` method (never fork: torch and threads):
if one exits non-zero, the others get `pipeline.timeout_s` (+ a grace period) to notice and
exit themselves, then are killed, and the error names the first rank that failed and its log
file (`<run dir>/logs/rank<r>.log`). `WorkerPool` keeps spawned workers alive across runs
(tests, benchmarks). `train.launch.launch_train` starts a training run with them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from pathlib import Path

from stalepipe.errors import TrainingError

GRACE_S = 10.0
PEER_EXIT = 3  # a worker's exit status when it stopped because a peer failed (not the cause)


def free_port() -> int:
    """A TCP port free on localhost right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def supervise(procs: list, run_dir: Path, timeout_s: float) -> int:
    """Wait for the workers; after the first failure give the rest timeout_s + GRACE_S to exit
    on their own (they notice a dead peer at once, a hung one after timeout_s), then kill
    them. Raises TrainingError naming the failed rank: the first one that failed by itself
    (killed, crashed) rather than because a peer did (exit status PEER_EXIT), when any did."""
    first: tuple[int, int] | None = None
    deadline = None
    try:
        while True:
            alive = [p for p in procs if p.exitcode is None]
            if first is None or first[1] == PEER_EXIT:
                failed = [
                    (r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                ]
                # A dead rank's neighbours notice at once and may be reaped in the same poll.
                causes = [f for f in failed if f[1] != PEER_EXIT]
                if causes or (failed and first is None):
                    first = (causes or failed)[0]
                if failed and deadline is None:
                    deadline = time.monotonic() + timeout_s + GRACE_S
            if not alive:
                break
            if deadline is not None and time.monotonic() > deadline:
                for p in alive:
                    p.kill()
                for p in alive:
                    p.join(5)
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        for p in procs:
            p.join(5)
        raise
    if first is None:
        return 0
    r, code = first
    how = f"exit code {code}" if code > 0 else f"signal {-code}"
    raise TrainingError(
        f"rank {r} failed ({how}); all ranks stopped. See {Path(run_dir) / 'logs' / f'rank{r}.log'}"
        f"; the last complete checkpoint in {run_dir} stays loadable (--resume)"
    )


# ---------------------------------------------------------------------------------------------
# A pool of started workers, for many short runs (tests, sweeps, benchmarks)
# ---------------------------------------------------------------------------------------------


def _pool_worker(index: int, jobs, results) -> None:
    import torch
    import torch.distributed as dist

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
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((index, out))


class WorkerPool:
    """`size` spawned processes that run world-sized jobs one after another, so that each run
    pays for a process group, not for starting Python and importing torch again.

    `pool.run(fn, args, world)` calls `fn(*args)` on ranks 0..world-1 with the env://
    variables set (fresh port each time) and returns the per-rank results; a rank's exception
    comes back as a RuntimeError naming the rank. Not for fault tests (a killed worker is gone).
    """

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.size = size
        self._jobs = [ctx.Queue() for _ in range(size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_pool_worker, args=(i, self._jobs[i], self._results), daemon=True)
            for i in range(size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, args: tuple, world: int, timeout_s: float = 300.0) -> list:
        assert world <= self.size, (world, self.size)
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
        }
        for i in range(world):
            self._jobs[i].put((fn, args, env))
        out: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        import queue

        while len(out) < world:
            try:
                i, res = self._results.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise TimeoutError(f"worker pool: no result within {timeout_s}s") from None
            out[i] = res
        errors = [f"rank {i}: {r[1]}" for i, r in sorted(out.items()) if r[0] == "error"]
        if errors:
            raise RuntimeError("; ".join(errors))
        return [out[i][1] for i in range(world)]

    def close(self) -> None:
        for q in self._jobs:
            q.put(None)
        for p in self._procs:
            p.join(5)
            if p.exitcode is None:
                p.kill()
