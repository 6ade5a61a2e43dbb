"""Runtime faults end fast, name the right rank and leave readable logs (real spawned processes,
gloo, short timeouts; each test ends within seconds of its fault and cannot hang):

- a peer killed before the survivor posts a send, a receive or a collective: a `PeerError`
  naming the peer, no traceback (the collective learns the rank from the launcher's record);
- a peer killed or crashed while rank 0 waits for its checkpoint part: rank 0 stops within a
  second (not after pipeline.timeout_s), and the crash's one line and traceback are in its log;
- bad input found by the ranks (a corrupt checkpoint): their one line, exit 2, no traceback;
- a hung rank (SIGSTOP) in the real runtime: the launcher names it, not rank 0, and kills it;
- SIGTERM / SIGUSR1 to the launcher reach every worker exactly once, SIGINT is not forwarded,
  and workers that exit with EXIT_PREEMPTED make the launcher return EXIT_PREEMPTED; Ctrl-C to
  the process group of a real run reaches every rank once and ends with a checkpoint.
The killed-worker run of the real runtime (exit code 4) is in test_resume_faults.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import operator
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from stalepipe.errors import EXIT_PEER, EXIT_PREEMPTED, EXIT_USER, TrainingError, UserError
from stalepipe.training.launch.processes import host_store, supervise, worker_env
from stalepipe.training.launch.train import launch_train, spawn_ranks
from stalepipe.training.peers.topology import Topology
from stalepipe.training.rundir.checkpoint import list_checkpoints, load_checkpoint
from stalepipe.training.rundir.checkpoint_parts import wait_part
from stalepipe.training.rundir.startup import StartUp

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _no_leftover_workers():
    yield
    for p in mp.active_children():
        if p.name.startswith("stalepipe-rank"):
            p.kill()
            p.join(5)


def _in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def target() -> None:
        try:
            box["rc"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def _worker(rank: int) -> mp.Process:
    deadline = time.monotonic() + 60
    while True:
        found = [p for p in mp.active_children() if p.name == f"stalepipe-rank{rank}"]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"rank {rank} never started"
        time.sleep(0.05)


def _wait_for(cond, what: str, timeout_s: float = 60, box: dict | None = None) -> None:
    """Wait for `cond`; with `box` (an `_in_thread` result), fail at once if the launcher in
    the thread already raised instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert not (box and "error" in box), f"waiting for {what}: {box['error']!r}"
        assert time.monotonic() < deadline, f"{what} within {timeout_s}s"
        time.sleep(0.05)


def _log(run_dir: Path, rank: int) -> str:
    path = run_dir / "logs" / f"rank{rank}.log"
    return path.read_text() if path.exists() else ""


# ---- posting to a dead peer ----------------------------------------------------------------

