"""Per-rank log files of the pipeline runtime: `<run dir>/logs/rank<r>.log`.

A rank's log holds everything the rank prints (stdout and stderr, Python-level), its one-line
error and, for a bug, its traceback; a fatal signal's Python traceback too (faulthandler). The
spawning launcher starts the tee first thing in each worker (`launch.train`), so nothing printed
before training starts is lost; a second `tee_rank_log` of the same file (the worker's own, in
`train.pipelined.run_worker`) joins the running one. Lines are flushed as they are written, so
a log is complete even when the process ends with `os._exit`.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from stalepipe.fileio import inside, open_append


def rank_log_path(run_dir: str | os.PathLike, rank: int) -> Path:
    """Where rank `rank` of the run in `run_dir` logs."""
    return Path(run_dir) / "logs" / f"rank{rank}.log"


class _Tee:
    """A text stream that writes to the log file and, when `show`, to the console stream."""

    def __init__(self, stream: TextIO, log: TextIO, path: Path, show: bool) -> None:
        self.stream, self.log, self.path, self.show = stream, log, path, show

    def write(self, s: str) -> int:
        self.log.write(s)
        if self.show:
            self.stream.write(s)
        return len(s)

    def flush(self) -> None:
        self.log.flush()
        if self.show:
            self.stream.flush()

    def isatty(self) -> bool:
        return self.show and self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


def active_log() -> Path | None:
    """The rank log this process tees into now, if any."""
    return sys.stderr.path if isinstance(sys.stderr, _Tee) else None


def tee_rank_log(path: Path, console: bool, header: str | None = None) -> Callable[[], None]:
    """Send this process's stdout/stderr to `path` (appended) as well: stdout also to the
    console when `console` (rank 0), stderr always (so failures show up). `header` goes to the
    file only. Returns the function that undoes it; when this process already tees into
    `path`, nothing changes and that function does nothing. The log is appended to without
    following a link, in a logs/ directory that does not lead out of its run
    (`fileio.open_append`: a LinkError otherwise)."""
    log = Path(path)
    run_dir = log.parent.parent  # rank_log_path: RUN/logs/rankN.log
    inside(run_dir, log.parent)
    path = log.resolve()
    if active_log() == path:
        return lambda: None
    log.parent.mkdir(parents=True, exist_ok=True)
    f = open_append(log, within=run_dir, buffering=1)  # closed by the returned function
    if header:
        f.write(header.rstrip("\n") + "\n")
    saved = sys.stdout, sys.stderr
    sys.stdout = _Tee(saved[0], f, path, console)
    sys.stderr = _Tee(saved[1], f, path, True)
    had_faulthandler = faulthandler.is_enabled()
    faulthandler.enable(file=f)  # a segfault's or abort's Python traceback lands in the log

    def restore() -> None:
        sys.stdout, sys.stderr = saved
        if had_faulthandler:
            faulthandler.enable(file=sys.__stderr__)
        else:
            faulthandler.disable()
        f.close()

    return restore


def log_header(rank: int) -> str:
    """The first line each launched rank writes into its log: who and where (the pid, to
    inspect a hung rank with py-spy or gdb), and when."""
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return f"== stalepipe rank {rank}: pid {os.getpid()} on {socket.gethostname()}, {now}"


def log_only(text: str) -> None:
    """Write `text` (one line) into the active rank log only, not to the console; nothing
    when this process tees into no log."""
    if isinstance(sys.stderr, _Tee):
        sys.stderr.log.write(text.rstrip("\n") + "\n")
