"""A run is trained by one owner at a time: a lease file in its directory, taken atomically.

Two sweeps on one directory, a resubmitted job array or a requeued job all plan the same
unfinished runs; without a lease each would train them, and two processes writing one run's
checkpoints and metrics make a run neither of them made. `lease_run` creates `.claim.json`
with `O_CREAT | O_EXCL` (atomic on a local and on an NFS v3+ file system), holding the owner's
host, pid, job id and start time; a daemon thread touches it every `heartbeat_s` seconds while
the run trains, and the owner removes it when done.

A lease is **stale**, and taken over, when its owner is dead: on the same host its pid no
longer runs; on any host its heartbeat (the file's mtime) is older than `stale_s`; or it is the
same SLURM job at a lower restart count (a requeued job finding its earlier incarnation's
lease; two live processes of one allocation do not take each other's). The takeover renames the stale file away first (only
one process can win that rename), so two takers never both proceed. A live lease raises
`RunLeased`: a sweep skips the run, `stalepipe train` stops with its one line.

`stalepipe train` holds the same lease while it writes (`rundir.startup.begin_run`: the one
process that owns the run directory, the launcher or rank 0), so two `train`s of one run, or a
`train --resume` beside a sweep's worker, never both write it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

from stalepipe.errors import EXIT_LEASED, UserError

LEASE_FILE = ".claim.json"  # the lease's file (its name from before the rename)
HEARTBEAT_S = 30.0
STALE_S = 300.0  # ten missed heartbeats


@dataclass(frozen=True)
class Owner:
    """Who holds a lease."""

    host: str
    pid: int
    job: str  # SLURM's array job + task or job id; "" outside SLURM
    started: str
    restart: int = 0  # SLURM_RESTART_COUNT: a requeued job's later incarnation has a higher one

    def describe(self) -> str:
        return f"{self.host}:{self.pid}" + (f" (job {self.job})" if self.job else "")


class RunLeased(UserError):
    """The run is being trained by a live owner elsewhere; `then` says what the caller does
    about it (a sweep: skipped; `train`: the ways on)."""

    exit_code = EXIT_LEASED

    def __init__(self, run_dir: Path, owner: Owner, then: str = "skipped") -> None:
        super().__init__(
            f"{run_dir} is being trained by {owner.describe()} since {owner.started}; {then}"
        )
        self.run_dir = run_dir
        self.owner = owner
        self.then = then

    def __reduce__(self) -> tuple:
        # pickled whole: rank 0 hands its refusal to the other ranks (train.distributed)
        return (type(self), (self.run_dir, self.owner, self.then))


def this_job() -> str:
    """This process's SLURM job: array job and task when in an array, else the job id."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID", "")


def _restarts() -> int:
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def owner_here() -> Owner:
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return Owner(socket.gethostname(), os.getpid(), this_job(), started, _restarts())


def read_lease(run_dir: Path) -> tuple[Owner, float] | None:
    """The lease's owner and the time of its last heartbeat; None when there is no lease. A
    torn or foreign file reads as an owner with no heartbeat (stale after `stale_s`)."""
    return read_lease_file(Path(run_dir) / LEASE_FILE)


def read_lease_file(path: Path) -> tuple[Owner, float] | None:
    """`read_lease` of one lease file."""
    try:
        beat = path.lstat().st_mtime
    except FileNotFoundError:
        return None
    try:
        if path.is_symlink():  # never read through one: a foreign lease, stale in time
            raise ValueError(f"{path} is a symbolic link")
        data = json.loads(path.read_text())
        fields = {k: data[k] for k in ("host", "pid", "job", "started")}
        return Owner(**fields, restart=int(data.get("restart", 0))), beat
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        # being written (created, not yet filled) or foreign: stale only once its file is
        # `stale_s` old, like a silent owner's
        return Owner("?", -1, "", "?"), beat


def took_over(run_dir: Path, stale: Owner) -> str:
    """The note a takeover of `stale`'s lease on `run_dir` prints."""
    why = "its owner is gone" if stale.pid >= 0 else "its file was never completed"
    return f"took over the stale lease of {run_dir} from {stale.describe()} ({why})"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it runs
        return True
    return True