_POST = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    from stalepipe.training.runtime.comm import Comm
    from stalepipe.training.peers.group import PeerError, init_from_env
    from stalepipe.training.peers.topology import Topology

    joined = init_from_env("gloo", 10)
    rank = joined.rank
    comm = Comm(Topology(2), rank, "gloo", 10, "cpu", joined.records)
    t = torch.zeros(4)
    if rank == 1:
        comm.recv([t], (0, 1), "act", "x").wait()  # both pairs of channels connected
        comm.send([t], (1, 0), "grad", "y").wait()
        os.kill(os.getpid(), signal.SIGKILL)
    comm.send([t], (0, 1), "act", "x").wait()
    comm.recv([t], (1, 0), "grad", "y").wait()
    time.sleep(1.0)  # rank 1 is dead: gloo has seen its connections close
    op, t0 = sys.argv[1], time.monotonic()
    try:
        if op == "send":
            for _ in range(50):
                comm.send([t], (0, 1), "act", "the activation of step 1")
                time.sleep(0.01)
            comm.flush_sends()
        elif op == "recv":
            comm.recv([t], (1, 0), "grad", "the gradient of step 1").wait()
        else:
            work, _ = comm.all_gather(t)
            comm.wait_work(work, "the gradient-norm exchange of step 1", None)
    except PeerError as e:
        print(f"after {time.monotonic() - t0:.1f}s: {e} (peer {e.peer})", flush=True)
        os._exit(3)
    os._exit(0)
    """
)


class _Proc(subprocess.Popen):
    """A subprocess as `supervise` sees a worker (exitcode, join, kill)."""

    @property
    def exitcode(self) -> int | None:
        return self.poll()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(timeout)


@pytest.mark.parametrize("op", ["send", "recv", "all_gather"])
def test_a_dead_peer_is_a_peer_error_also_when_posting(op, tmp_path):
    store = host_store()  # as the launcher does: the store outlives the ranks
    env = {**os.environ, **worker_env(store, 2), "OMP_NUM_THREADS": "1"}
    procs = [
        _Proc(
            [sys.executable, "-c", _POST, op],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    with pytest.raises(TrainingError, match=r"rank 1 \(stage 1\) was killed \(SIGKILL\)"):
        supervise(
            procs, 10, log_path=lambda r: tmp_path / f"{r}.log", store=store, topo=Topology(2)
        )
    out, err = procs[0].communicate(timeout=5)
    assert procs[0].returncode == EXIT_PEER, (out, err)
    assert "Traceback" not in err, err
    line = out.strip().splitlines()[-1]
    # The survivor names the dead peer; a collective learns it from the launcher's record.
    assert "rank 0 (stage 0): rank 1 (stage 1) failed or stopped responding" in line, line
    assert line.endswith("(peer 1)"), line
    if op == "all_gather":
        assert "was killed (SIGKILL)" in line, line
    assert float(line.split("s:")[0].removeprefix("after ")) < 3, line


# ---- waiting for checkpoint parts -------------------------------------------------------------


def test_a_killed_peer_stops_the_wait_for_its_checkpoint_part_at_once(tmp_path):
    """timeout_s is 60: only the launcher's record of the kill can end the wait in seconds."""
    run = tmp_path / "run"
    jobs = [(wait_part, (run, 5, 1, Topology(2), 60.0)), (time.sleep, (120,))]
    thread, box = _in_thread(spawn_ranks, jobs, run, 60.0, topo=Topology(2), console=False)
    _wait_for(lambda: _log(run, 0) and _log(run, 1), "both ranks logging")
    time.sleep(0.5)  # rank 0 is in its wait
    t0 = time.monotonic()
    os.kill(_worker(1).pid, signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive()
    assert time.monotonic() - t0 < 5
    err = box.get("error")
    assert isinstance(err, TrainingError) and err.exit_code == 4, box
    assert "rank 1 (stage 1) was killed (SIGKILL)" in str(err)
    assert f"See {run / 'logs' / 'rank1.log'}" in str(err)
    log0 = _log(run, 0)
    assert log0.startswith("== stalepipe rank 0: pid ")  # the log starts before any work
    assert (
        "stalepipe: error: rank 0 (stage 0): rank 1 (stage 1) failed or stopped responding "
        "while waiting for the checkpoint part of rank 1 (stage 1) at step 5" in log0
    ), log0
    assert "Traceback" not in log0


def test_a_crashed_peer_leaves_its_error_and_traceback_in_its_log(tmp_path):
    run = tmp_path / "run"
    jobs = [(wait_part, (run, 3, 1, Topology(2), 60.0)), (operator.truediv, (1, 0))]
    t0 = time.monotonic()
    with pytest.raises(TrainingError) as err:
        spawn_ranks(jobs, run, 60.0, topo=Topology(2), console=False)
    assert time.monotonic() - t0 < 30  # spawning two interpreters included; not timeout_s
    assert err.value.exit_code == 4
    msg = str(err.value)
    assert "rank 1 (stage 1) crashed (exit status 1): rank 1: ZeroDivisionError" in msg, msg
    log1 = _log(run, 1)
    assert "stalepipe: error: rank 1: ZeroDivisionError: division by zero" in log1, log1
    assert "Traceback (most recent call last)" in log1 and "truediv" not in log1.split("\n")[0]
    log0 = _log(run, 0)
    assert "rank 1 (stage 1) failed or stopped responding" in log0, log0
    assert "rank 1: ZeroDivisionError" in log0  # the peer's own line, from its record


def test_bad_input_found_by_the_ranks_is_their_one_line_and_exit_2(tmp_path):
    run = tmp_path / "run"
    bad = tmp_path / "ckpt_00000004.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError) as err:
        spawn_ranks([(load_checkpoint, (bad,))] * 2, run, 10.0, topo=Topology(2), console=False)
    assert err.value.exit_code == EXIT_USER and not isinstance(err.value, TrainingError)
    assert re.fullmatch(
        rf"rank [01]: CheckpointError: checkpoint {re.escape(str(bad))} is corrupt or incomplete .*",
        str(err.value),
    )
    for r in range(2):
        log = _log(run, r)
        assert f"stalepipe: error: rank {r}: CheckpointError: checkpoint {bad}" in log, log
        assert "Traceback" not in log


# ---- a hung rank ------------------------------------------------------------------------------


def test_a_hung_rank_is_named_and_killed(make_cfg):
    cfg = make_cfg("1f1b", 3, 2, steps=2000, name="hang")
    # long enough that a healthy peer's step on a loaded 2-core machine never reaches it (5 s
    # did, with two sweeps and the rest of the suite beside it)
    timeout_s = 10
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, timeout_s=timeout_s))
    run = Path(cfg.out_dir) / cfg.name
    thread, box = _in_thread(launch_train, cfg, StartUp(overwrite=True), verbose=False)
    metrics = run / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, "training", 120, box)
    victim = _worker(2)
    t0 = time.monotonic()
    os.kill(victim.pid, signal.SIGSTOP)
    thread.join(3 * timeout_s)
    elapsed = time.monotonic() - t0
    assert not thread.is_alive(), "launcher still waiting"
    # its peers' timeout, then the launcher soon after: not a second timeout on top
    assert elapsed < 2 * timeout_s, elapsed
    err = box.get("error")
    assert isinstance(err, TrainingError) and err.exit_code == 4, box
    assert str(err).startswith("rank 2 (stage 2) stopped responding"), err
    assert victim.exitcode == -signal.SIGKILL  # the launcher killed it, nothing is left
    assert "== stalepipe launcher: rank 2 (stage 2) stopped responding" in _log(run, 2)
    for r in (0, 1):  # each survivor's one line is in its own log
        assert f"stalepipe: error: rank {r} (stage {r}): " in _log(run, r), _log(run, r)


