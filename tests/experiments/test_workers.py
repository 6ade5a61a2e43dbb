"""Spawned worker processes: each job's result, exception or exit status comes back to its key;
a failing callback stops the running workers. The jobs are builtins, so the spawned children
import nothing heavy."""

import operator
import os
import time

import pytest

from stalepipe.lab.sweeps.workers import run_spawned


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


def test_each_slot_gets_its_own_gpu_round_robin(monkeypatch):
    """`gpu_slots`: one visible GPU per worker slot (the CUDA_VISIBLE_DEVICES already set, else
    0..N-1), and run_spawned gives a job its slot's environment: jobs running together never
    share a GPU, and a freed slot's GPU goes to the next job."""
    from stalepipe.lab.sweeps.workers import gpu_slots

    assert gpu_slots(0) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [gpu_slots(2)(s)["CUDA_VISIBLE_DEVICES"] for s in range(3)] == ["0", "1", "0"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    slots = gpu_slots(2)
    assert [slots(s)["CUDA_VISIBLE_DEVICES"] for s in range(2)] == ["4", "5"]
    done = {}
    # each job reports the GPU its environment names
    jobs = [(i, (os.getenv, "CUDA_VISIBLE_DEVICES")) for i in range(4)]
    run_spawned(operator.call, jobs, 2, lambda f: done.__setitem__(f.key, f.result), slots)
    assert sorted(done) == [0, 1, 2, 3] and set(done.values()) <= {"4", "5"}
    assert done[0] == "4" and done[1] == "5"  # the first two start together, one slot each
