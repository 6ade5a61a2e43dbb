"""Per-rank log files of the pipeline runtime: `<run dir>/logs/rank<r>.log`."""

from __future__ import annotations

import sys
from pathlib import Path


def tee_rank_log(path: Path, console: bool):
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
