"""Jobs in spawned worker processes, one process per job, a few at a time (sweep, demo).

Each job runs in a fresh process started by spawn, never fork (a forked child would inherit
the parent's torch thread pool and locks), so a crash, even a segfault or an out-of-memory kill,
loses that job only. `kill PID` (SIGTERM) or Ctrl-C stops the running workers too.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Finished:
    """A job whose process has exited: `result` is what the function returned, `error` the
    exception it raised (None when it returned, or when the process died without a word)."""

    key: Any
    exitcode: int
    seconds: float
    result: Any = None
    error: BaseException | None = None


@dataclass
class _Worker:
    process: Any
    conn: Any  # the receiving end of the pipe the child sends its outcome through
    key: Any
    start: float
    message: tuple[str, Any] | None = None
    slot: int = 0  # which of the `workers` slots it runs in


def _child(conn: Any, fn: Callable[..., Any], args: tuple, env: dict[str, str]) -> None:
    """Worker body: run `fn(*args)` under `env` (added to the environment) and send ("ok",
    result) or ("error", exception) back."""
    os.environ.update(env)
    try:
        result = fn(*args)
    except Exception as e:  # sent to the parent, which decides; no traceback printed here
        try:
            conn.send(("error", e))
        except Exception:  # an exception that does not pickle
            conn.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))
        raise SystemExit(1) from None
    conn.send(("ok", result))


def _receive(w: _Worker) -> None:
    # Read as soon as it arrives: a result larger than the pipe's buffer would otherwise block
    # the child in send() while the parent waits for it to exit.
    try:
        if w.message is None and w.conn.poll():
            w.message = w.conn.recv()
    except EOFError:  # the child exited without sending (killed, or SystemExit)
        pass


def _start(
    ctx: Any, fn: Callable[..., Any], key: Any, args: tuple, slot: int, env: dict[str, str]
) -> _Worker:
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(send, fn, args, env), daemon=True)
    p.start()
    send.close()  # the child holds its own copy
    return _Worker(p, recv, key, time.perf_counter(), slot=slot)


def _finish(w: _Worker) -> Finished:
    w.process.join()
    _receive(w)
    status, value = w.message or ("died", None)
    return Finished(
        w.key,
        w.process.exitcode,
        time.perf_counter() - w.start,
        result=value if status == "ok" else None,
        error=value if status == "error" else None,
    )


def run_spawned(
    fn: Callable[..., Any],
    jobs: Sequence[tuple[Any, tuple]],
    workers: int,
    on_done: Callable[[Finished], None],
    slot_env: Callable[[int], dict[str, str]] | None = None,
) -> None:
    """Run `fn(*args)` for each `(key, args)` of `jobs` in its own spawned process, at most
    `workers` at once, in order; `on_done(Finished)` in this process as each one exits. `fn`
    must be a module-level function and its arguments and result picklable. `slot_env(slot)`
    adds to a job's environment by the slot (0..workers-1) it runs in, a slot being free again
    when its job exits: e.g. one GPU per slot (`gpu_slots`). An exception from
    `on_done`, SIGTERM or Ctrl-C terminates the running workers and propagates (SIGTERM as
    KeyboardInterrupt). Not for one job at a time in-process: call `fn` directly then."""
    ctx = mp.get_context("spawn")
    queue = list(jobs)
    running: list[_Worker] = []

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # `kill PID` stops the workers too (the finally below)

    old_handler = signal.signal(signal.SIGTERM, on_term)
    try:
        while queue or running:
            while queue and len(running) < workers:
                slot = min(set(range(workers)) - {w.slot for w in running})
                env = slot_env(slot) if slot_env else {}
                running.append(_start(ctx, fn, *queue.pop(0), slot, env))
            time.sleep(0.2)
            for w in list(running):
                _receive(w)
                if not w.process.is_alive():
                    running.remove(w)
                    on_done(_finish(w))
    finally:
        for w in running:  # interrupted: stop our own workers
            w.process.terminate()
            w.process.join()
        signal.signal(signal.SIGTERM, old_handler)


def gpu_slots(num_gpus: int) -> Callable[[int], dict[str, str]] | None:
    """One visible GPU per worker slot, round robin over `num_gpus` (None without GPUs): a
    run's `cuda` is its slot's GPU, so `--workers 8` on an 8-GPU node puts one run on each."""
    if num_gpus < 1:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d for d in visible.split(",") if d] if visible else [str(i) for i in range(num_gpus)]
    return lambda slot: {"CUDA_VISIBLE_DEVICES": ids[slot % len(ids)]}
