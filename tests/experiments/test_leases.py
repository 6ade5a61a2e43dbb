"""A run is trained by one owner at a time (rundir/lease.py): the lease file, its takeover
rules, and two concurrent sweeps on one directory training each run exactly once."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from stalepipe.training.rundir.lease import LEASE_FILE, RunLeased, lease_run, live_owner, read_lease


def test_a_lease_being_written_is_not_taken_over(tmp_path):
    """A lease file created but not yet filled (or unreadable) is stale only once its file is
    old, never at once: the taker would otherwise race its owner."""
    (tmp_path / LEASE_FILE).write_text("")
    with pytest.raises(RunLeased), lease_run(tmp_path):
        pass
    old = time.time() - 600
    os.utime(tmp_path / LEASE_FILE, (old, old))
    with lease_run(tmp_path):
        pass


def _write_lease(run_dir, *, host=None, pid=None, job="", age_s=0.0):
    owner = {"host": host or socket.gethostname(), "pid": pid or os.getpid(), "job": job,
             "started": "then"}  # fmt: skip
    (run_dir / LEASE_FILE).write_text(json.dumps(owner))
    t = time.time() - age_s
    os.utime(run_dir / LEASE_FILE, (t, t))


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_lease_is_held_while_the_body_runs_and_released_after(tmp_path):
    with lease_run(tmp_path, heartbeat_s=0.05) as me:
        owner, beat = read_lease(tmp_path)
        assert owner == me and owner.pid == os.getpid()
        time.sleep(0.2)
        assert read_lease(tmp_path)[1] > beat  # the heartbeat touched it
    assert read_lease(tmp_path) is None and not list(tmp_path.iterdir())


def test_a_live_lease_refuses_and_a_dead_one_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    other = {"host": "elsewhere", "pid": 1}
    _write_lease(tmp_path, **other)  # another host, fresh heartbeat: live
    with pytest.raises(RunLeased, match="elsewhere:1"), lease_run(tmp_path):
        pass
    assert read_lease(tmp_path)[0].host == "elsewhere"  # untouched
    _write_lease(tmp_path, **other, age_s=600)  # no heartbeat for 10 minutes: stale
    assert live_owner(tmp_path) is None
    with lease_run(tmp_path) as me:
        assert read_lease(tmp_path)[0] == me
    _write_lease(tmp_path, pid=_dead_pid())  # this host, its process gone: stale at once
    with lease_run(tmp_path):
        pass
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # a live process of the same allocation: live
    _write_lease(tmp_path, host="node1", pid=1, job="77")
    with pytest.raises(RunLeased), lease_run(tmp_path):
        pass
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the job requeued finds its own lease
    with lease_run(tmp_path) as me:
        assert me.job == "77" and me.restart == 1
    _write_lease(tmp_path, host="node1", pid=1, job="78")  # another job: live
    with pytest.raises(RunLeased), lease_run(tmp_path):
        pass


SWEEP = """
import json, sys
from stalepipe.config import ExperimentConfig
from stalepipe.lab.sweeps.grid import expand
from stalepipe.lab.sweeps.sweep import run_sweep
from stalepipe.training.launch import task as trainer
base = ExperimentConfig.from_dict(json.loads(sys.argv[1]))
specs = expand([[("sync", {"delay.policy": "sync"}), ("2bw", {"delay.policy": "2bw"})]],
               seeds=[0, 1])
res = run_sweep(trainer, specs, base, sys.argv[2], log=lambda m: None)
print(json.dumps({"ran": res.ran, "elsewhere": res.elsewhere, "failed": list(res.failed)}))
"""


def test_two_concurrent_sweeps_on_one_directory_train_each_run_once(tiny_config, tmp_path):
    base = dataclasses.replace(
        tiny_config, train=dataclasses.replace(tiny_config.train, num_steps=30, eval_every=0)
    )
    out = tmp_path / "sweep"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", SWEEP, json.dumps(base.to_dict()), str(out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [json.loads(p.communicate(timeout=300)[0].splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    ran = [name for r in results for name in r["ran"]]
    assert sorted(ran) == ["2bw_s0", "2bw_s1", "sync_s0", "sync_s1"]  # each once, none twice
    assert not any(r["failed"] for r in results)
    for name in ran:  # one invocation each: nobody resumed or restarted another's run
        meta = json.loads((out / name / "meta.json").read_text())
        assert len(meta["invocations"]) == 1 and not (out / name / LEASE_FILE).exists()
