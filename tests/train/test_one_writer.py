"""One writer per run (issue 50): `stalepipe train` holds the run's lease (rundir/lease.py, the
one sweeps take) for as long as it writes, on both engines; a second `train` of that run is one
line naming the holder and exit 5; a stale lease is taken over with a note."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalepipe.cli import main
from stalepipe.errors import EXIT_LEASED
from stalepipe.fileio import make_owned_dir
from stalepipe.training.rundir.directory import RUN_KIND, open_run_dir
from stalepipe.training.rundir.lease import LEASE_FILE, lease_run, read_lease
from stalepipe.training.tools.trained import load_trained

NOTE = "stalepipe: note: took over the stale lease of"


def _args(tiny_config, *extra: str) -> list[str]:
    return [
        "train", "--preset", "cpu-tiny", "--out_dir", tiny_config.out_dir, "--name", "r",
        "--data.corpus", "excerpt", "--data.data_dir", tiny_config.data.data_dir,
        "--data.seq_len", "32", "--model.dim", "64", "--model.num_layers", "2",
        "--train.batch_size", "4", "--train.warmup_steps", "0", "--train.eval_every", "0",
        "--train.num_eval_batches", "1", "--train.progress", "false", *extra,
    ]  # fmt: skip


def _stalepipe(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "stalepipe", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _wait_for_lease(run_dir: Path, proc: subprocess.Popen, timeout_s: float = 120.0) -> int:
    """The pid in `run_dir`'s lease once the process `proc` started has taken it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = read_lease(run_dir)
        if found is not None and found[0].pid > 0:
            return found[0].pid
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"no lease in {run_dir} after {timeout_s}s")


def _second_train_is_refused(args: list[str], run_dir: Path, holder: int, capsys, real: bool):
    """A second `train` of the run (fresh and --resume) while `holder` writes it: one line
    naming the holder, exit 5, and the run directory as it was. `real`: the fresh try is a
    process of its own (its exit status); the others run `main` here (the same refusal as
    `test_a_live_lease_refuses_before_anything_is_read_or_made`, without another interpreter)."""
    before = sorted(p.name for p in run_dir.iterdir())
    for extra in ([], ["--resume"]):
        if real and not extra:
            done = subprocess.run(
                _stalepipe([*args, *extra]), capture_output=True, text=True, env=_env(), timeout=120
            )
            code, err = done.returncode, done.stderr
        else:
            code, err = main([*args, *extra]), capsys.readouterr().err
        assert code == EXIT_LEASED, err
        host = socket.gethostname()
        assert err.startswith(
            f"stalepipe: error: {run_dir} is being trained by {host}:{holder} since "
        ), err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert err.rstrip().endswith(
            "; wait for it to finish, or stop it (a lease whose process is gone is taken over); "
            "or choose another --name"
        )
        assert sorted(p.name for p in run_dir.iterdir()) == before