def is_stale(owner: Owner, heartbeat: float, *, stale_s: float = STALE_S) -> bool:
    """Whether a lease's owner is gone (module docstring)."""
    if time.time() - heartbeat > stale_s:
        return True
    if owner.job and owner.job == this_job() and owner.restart < _restarts():
        return True  # this very job, requeued: its earlier incarnation is gone
    return owner.host == socket.gethostname() and owner.pid != os.getpid() and not _alive(owner.pid)


def live_owner(run_dir: Path, *, stale_s: float = STALE_S) -> Owner | None:
    """The owner of a live lease on `run_dir`, or None (no lease, or a stale one)."""
    found = read_lease(run_dir)
    if found is None or is_stale(*found, stale_s=stale_s):
        return None
    return found[0]


def _create(path: Path, owner: Owner) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(owner), f)
    return True


def _take(run_dir: Path, owner: Owner, stale_s: float, then: str) -> Owner | None:
    """Create the lease, taking over a stale one (returned: the owner it replaced, else None);
    RunLeased ending in `then` when a live owner holds it."""
    path, replaced = run_dir / LEASE_FILE, None
    for _ in range(3):
        if _create(path, owner):
            return replaced
        found = read_lease(run_dir)
        if found is not None and not is_stale(*found, stale_s=stale_s):
            raise RunLeased(run_dir, found[0], then)
        _move_stale(run_dir, found)
        replaced = found[0] if found is not None else replaced
    found = read_lease(run_dir)
    raise RunLeased(run_dir, found[0] if found else owner, then)


def restore_lease(run_dir: str | os.PathLike, owner: Owner | None, then: str = "skipped") -> None:
    """Put `owner`'s lease back into `run_dir` after its holder replaced the directory
    (`train --overwrite` deletes the old run, its lease file with it, and makes the directory
    anew); RunLeased when another process took the new directory's lease in between. Nothing
    when `owner` is None (the caller holds no lease)."""
    run_dir = Path(run_dir)
    if owner is None or _create(run_dir / LEASE_FILE, owner):
        return
    found = read_lease(run_dir)
    if found is None or found[0] != owner:
        raise RunLeased(run_dir, found[0] if found else owner, then)


def _move_stale(run_dir: Path, seen: tuple[Owner, float] | None) -> None:
    """Move the stale lease `seen` out of the way. Of several takers only one rename succeeds;
    a taker that moved a lease other than the one it judged (another taker's fresh lease,
    created in between) puts it back."""
    path = run_dir / LEASE_FILE
    moved = run_dir / f"{LEASE_FILE}.stale-{os.getpid()}-{time.time_ns()}"
    try:
        os.rename(path, moved)
    except FileNotFoundError:
        return  # another taker moved it
    now = read_lease_file(moved)
    if seen is not None and now is not None and now[0] != seen[0]:
        with suppress(FileExistsError):
            os.link(moved, path)  # a fresh lease: back where its owner expects it
    moved.unlink(missing_ok=True)


@contextmanager
def lease_run(
    run_dir: str | os.PathLike,
    *,
    heartbeat_s: float = HEARTBEAT_S,
    stale_s: float = STALE_S,
    then: str = "skipped",
    note: bool = False,
) -> Iterator[Owner]:
    """Hold `run_dir`'s lease while the body runs (module docstring); RunLeased ending in
    `then`, with nothing touched, when a live owner holds it. With `note`, taking over a stale
    lease is said in one line on stderr (a sweep takes them over silently: its log says what it
    ran). The directory must exist."""
    run_dir = Path(run_dir)
    owner = owner_here()
    replaced = _take(run_dir, owner, stale_s, then)
    if note and replaced is not None:
        print(f"stalepipe: note: {took_over(run_dir, replaced)}", file=sys.stderr, flush=True)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(heartbeat_s):
            try:
                os.utime(run_dir / LEASE_FILE)
            except OSError:  # a takeover race or a transient file-system error: try again,
                found = read_lease(run_dir)  # unless the lease is no longer ours
                if found is not None and found[0] != owner:
                    return

    thread = threading.Thread(target=beat, name="lease-heartbeat", daemon=True)
    thread.start()
    try:
        yield owner
    finally:
        stop.set()
        thread.join()
        found = read_lease(run_dir)
        if found is not None and found[0] == owner:
            (run_dir / LEASE_FILE).unlink(missing_ok=True)
        for old in run_dir.glob(f"{LEASE_FILE}.stale-*"):
            old.unlink(missing_ok=True)
