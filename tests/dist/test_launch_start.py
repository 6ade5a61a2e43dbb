"""The launcher's ranks fork from a forkserver started at its first launch; each must still
start from the launcher's environment, working directory and stdout as they are at its own
launch (`launch.train.rank_context`, `_Stdio`; multiprocessing hands over the directory)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from stalepipe.training.launch.train import rank_context, spawn_ranks


def _report(where: str) -> None:
    """A rank's job: what it started with, into a file; a line on the console (rank 0's)."""
    rank = os.environ["RANK"]
    seen = {"cwd": os.getcwd(), "var": os.environ.get("STALEPIPE_TEST_VAR"), "ppid": os.getppid()}
    Path(where, f"rank{rank}.json").write_text(json.dumps(seen))
    print(f"rank {rank} says hello", flush=True)


@contextlib.contextmanager
def _stdout_into(path: Path):
    """This process's file descriptor 1 into `path` while inside (what a shell's `>` does)."""
    saved = os.dup(1)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def test_each_launch_hands_its_ranks_the_environment_directory_and_output_of_its_moment(
    tmp_path, monkeypatch
):
    assert rank_context().get_start_method() == "forkserver"  # Linux has one
    for var in ("first", "second"):  # the second launch reuses the server the first started
        run = tmp_path / var
        run.mkdir()
        monkeypatch.setenv("STALEPIPE_TEST_VAR", var)
        monkeypatch.chdir(run)
        with _stdout_into(tmp_path / f"{var}.out"):
            assert spawn_ranks([(_report, (str(run),))] * 2, run, 60, console=True) == 0
        out = (tmp_path / f"{var}.out").read_text()
        for rank in (0, 1):
            seen = json.loads((run / f"rank{rank}.json").read_text())
            assert (seen["cwd"], seen["var"]) == (str(run), var), seen
            assert seen["ppid"] != os.getpid()  # the server's child, not this process's
            assert f"rank {rank} says hello" in (run / "logs" / f"rank{rank}.log").read_text()
        assert "rank 0 says hello" in out and "rank 1 says hello" not in out, out
