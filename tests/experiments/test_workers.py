"""Spawned worker processes: each job's result, exception or exit status comes back to its key;
a failing callback stops the running workers. The jobs are builtins, so the spawned children
import nothing heavy."""

import operator
import os
import time

import pytest

from stalepipe.experiments.workers import run_spawned


def run_all(jobs, workers=2):
    done = {}
    run_spawned(operator.call, jobs, workers, lambda f: done.__setitem__(f.key, f))
    return done


@pytest.mark.timeout(120)
def test_each_job_reports_its_result_error_or_exit_status():
    done = run_all(
        [
            ("ok", (pow, 2, 10)),
            ("raises", (int, "x")),
            ("dies", (os._exit, 3)),
            ("big", (bytes, 1 << 20)),  # larger than a pipe's buffer: read while it runs
        ]
    )
    assert set(done) == {"ok", "raises", "dies", "big"}
    assert (done["ok"].exitcode, done["ok"].result, done["ok"].error) == (0, 1024, None)
    assert done["raises"].exitcode == 1 and isinstance(done["raises"].error, ValueError)
    assert (done["dies"].exitcode, done["dies"].result, done["dies"].error) == (3, None, None)
    assert done["big"].result == bytes(1 << 20)


@pytest.mark.timeout(120)
def test_an_error_in_on_done_stops_the_running_workers():
    def on_done(finished):
        raise RuntimeError(f"stop after {finished.key}")

    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="stop after fast"):
        run_spawned(operator.call, [("fast", (abs, -1)), ("slow", (time.sleep, 60))], 2, on_done)
    assert time.perf_counter() - t0 < 50  # the sleeping worker was terminated, not awaited
