"""Run directories lose nothing: --overwrite deletes only a run directory stalepipe made and
marked, holding only a run's files (canary files survive every refusal); --resume needs a
checkpoint and a refused resume writes nothing; meta.json keeps every invocation; a failed
start never blocks a rerun; a run's data is found from any working directory."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stalepipe.cli import main
from stalepipe.errors import CheckpointError, DataError, UserError
from stalepipe.fileio import MARKER, NotOwnedError, make_owned_dir, mark_owned, remove_owned_dir
from stalepipe.training.rundir.checkpoint import list_checkpoints, remove_checkpoint
from stalepipe.training.rundir.directory import (
    RUN_ENTRIES,
    RUN_KIND,
    invocations,
    locate_run_data,
    open_run_dir,
    run_data_dir,
)
from stalepipe.training.rundir.resume import saved_run_location
from stalepipe.training.train.loop import train, with_resolved_optim


def _cfg(tiny_config, **train_fields):
    fields = {"num_steps": 2, "eval_every": 0, **train_fields}
    return dataclasses.replace(tiny_config, train=dataclasses.replace(tiny_config.train, **fields))


def _cli_args(cfg, *extra) -> list[str]:
    m = cfg.model
    return [
        "train", "--preset", "cpu-tiny", "--out_dir", cfg.out_dir, "--name", cfg.name,
        "--data.corpus", "excerpt", "--data.data_dir", cfg.data.data_dir,
        "--data.seq_len", "32", "--model.dim", str(m.dim), "--model.num_layers", "2",
        "--train.batch_size", "4", "--train.num_steps", "2", "--train.eval_every", "0",
        "--train.num_eval_batches", "1", "--train.progress", "false", *extra,
    ]  # fmt: skip


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _one_line_error(err: str) -> None:
    assert err.startswith("stalepipe: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_cli_overwrite_from_inside_a_run_refuses_and_deletes_nothing(tiny_config, tmp_path):
    """The real CLI (a subprocess), run from inside a finished run with --out_dir .. --name
    <itself> --overwrite: the run is the working directory, so nothing is deleted (exit 2)."""
    cfg = _cfg(tiny_config)
    run_dir = train(cfg, verbose=False).run_dir
    (tmp_path / "canary.txt").write_text("keep me")
    before = _snapshot(tmp_path)
    args = _cli_args(dataclasses.replace(cfg, out_dir=".."), "--overwrite")
    proc = subprocess.run(
        [sys.executable, "-m", "stalepipe", *args],
        cwd=run_dir,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    _one_line_error(proc.stderr)
    assert "refusing to delete" in proc.stderr and "choose another --name" in proc.stderr
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize(("name", "out_dir"), [("..", "runs"), (".", "runs"), ("work", "..")])
def test_cli_names_that_reach_parents_delete_nothing(tiny_config, tmp_path, monkeypatch, name,
                                                     out_dir, capsys):  # fmt: skip
    work = tmp_path / "work"
    (work / "runs" / "mine").mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    (work / "runs" / "mine" / "thesis.tex").write_text("precious")
    before = _snapshot(tmp_path)
    monkeypatch.chdir(work)
    cfg = dataclasses.replace(tiny_config, out_dir=out_dir, name="x")
    args = _cli_args(cfg, "--overwrite")
    args[args.index("--name") + 1] = name
    assert main(args) == 2
    _one_line_error(capsys.readouterr().err)
    assert _snapshot(tmp_path) == before


def test_overwrite_deletes_only_a_marked_run_with_only_run_files(tiny_config):
    cfg = _cfg(tiny_config)
    run_dir = train(cfg, verbose=False).run_dir
    assert json.loads((run_dir / MARKER).read_text())["kind"] == RUN_KIND
    (run_dir / "notes.txt").write_text("my notes")
    before = _snapshot(run_dir)
    with pytest.raises(NotOwnedError, match="holds 'notes.txt'.*choose another --name"):
        train(cfg, overwrite=True, verbose=False)
    assert _snapshot(run_dir) == before
    (run_dir / "notes.txt").unlink()
    (run_dir / MARKER).unlink()  # a run directory of an older stalepipe
    with pytest.raises(NotOwnedError, match="no .stalepipe.json marker.*delete it by hand"):
        train(cfg, overwrite=True, verbose=False)
    assert _snapshot(run_dir) == {k: v for k, v in before.items() if k not in ("notes.txt", MARKER)}
    mark_owned(run_dir, RUN_KIND)
    (run_dir / "logs").mkdir()  # what the pipeline runtime adds is a run's file too
    (run_dir / "logs" / "rank0.log").write_text("")
    train(cfg, overwrite=True, verbose=False)
    assert len(invocations(json.loads((run_dir / "meta.json").read_text()))) == 1  # a new run
    assert not (run_dir / "logs").exists()
    assert not [p for p in run_dir.parent.iterdir() if ".deleting-" in p.name]


def test_remove_owned_dir_rules(tmp_path, monkeypatch):
    def owned(path: Path, kind: str = "run") -> Path:
        make_owned_dir(path, kind)
        (path / "config.json").write_text("{}")
        return path

    outer = owned(tmp_path / "outer")
    inner = owned(outer / "inner")
    monkeypatch.chdir(inner)
    for target in (".", "..", inner, outer):  # the working directory and its parents
        with pytest.raises(NotOwnedError, match="or one of its parents"):
            remove_owned_dir(target, "run", ["config.json", "inner"], fix="choose another")
    monkeypatch.chdir(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(inner, target_is_directory=True)
    with pytest.raises(NotOwnedError, match="symbolic link"):
        remove_owned_dir(link, "run", ["config.json"], fix="x")
    with pytest.raises(NotOwnedError, match="not inside"):
        remove_owned_dir(outer, "run", ["config.json", "inner"], within=inner, fix="x")
    with pytest.raises(NotOwnedError, match="stalepipe export directory, not a run"):
        remove_owned_dir(owned(tmp_path / "exp", "export"), "run", ["config.json"], fix="x")
    with pytest.raises(NotOwnedError, match="holds 'inner'"):
        remove_owned_dir(outer, "run", ["config.json"], fix="x")
    assert inner.is_dir() and outer.is_dir()
    remove_owned_dir(inner, "run", ["config.json"], within=outer, fix="x")
    assert sorted(p.name for p in outer.iterdir()) == [MARKER, "config.json"]
    assert "logs" in RUN_ENTRIES and "ckpt_*" in RUN_ENTRIES


def test_resume_without_a_checkpoint_is_an_error_and_writes_nothing(tiny_config):
    cfg = _cfg(tiny_config)
    run_dir = train(cfg, verbose=False).run_dir
    for ckpt in list_checkpoints(run_dir):
        remove_checkpoint(ckpt)  # a run killed before its first checkpoint
    before = _snapshot(run_dir)
    with pytest.raises(CheckpointError, match="has no checkpoint .* --overwrite"):
        train(cfg, resume=True, verbose=False)
    with pytest.raises(UserError, match="already exists; pass --overwrite"):
        train(cfg, verbose=False)  # no checkpoint: --resume is not recommended
    assert _snapshot(run_dir) == before
    # a name that does not exist yet simply starts under --resume (requeue scripts)
    fresh = train(dataclasses.replace(cfg, name="new"), resume=True, verbose=False)
    assert json.loads((fresh.run_dir / "meta.json").read_text())["resumed"] is False


def test_refused_resume_writes_nothing(tiny_config):
    cfg = _cfg(tiny_config)
    run_dir = train(cfg, verbose=False).run_dir
    before = _snapshot(run_dir)
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.5))
    with pytest.raises(UserError, match="model.dropout"):
        train(other, resume=True, verbose=False)
    assert _snapshot(run_dir) == before
    last = list_checkpoints(run_dir)[-1]
    shard = next(last.glob("rank_*/*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    before = _snapshot(run_dir)
    with pytest.raises(
        CheckpointError,
        match=r"model-00001-of-00001.safetensors is 100 bytes, not \d+; move the checkpoint aside",
    ):
        open_run_dir(cfg, resume=True, overwrite=False)
    assert _snapshot(run_dir) == before


def test_meta_keeps_every_invocation(tiny_config):
    cfg = _cfg(tiny_config, num_steps=4, ckpt_every=2, keep_last=3)
    run_dir = train(cfg, verbose=False).run_dir
    first = json.loads((run_dir / "meta.json").read_text())
    assert [r["resumed_from_step"] for r in first["invocations"]] == [None]
    remove_checkpoint(list_checkpoints(run_dir)[-1])
    train(cfg, resume=True, verbose=False)
    meta = json.loads((run_dir / "meta.json").read_text())
    records = invocations(meta)
    assert len(records) == 2 and records[0] == first["invocations"][0]
    assert records[1]["resumed_from_step"] == 2 and meta["resumed"] is True
    # the first run's fields stay at the top (existing readers)
    assert {k: meta[k] for k in ("started", "argv", "git_commit", "host")} == {
        k: first[k] for k in ("started", "argv", "git_commit", "host")
    }
    assert (run_dir / records[1]["data_dir"]).resolve() == Path(cfg.data.data_dir).resolve()
    # what a study's wall time and a bitwise comparison across machines need
    assert len(records[1]["load_avg"]) == 3 and all(x >= 0 for x in records[1]["load_avg"])
    assert records[1]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert isinstance(records[1]["cpu"], str)
    # an older stalepipe's meta.json (no invocation list) becomes the first record
    legacy = {"stalepipe": "0.0.1", "argv": ["old"], "started": "then", "resumed": False}
    (run_dir / "meta.json").write_text(json.dumps(legacy))
    remove_checkpoint(list_checkpoints(run_dir)[-1])
    train(cfg, resume=True, verbose=False)
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["argv"] == ["old"] and meta["resumed"] is True
    assert invocations(meta)[0] == legacy and len(invocations(meta)) == 2


def test_failed_start_does_not_block_a_rerun(tiny_config):
    cfg = _cfg(tiny_config)
    run_dir = open_run_dir(cfg, resume=False, overwrite=False)  # then the start failed
    assert sorted(p.name for p in run_dir.iterdir()) == [MARKER, "config.json", "meta.json"]
    assert train(cfg, resume=True, verbose=False).steps == 2  # starts: nothing trained yet
    other = dataclasses.replace(cfg, name="other")
    open_run_dir(other, resume=False, overwrite=False)
    assert train(other, verbose=False).steps == 2


def test_a_users_directory_is_never_a_run(tiny_config):
    cfg = _cfg(tiny_config, num_steps=1)
    mine = Path(cfg.out_dir) / cfg.name
    mine.mkdir(parents=True)
    (mine / "config.json").write_text('{"my": "own config"}')
    before = _snapshot(mine)
    for resume, overwrite in ((False, False), (True, False), (False, True)):
        with pytest.raises(UserError, match="not a stalepipe run directory.*'config.json'"):
            open_run_dir(cfg, resume=resume, overwrite=overwrite)
    assert _snapshot(mine) == before


def test_run_data_is_found_from_any_working_directory(tiny_config, tmp_path, monkeypatch):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    shutil.copytree(tiny_config.data.data_dir, work / "data" / "ex")
    elsewhere.mkdir()
    monkeypatch.chdir(work)
    cfg = _cfg(dataclasses.replace(tiny_config, out_dir="runs"), num_steps=1)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, data_dir="data/ex"))
    run_dir = train(cfg, verbose=False).run_dir.resolve()
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["data"]["data_dir"] == "data/ex" and saved["out_dir"] == "runs"  # portable
    monkeypatch.chdir(elsewhere)
    want = (work / "data" / "ex").resolve()
    assert locate_run_data(run_dir, cfg) == want  # from meta.json
    assert run_data_dir(run_dir, cfg) == want
    (run_dir / "meta.json").unlink()  # a run of an older stalepipe: inferred from out_dir
    assert locate_run_data(run_dir, cfg) == want
    moved = shutil.move(run_dir, elsewhere / "moved")
    assert locate_run_data(moved, cfg) is None
    fix = "pass --data-dir DIR"
    with pytest.raises(DataError, match="data/ex\\) is not found from here; pass --data-dir DIR"):
        run_data_dir(moved, cfg, fix=fix)
    with pytest.raises(DataError, match="data.data_dir data/ex does not exist"):
        run_data_dir(moved, cfg)  # no fix given: ensure_prepared's own message


def test_an_absolute_out_dir_inside_the_working_directory_is_recorded_relative(
    tiny_config, tmp_path, monkeypatch
):
    """`--out /abs/work/runs` typed in /abs/work: config.json says "runs" (as meta.json's
    command line does), so the record names no machine's paths; a path outside the working
    directory stays as given."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cfg = _cfg(dataclasses.replace(tiny_config, out_dir=str(work / "runs")), num_steps=1)
    run_dir = open_run_dir(cfg, resume=False, overwrite=False)
    assert json.loads((run_dir / "config.json").read_text())["out_dir"] == "runs"
    outside = dataclasses.replace(cfg, out_dir=str(tmp_path / "elsewhere"))
    run_dir = open_run_dir(outside, resume=False, overwrite=False)
    assert json.loads((run_dir / "config.json").read_text())["out_dir"] == outside.out_dir