@pytest.mark.parametrize("engine", ["emulate", "distributed"])
def test_a_second_train_of_a_run_being_trained_is_refused(tiny_config, engine, capsys):
    """Two real processes: the first trains (paused while the second tries, so the test does
    not race its speed), the second is refused in one line naming it, the first finishes and
    its checkpoint loads. On the distributed engine the launcher holds the lease while its
    ranks run."""
    steps = "200" if engine == "emulate" else "6"
    args = _args(tiny_config, "--train.num_steps", steps, "--pipeline.engine", engine)
    if engine == "distributed":
        args += ["--pipeline.num_stages", "2"]
    run_dir = Path(tiny_config.out_dir) / "r"
    first = subprocess.Popen(
        _stalepipe(args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,  # its own process group: the launcher and its ranks
    )
    try:
        holder = _wait_for_lease(run_dir, first)
        assert holder == first.pid  # the launcher, not a rank
        os.killpg(first.pid, signal.SIGSTOP)  # alive, holding the lease, writing nothing
        try:
            _second_train_is_refused(args, run_dir, holder, capsys, real=engine == "emulate")
        finally:
            os.killpg(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    assert f"done: {steps} steps" in out
    assert not (run_dir / LEASE_FILE).exists()  # released
    assert load_trained(run_dir).step == int(steps)  # its checkpoint is whole and readable
    meta = json.loads((run_dir / "meta.json").read_text())
    assert len(meta["invocations"]) == 1  # the refused ones recorded nothing


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _plant_lease(run_dir: Path, pid: int) -> None:
    """The lease of a `train` killed after it took it (its directory made and marked)."""
    make_owned_dir(run_dir, RUN_KIND)
    owner = {"host": socket.gethostname(), "pid": pid, "job": "", "started": "then"}
    (run_dir / LEASE_FILE).write_text(json.dumps(owner))


def test_a_stale_lease_is_taken_over_with_a_note(tiny_config, capsys):
    """A lease left by a process that is gone (a killed train) does not block the run: it is
    taken over with one note, on a fresh start and on --resume."""
    run_dir = Path(tiny_config.out_dir) / "r"
    dead = _dead_pid()
    _plant_lease(run_dir, dead)
    assert main(_args(tiny_config, "--train.num_steps", "2")) == 0
    err = capsys.readouterr().err
    assert err.count(NOTE) == 1 and f":{dead} (its owner is gone)" in err
    assert not (run_dir / LEASE_FILE).exists()
    _plant_lease(run_dir, dead)
    assert main(_args(tiny_config, "--train.num_steps", "2", "--resume")) == 0
    out, err = capsys.readouterr()
    assert err.count(NOTE) == 1 and "has trained all 2 steps" in out
    assert not (run_dir / LEASE_FILE).exists() and load_trained(run_dir).step == 2


def test_a_live_lease_refuses_before_anything_is_read_or_made(tiny_config, capsys):
    """The refusal comes first: no data prepared, no directory made, no file of the run's
    touched, on both engines (the distributed launcher before it spawns a rank)."""
    run_dir = Path(tiny_config.out_dir) / "r"
    run_dir.mkdir(parents=True)
    with lease_run(run_dir) as me:  # a live holder: this very process, as another would be
        for engine in ("emulate", "distributed"):
            args = _args(tiny_config, "--train.num_steps", "2", "--pipeline.engine", engine)
            if engine == "distributed":
                args += ["--pipeline.num_stages", "2"]
            assert main(args) == EXIT_LEASED
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"by {me.host}:{me.pid} since {me.started}" in err
            assert sorted(p.name for p in run_dir.iterdir()) == [LEASE_FILE]


def test_overwrite_keeps_the_lease_it_deleted_with_the_old_run(tiny_config):
    """`--overwrite` deletes the old run, lease file and all: the new directory has the same
    owner's lease again before anything is written into it."""
    cfg = tiny_config
    assert main(_args(cfg, "--train.num_steps", "2")) == 0
    run_dir = Path(cfg.out_dir) / "r"
    cfg = dataclasses.replace(cfg, name="r")
    with lease_run(run_dir) as me:
        open_run_dir(cfg, resume=False, overwrite=True, lease=me)
        assert read_lease(run_dir)[0] == me and not (run_dir / "metrics.jsonl").exists()
    assert not (run_dir / LEASE_FILE).exists()
    assert main(_args(tiny_config, "--train.num_steps", "2", "--overwrite")) == 0
    assert not (run_dir / LEASE_FILE).exists()


def test_the_refusal_reaches_every_data_parallel_rank_whole():
    """Under torchrun rank 0 takes the lease and hands a refusal to the other ranks pickled
    (`train.distributed.on_main_outside_collectives`): it must arrive as the same line and
    exit status, not as a TypeError about missing arguments."""
    import pickle

    from stalepipe.training.rundir.lease import Owner, RunLeased
    from stalepipe.training.rundir.startup import LEASED_FIX

    e = RunLeased(Path("runs/a"), Owner("h", 42, "", "then"), LEASED_FIX)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is RunLeased and str(back) == str(e) and back.exit_code == EXIT_LEASED
    assert str(back).startswith("runs/a is being trained by h:42 since then; wait for it")
