"""Processes of the pipeline runtime: host the run's store, supervise spawned workers.

`supervise` waits for workers started with the `spawn` method (never fork: torch and threads).
The launcher hosts the run's rendezvous store (`host_store`, as torchrun's agent does), so the
failure records (`peers.failures.Failure`) outlive any worker: a worker that fails records its
line, and `supervise` records a worker that died without one (killed), which every waiting rank
reads at once. When a rank fails, the rest stop within seconds (a dead peer closes its
connections; a hung one is timed out after `pipeline.timeout_s`); what is still running when
every other rank has stopped because of a peer is hung, and is killed, as is what still runs
GRACE_S after a rank failed by itself (a rank waiting in a rendezvous, such as a process group
being made, waits `pipeline.timeout_s` and hears of no failure). The error names the rank
that stopped first: one that failed by itself, else the rank the others' peer errors blame,
else the one left running, and its log (`<run dir>/logs/rank<r>.log`).

Signals (preemption): SIGTERM and SIGUSR1 to the launcher are forwarded once to every worker,
which checkpoint and exit with `EXIT_PREEMPTED`; SIGINT is not forwarded (a terminal's Ctrl-C
reaches every process of the foreground group already). Workers that exit with
`EXIT_PREEMPTED` did not fail: when all stopped so, `supervise` returns `EXIT_PREEMPTED`.

Tests and benchmarks reuse started workers through `launch.pool.WorkerPool` instead.
`launch.train.launch_train` starts a training run with them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from stalepipe.errors import EXIT_PEER, EXIT_PREEMPTED, EXIT_USER, TrainingError, UserError
from stalepipe.fileio import open_append
from stalepipe.training.peers.failures import AGENT_STORE_ENV, Failure, FailureRecords
from stalepipe.training.peers.topology import Topology

GRACE_S = 10.0  # for the rest to stop after a rank's own failure (after a peer error: + timeout_s)
HUNG_GRACE_S = 2.0  # a rank still running this long after all others stopped is hung
EXIT_INTERRUPTED = 128 + signal.SIGINT  # a worker's status after Ctrl-C (KeyboardInterrupt)
FORWARDED = (signal.SIGTERM, signal.SIGUSR1)


def free_port() -> int:
    """A TCP port free on localhost right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_store(timeout_s: float = 300.0) -> Any:
    """Host the run's rendezvous store in this (the launcher's) process, on a free port."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def worker_env(store: Any, world: int) -> dict[str, str]:
    """The env:// variables of a world of `world` workers that join `store` (`host_store`)."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        AGENT_STORE_ENV: str(True),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


