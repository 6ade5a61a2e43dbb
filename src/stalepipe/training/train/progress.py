"""Training progress on stderr: a one-line bar (tqdm) on a terminal, plain lines otherwise.

Without a terminal (a SLURM or nohup log, a pipe) a bar's carriage-return updates pile up into
one endless line, so there the same numbers are printed as a plain line every tenth of the run
or every `every_s` seconds, whichever comes first, and once at the end:

    train: step 120/500 (24%) loss 2.3456 val_loss 2.4012 tok_s 3781 | 1m05s elapsed, eta 3m26s
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

LINES_PER_RUN = 10  # plain lines at every tenth of the run ...
EVERY_S = 60.0  # ... or after this many seconds without one


class Progress:
    """Progress over training steps; silent when disabled. `stream` defaults to stderr; a
    stream that is not a terminal gets plain periodic lines instead of a bar (module docstring)."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        enabled: bool = True,
        desc: str = "train",
        stream: TextIO | None = None,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        stream = stream if stream is not None else sys.stderr
        self._bar = None
        self._lines = None
        if enabled and _is_terminal(stream):
            self._bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                dynamic_ncols=True,
                file=stream,
                mininterval=0.25,
                leave=True,
            )
        elif enabled:
            self._lines = _Lines(total, initial, desc, stream, every_s, clock)

    def update(self, **postfix: float | None) -> None:
        """One step done; `postfix` are the numbers to show (None and NaN are left out)."""
        shown = {
            k: (f"{v:.4f}" if abs(v) < 1000 else f"{v:.0f}")
            for k, v in postfix.items()
            if v is not None and not math.isnan(v)
        }
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)
        elif self._lines is not None:
            self._lines.update(shown)

    def close(self) -> None:
        """End the bar, or print the last plain line if the last step has not been printed."""
        if self._bar is not None:
            self._bar.close()
        elif self._lines is not None:
            self._lines.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _Lines:
    """Plain progress lines: at each tenth of the run, every `every_s` seconds, and at the end."""

    def __init__(
        self,
        total: int,
        initial: int,
        desc: str,
        stream: TextIO,
        every_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.total, self.start, self.step, self.desc = total, initial, initial, desc
        self.stream, self.every_s, self.clock = stream, every_s, clock
        self.t0 = self.last_t = clock()
        self.printed_step = initial
        self.shown: dict[str, str] = {}

    def _next_mark(self) -> int:
        """The first tenth of the run after the last printed step."""
        tenth = self.total / LINES_PER_RUN
        return min(self.total, math.floor(self.printed_step / tenth + 1) * tenth)

    def update(self, shown: dict[str, str]) -> None:
        self.step += 1
        self.shown = shown
        now = self.clock()
        if self.step >= self._next_mark() or now - self.last_t >= self.every_s:
            self._print(now)

    def close(self) -> None:
        if self.step > self.printed_step:
            self._print(self.clock())

    def _print(self, now: float) -> None:
        elapsed = now - self.t0
        done = self.step - self.start
        left = self.total - self.step
        eta = f", eta {_duration(elapsed / done * left)}" if done and left > 0 else ""
        numbers = "".join(f" {k} {v}" for k, v in self.shown.items())
        pct = 100 * self.step // max(self.total, 1)
        self.stream.write(
            f"{self.desc}: step {self.step}/{self.total} ({pct}%){numbers} | "
            f"{_duration(elapsed)} elapsed{eta}\n"
        )
        self.stream.flush()
        self.printed_step, self.last_t = self.step, now


def _duration(seconds: float) -> str:
    """12s, 3m05s, 2h07m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
