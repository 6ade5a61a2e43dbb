"""Progress: a bar on a terminal, plain periodic lines in a log (no carriage returns)."""

from __future__ import annotations

import io

from stalepipe.training.train.progress import Progress


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stream, total=100, initial=0, step_s=0.1, every_s=60.0, clock=None):
    clock = clock or FakeClock()
    p = Progress(total, initial=initial, stream=stream, every_s=every_s, clock=clock)
    for step in range(initial, total):
        clock.t += step_s
        p.update(loss=3.0 - step / 100, val_loss=float("nan"), tok_s=3781.2)
    p.close()
    return stream.getvalue()


def test_a_log_gets_a_plain_line_every_tenth_of_the_run():
    text = _run(io.StringIO())
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 10
    assert lines[0] == (
        "train: step 10/100 (10%) loss 2.9100 tok_s 3781 | 1s elapsed, eta 9s"
    )  # NaN (no eval yet) is left out
    assert lines[-1].startswith("train: step 100/100 (100%) loss 2.0100 tok_s 3781 | 10s elapsed")
    assert "eta" not in lines[-1]


def test_a_slow_run_prints_every_every_s_seconds():
    lines = _run(io.StringIO(), total=1000, step_s=1.0, every_s=30.0).splitlines()
    steps = [int(line.split()[2].split("/")[0]) for line in lines]
    assert steps[:4] == [30, 60, 90, 100]  # 30 s apart, and at each tenth (step 100)
    assert lines[1].endswith("| 1m00s elapsed, eta 15m40s")


def test_a_resumed_run_counts_from_its_start_and_ends_with_a_line():
    lines = _run(io.StringIO(), total=100, initial=42).splitlines()
    assert lines[0].startswith("train: step 50/100 (50%)")
    assert lines[-1].startswith("train: step 100/100")
    assert len(lines) == 6


def test_a_terminal_gets_the_bar():
    text = _run(Terminal(), total=20)
    assert "\r" in text and "20/20" in text and "step 20/20" not in text


def test_disabled_prints_nothing():
    stream = io.StringIO()
    p = Progress(10, enabled=False, stream=stream)
    p.update(loss=1.0)
    p.close()
    assert stream.getvalue() == ""