def test_resume_from_another_working_directory(tiny_config, tmp_path, monkeypatch):
    """`--config RUN/config.json --resume` from elsewhere continues the run in place (the
    CLI takes the run's location from saved_run_location), reading its recorded data, and
    config.json keeps its relative out_dir and data_dir."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    shutil.copytree(tiny_config.data.data_dir, work / "data" / "ex")
    elsewhere.mkdir()
    monkeypatch.chdir(work)
    cfg = _cfg(dataclasses.replace(tiny_config, out_dir="runs"), num_steps=4, ckpt_every=2)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, data_dir="data/ex"))
    run_dir = train(cfg, verbose=False).run_dir.resolve()
    remove_checkpoint(list_checkpoints(run_dir)[-1])
    saved_text = (run_dir / "config.json").read_text()
    monkeypatch.chdir(elsewhere)
    out_dir, name = saved_run_location(run_dir / "config.json")
    assert (Path(out_dir), name) == (run_dir.parent, "tiny")
    moved = with_resolved_optim(dataclasses.replace(cfg, out_dir=out_dir))  # as train() does
    data_dir = run_data_dir(run_dir, moved)
    assert data_dir == (work / "data" / "ex").resolve()
    open_run_dir(moved, resume=True, overwrite=False, data_dir=data_dir)
    assert (run_dir / "config.json").read_text() == saved_text  # out_dir still "runs"
    meta = json.loads((run_dir / "meta.json").read_text())
    # places relative to the run directory: no machine's paths in a committed record
    assert (run_dir / invocations(meta)[-1]["data_dir"]).resolve() == data_dir
    assert (run_dir / invocations(meta)[-1]["cwd"]).resolve() == elsewhere.resolve()
    assert not any(str(tmp_path) in json.dumps(r) for r in invocations(meta)[-1:])
    assert saved_run_location(tmp_path / "config.json") is None


def test_git_dirty_counts_code_not_docs_or_markdown(tmp_path, monkeypatch):
    """A sweep rewriting committed records under docs/, or an edited README, leaves a run's
    `git_dirty` False; a changed source file makes it True."""
    import subprocess

    import stalepipe
    from stalepipe.training.rundir.directory import git_dirty

    repo = tmp_path / "repo"
    for rel in ("src/pkg/__init__.py", "docs/results/run/sweep.json", "README.md"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text("x\n")

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                       check=True, capture_output=True)  # fmt: skip

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "init")
    monkeypatch.setattr(stalepipe, "__file__", str(repo / "src" / "pkg" / "__init__.py"))
    assert git_dirty() is False
    (repo / "docs/results/run/sweep.json").write_text("y\n")
    (repo / "README.md").write_text("y\n")
    assert git_dirty() is False
    (repo / "src/pkg/__init__.py").write_text("y\n")
    assert git_dirty() is True