def _signame(sig: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(sig).name
    return f"signal {sig}"


@dataclass
class _Watch:
    """What `supervise` saw: when each rank exited, the ranks it killed, the signals it got."""

    procs: list
    describe: Callable[[int], str]
    exited: dict[int, float] = field(default_factory=dict)
    killed: set[int] = field(default_factory=set)
    signals: list[int] = field(default_factory=list)

    def code(self, r: int) -> int:
        return self.procs[r].exitcode

    def failed(self) -> list[int]:
        """Ranks that exited neither cleanly nor preempted, in the order they exited."""
        ok = (0, EXIT_PREEMPTED, EXIT_INTERRUPTED, -signal.SIGINT)
        bad = [r for r in self.exited if self.code(r) not in ok]
        if signal.SIGINT not in self.signals:  # Ctrl-C's statuses count only after a Ctrl-C
            bad += [r for r in self.exited if self.code(r) in ok[2:]]
        return sorted(bad, key=self.exited.__getitem__)

    def alive(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if p.exitcode is None]

    def kill(self, ranks: list[int]) -> None:
        for r in ranks:
            self.killed.add(r)
            self.procs[r].kill()
        for r in ranks:
            self.procs[r].join(5)


@contextlib.contextmanager
def _forward_signals(watch: _Watch):
    """SIGTERM / SIGUSR1 to this process: forwarded (once each) to every running worker.
    SIGINT: noted, not forwarded (Ctrl-C reaches the workers itself). Main thread only (Python
    handles signals there); elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(sig: int, _frame: Any) -> None:
        if sig in watch.signals:
            return
        watch.signals.append(sig)
        for p in watch.procs:
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, sig)

    def note(sig: int, _frame: Any) -> None:
        if sig not in watch.signals:
            watch.signals.append(sig)

    old = {s: signal.signal(s, forward) for s in FORWARDED}
    old[signal.SIGINT] = signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def supervise(
    procs: list,
    timeout_s: float,
    *,
    log_path: Callable[[int], Path],
    store: Any = None,
    topo: Topology | None = None,
    checkpoint_note: Callable[[], str] | None = None,
) -> int:
    """Wait for the workers (ranks 0..n-1 in order), forwarding SIGTERM / SIGUSR1 to them.
    Returns 0 when all finished, `EXIT_PREEMPTED` when all stopped at a signal with a
    checkpoint (or finished). On a failure, records killed ranks in `store` (the run's, from
    `host_store`), lets the rest stop by themselves (at most GRACE_S after a rank failed by
    itself, timeout_s + GRACE_S after a peer error; a rank left running HUNG_GRACE_S after all
    others stopped because of a peer is hung), kills what is
    left, and raises: `TrainingError` naming the rank that stopped first and its log
    (`log_path(rank)`, where a line says what the launcher saw) or `UserError` with the
    worker's line when that rank stopped at bad input; KeyboardInterrupt when the ranks
    stopped at a Ctrl-C. `checkpoint_note()`: what the error says is kept."""
    describe = topo.describe if topo is not None else (lambda r: f"rank {r}")
    watch = _Watch(procs, describe)
    first_fail = own_fail = last_exit = None
    with _forward_signals(watch):
        while True:
            now = time.monotonic()
            for r, p in enumerate(procs):
                if p.exitcode is not None and r not in watch.exited:
                    watch.exited[r] = last_exit = now
                    if p.exitcode not in (0, EXIT_PREEMPTED):
                        _record_exit(store, r, p.exitcode, describe)
            alive = watch.alive()
            if not alive:
                break
            failed = watch.failed()
            if first_fail is None and failed:
                first_fail = now
            if own_fail is None and any(watch.code(r) != EXIT_PEER for r in failed):
                own_fail = now
            if first_fail is not None:
                # A dead rank's peers notice at once; a hung one's after timeout_s. Left
                # running after every other rank stopped because of a peer: hung. Once a rank
                # failed by itself (its line recorded, or killed), the rest have GRACE_S: one
                # waiting in a rendezvous (a group being made) never hears of it.
                peers_only = all(watch.code(r) == EXIT_PEER for r in watch.exited)
                deadline = first_fail + timeout_s if own_fail is None else own_fail
                if now > deadline + GRACE_S or (peers_only and now > last_exit + HUNG_GRACE_S):
                    watch.kill(alive)
                    break
            time.sleep(0.05)
    for r in range(len(procs)):
        watch.exited.setdefault(r, time.monotonic())
    failed = watch.failed()
    if not failed:
        codes = {watch.code(r) for r in range(len(procs))}
        if codes & {EXIT_INTERRUPTED, -signal.SIGINT}:
            raise KeyboardInterrupt
        return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0
    root, what = _root_cause(watch, failed, store, timeout_s)
    log = log_path(root)
    if watch.code(root) < 0:  # it could not say it itself
        _append(log, f"== stalepipe launcher: {what}")
    kept = checkpoint_note() if checkpoint_note else "see the run directory for checkpoints"
    rec = FailureRecords(store).of_rank(root)
    if watch.code(root) == EXIT_USER and rec is not None and root not in watch.killed:
        raise UserError(rec.line)  # bad input, found by the workers: their one line
    raise TrainingError(f"{what}; all ranks stopped. See {log}; {kept}")


def _append(path: Path, line: str) -> None:
    """One line at the end of a rank's log; never through a link (`fileio.open_append`), and
    a log that cannot take it only loses the line (the failure is reported anyway)."""
    with contextlib.suppress(OSError, UserError), open_append(path) as f:
        f.write(line + "\n")


def _record_exit(store: Any, rank: int, code: int, describe: Callable[[int], str]) -> None:
    """Record a rank that died without recording why (killed, or crashed below Python)."""
    if store is None or FailureRecords(store).of_rank(rank) is not None:
        return
    how = f"was killed ({_signame(-code)})" if code < 0 else f"exited with status {code}"
    FailureRecords(store).report(Failure(rank, "exit", f"{describe(rank)} {how}", code=code))


def _root_cause(watch: _Watch, failed: list[int], store: Any, timeout_s: float) -> tuple[int, str]:
    """(the rank that stopped first, what happened to it), from the exit statuses and the
    failure records: a rank that failed by itself; else the rank the peer errors blame that
    did not stop because of a peer itself (hung); else one that was left running."""
    describe, records = watch.describe, {r: FailureRecords(store).of_rank(r) for r in watch.exited}
    causes = [r for r in failed if watch.code(r) != EXIT_PEER and r not in watch.killed]
    if causes:
        # A killed rank first (it could not record); else the first to record (ranks record
        # before they exit, so that is more exact than the order their exits were seen in).
        first = FailureRecords(store).first()
        killed = [r for r in causes if watch.code(r) < 0]
        r = (killed or [first.rank if first and first.rank in causes else causes[0]])[0]
        code, rec = watch.code(r), records.get(r)
        if code < 0 and -code in watch.signals:
            return r, (
                f"{describe(r)} was stopped by the {_signame(-code)} the launcher forwarded "
                f"before it wrote a checkpoint"
            )
        if code < 0:
            return r, f"{describe(r)} was killed ({_signame(-code)})"
        if rec is not None and rec.kind == "error":
            kind = "crashed" if code == 1 else "failed"
            return r, f"{describe(r)} {kind} (exit status {code}): {rec.line}"
        return r, f"{describe(r)} exited with status {code}"
    blamers = sorted(
        (r for r, rec in records.items() if rec is not None and rec.kind == "peer"),
        key=watch.exited.__getitem__,
    )
    for b in blamers:
        peer = records[b].peer
        if peer is not None and (peer in watch.killed or watch.code(peer) != EXIT_PEER):
            return peer, (
                f"{describe(peer)} stopped responding: {describe(b)} waited {timeout_s:g}s "
                f"for it, and the launcher killed it"
            )
    if watch.killed:
        r = min(watch.killed)
        return r, (
            f"{describe(r)} stopped responding: it was still running after the others had "
            f"stopped, and the launcher killed it"
        )
    f = FailureRecords(store).first()
    r = f.rank if f is not None and f.rank in failed else failed[0]
    return r, f"{describe(r)} failed (exit status {watch.code(r)})" + (
        f": {f.line}" if f is not None and f.rank == r else ""
    )