# ---- preemption: the launcher forwards SIGTERM / SIGUSR1 ------------------------------------

_LAUNCHER = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from stalepipe.training.launch.train import spawn_ranks

    def worker(run):
        got = []
        for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(s, lambda sig, _f: got.append(sig))
        mark = Path(run, f"signals{os.environ['RANK']}")
        mark.write_text("")
        while not got:
            time.sleep(0.01)
        time.sleep(0.5)  # a second delivery would arrive now
        mark.write_text(" ".join(signal.Signals(s).name for s in got))
        os._exit(75)  # as a worker that wrote its checkpoint does

    if __name__ == "__main__":
        run = Path(sys.argv[1])
        sys.exit(spawn_ranks([(worker, (str(run),))] * 2, run, 10.0, console=False))
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_the_launcher_forwards_preemption_signals_once(sig, tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER)
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(run)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        marks = [run / f"signals{r}" for r in range(2)]
        _wait_for(lambda: all(m.exists() for m in marks), "workers ready")
        proc.send_signal(signal.SIGINT)  # to the launcher alone: not forwarded
        time.sleep(0.5)
        assert all(m.read_text() == "" for m in marks)
        proc.send_signal(sig)
        proc.send_signal(sig)  # forwarded once
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, (out, err)
    assert [m.read_text() for m in marks] == [sig.name] * 2
    # the line naming the step and the checkpoint is rank 0's (these fake workers print none)
    assert "Traceback" not in err, err


def test_ctrl_c_reaches_every_rank_once_and_the_run_stops_with_a_checkpoint(make_cfg, tmp_path):
    """Ctrl-C at a terminal signals the whole foreground process group, workers included; a
    launcher that forwarded it too would make it a second Ctrl-C ("stops at once", no
    checkpoint)."""
    cfg = make_cfg("2bw", 2, 2, steps=2000, name="ctrlc")
    path = tmp_path / "ctrlc.json"
    path.write_text(cfg.to_json())
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalepipe", "train", "--config", str(path)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    run = Path(cfg.out_dir) / cfg.name
    try:
        metrics = run / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, "training", 120)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "stopped by SIGINT after " in err and "--resume" in err, err
    assert list_checkpoints(run), err
