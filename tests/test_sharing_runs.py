"""Run and sweep directories someone else wrote (issue 50, docs/failures.md 'Sharing runs', 'Run
and sweep records'): no write goes through a symbolic link, no read or write through a link
that leads out of the directory, and text from records reaches reports as inert single lines.
Real files and real links in tmp_path; every refusal is one line, exit 2, the file outside
unchanged, and the fix it names works."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from stalepipe.cli import main
from stalepipe.errors import EXIT_USER
from stalepipe.fileio import (
    LinkError,
    csv_cell,
    inside,
    make_owned_dir,
    one_line,
    open_append,
    read_json_record,
    write_files,
    write_text_atomic,
)
from stalepipe.lab.analysis.markdown import md_code, md_fenced, md_text

_spec = importlib.util.spec_from_file_location(
    "analysis_curve_fixtures", Path(__file__).parent / "analysis" / "conftest.py"
)
assert _spec and _spec.loader
_curves = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_curves)
write_curve_run = _curves.write_curve_run
_synthetic_runs_leave_the_plateau_at_once = _curves._synthetic_runs_leave_the_plateau_at_once

SIM = ["--model", "smollm-135m", "--stages", "4", "--microbatches", "8"]
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAttackerKeyAttackerKeyAttackerKey attacker@evil"


@pytest.fixture
def sweep(tmp_path) -> Path:
    """A small finished sweep: sync and 2bw, two seeds each, with sweep.json groups."""
    root = tmp_path / "sweep"
    for s in range(2):
        write_curve_run(root, f"sync_s{s}", {"delay.policy": "sync"}, s, steps=40)
        write_curve_run(root, f"bw_s{s}", {"delay.policy": "2bw"}, s, stretch=1.3, steps=40)
    return root


@pytest.fixture
def outside(tmp_path) -> Path:
    """A file of the user's, outside every run and sweep."""
    path = tmp_path / "home" / "authorized_keys"
    path.parent.mkdir()
    path.write_text("ssh-ed25519 AAAAmine me@host\n")
    return path


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("stalepipe: error: ") and err.count("\n") == 1, err
    return err


def _fix_command(err: str, verb: str) -> str:
    """The shell command in a message's '(...)' that starts with `verb`."""
    found = re.search(rf"\(({verb} [^)]*)\)", err)
    assert found, err
    return found.group(1)


# --------------------------------------------------------------------------------------------
# The primitives
# --------------------------------------------------------------------------------------------


def test_an_atomic_write_refuses_a_link_at_its_path_live_or_dangling(tmp_path, outside):
    run = tmp_path / "run"
    run.mkdir()
    (run / "meta.json").symlink_to(outside)
    (run / "config.json").symlink_to(tmp_path / "nowhere" / "config.json")
    for name in ("meta.json", "config.json"):
        with pytest.raises(LinkError, match=f"refusing to write {run / name}: it is a symbolic"):
            write_text_atomic(run / name, "{}", within=run)
    assert outside.read_text() == "ssh-ed25519 AAAAmine me@host\n"
    assert not (tmp_path / "nowhere").exists()
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "meta.json"]  # no temp left
    assert LinkError("x").exit_code == EXIT_USER


def test_an_atomic_write_makes_its_file_as_open_would(tmp_path):
    old = os.umask(0o027)
    try:
        write_text_atomic(tmp_path / "a.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_an_append_never_follows_a_link(tmp_path, outside):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(LinkError, match="metrics.jsonl: it is a symbolic link"):
        open_append(run / "metrics.jsonl", within=run)
    assert not (tmp_path / "elsewhere.jsonl").exists()
    with open_append(run / "log.txt", within=run) as f:
        f.write("one\n")
    assert (run / "log.txt").read_text() == "one\n"
    os.mkfifo(run / "fifo.log")  # no reader: an open for writing would block
    with pytest.raises(LinkError, match="fifo.log: it is not a regular file; move it aside"):
        open_append(run / "fifo.log", within=run)


def test_a_link_out_of_the_directory_is_refused_and_one_inside_is_read(tmp_path, outside):
    real = tmp_path / "disk" / "run"
    real.mkdir(parents=True)
    run = tmp_path / "run"
    run.symlink_to(real, target_is_directory=True)  # the run directory itself may be a link
    (real / "config.json").write_text('{"a": 1}')
    (real / "copy.json").symlink_to("config.json")  # stays inside: fine
    assert read_json_record(run, run / "copy.json") == {"a": 1}
    (real / "stolen.json").symlink_to(outside)
    with pytest.raises(LinkError, match="stolen.json is a symbolic link to .*, outside"):
        read_json_record(run, run / "stolen.json")
    (real / "report").symlink_to(outside.parent, target_is_directory=True)
    with pytest.raises(LinkError, match="report is a symbolic link"):
        write_text_atomic(run / "report" / "report.md", "x", within=run)
    with pytest.raises(LinkError, match="report is a symbolic link"):
        make_owned_dir(run / "report", "run", within=run)
    assert sorted(p.name for p in outside.parent.iterdir()) == ["authorized_keys"]
    assert inside(run, run / "config.json") == run / "config.json"


def test_write_files_checks_every_file_before_writing_any(tmp_path, outside):
    out = tmp_path / "report"
    write_files(out, {"a.md": "old a", "b.csv": "old b"})
    (out / "c.csv").symlink_to(outside)
    with pytest.raises(LinkError, match="c.csv"):
        write_files(out, {"a.md": "new a", "b.csv": "new b", "c.csv": "new c"})
    assert (out / "a.md").read_text() == "old a" and (out / "b.csv").read_text() == "old b"
    assert outside.read_text().startswith("ssh-ed25519 AAAAmine")
    with pytest.raises(UnicodeEncodeError):  # text that cannot be written: nothing written
        write_files(out, {"a.md": "new a", "b.csv": "\udcff"})
    assert (out / "a.md").read_text() == "old a"


def test_record_text_is_one_inert_line():
    assert one_line("a\nb\r\u2028c\x85d\u202ee\udcff") == "a\\nb\\r\\u2028c\\x85d\\u202ee\\udcff"
    assert one_line("plain name_s0 +ef é") == "plain name_s0 +ef é"
    assert md_text("# g|`x`<b>[l](u)") == "\\# g\\|\\`x\\`\\<b>\\[l\\](u)"
    assert md_code("a`b") == "``a`b``"
    assert md_fenced("x ``` y\nz").startswith("````\n") and md_fenced("").startswith("```")
    assert [csv_cell(v) for v in ("=1+2", "@sum", "-x", "-0.5", "+1e3", "-", 3)] == [
        "'=1+2", "'@sum", "'-x", "-0.5", "+1e3", "-", 3,
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# report and verdict
# --------------------------------------------------------------------------------------------


def test_report_through_a_planted_link_is_refused_and_the_file_outside_kept(sweep, outside, capsys):
    (sweep / "report").mkdir()
    (sweep / "report" / "report.md").symlink_to(outside)
    assert main(["report", str(sweep)]) == EXIT_USER
    err = _one_line_error(capsys)
    assert f"refusing to write {sweep / 'report' / 'report.md'}: it is a symbolic link" in err
    assert outside.read_text() == "ssh-ed25519 AAAAmine me@host\n"
    assert sorted(p.name for p in (sweep / "report").iterdir()) == ["report.md"]  # nothing else
    subprocess.run(_fix_command(err, "rm"), shell=True, check=True)  # the fix it names works
    assert main(["report", str(sweep)]) == 0
    assert (sweep / "report" / "report.md").is_file() and outside.read_text().endswith("me@host\n")


def test_a_report_directory_that_leads_out_of_the_sweep_is_refused(sweep, outside, capsys):
    (sweep / "report").symlink_to(outside.parent, target_is_directory=True)
    assert main(["report", str(sweep)]) == EXIT_USER
    assert "report is a symbolic link to" in _one_line_error(capsys)
    assert sorted(p.name for p in outside.parent.iterdir()) == ["authorized_keys"]
    assert main(["report", str(sweep), "--out", str(outside.parent / "r")]) == 0  # asked for
    dangling = outside.parent / "dangling"
    dangling.symlink_to(outside.parent / "nowhere")  # an --out that is a link to nothing
    assert main(["report", str(sweep), "--out", str(dangling)]) == EXIT_USER
    assert "which is not a directory; create that directory" in _one_line_error(capsys)
    assert not (outside.parent / "nowhere").exists()


def test_a_record_linked_from_outside_is_refused_and_the_copy_it_names_works(
    sweep, tmp_path, capsys
):
    real = tmp_path / "elsewhere" / "metrics.jsonl"
    real.parent.mkdir()
    os.replace(sweep / "bw_s1" / "metrics.jsonl", real)
    (sweep / "bw_s1" / "metrics.jsonl").symlink_to(real)
    assert main(["report", str(sweep)]) == EXIT_USER
    err = _one_line_error(capsys)
    assert "bw_s1/metrics.jsonl is a symbolic link to" in err and "outside" in err
    assert not (sweep / "report").exists()
    subprocess.run(_fix_command(err, "cp"), shell=True, check=True)
    assert not (sweep / "bw_s1" / "metrics.jsonl").is_symlink()
    assert main(["report", str(sweep)]) == 0


def test_names_with_a_newline_or_an_undecodable_byte_cannot_start_a_line(sweep, capsys):
    """And none can break a plot: `$...$` in a label is text, not mathtext."""
    bad = os.fsdecode(os.path.join(os.fsencode(sweep), b"bw\n" + KEY.encode() + b"\xff_s2"))
    write_curve_run(sweep, os.path.basename(bad), {"delay.policy": "2bw"}, 2, stretch=1.3,
                    steps=40, group="bw\n" + KEY + "\n# heading <b>|`x` $\\frac{$")  # fmt: skip
    assert main(["report", str(sweep)]) == 0
    out = sweep / "report"
    md = (out / "report.md").read_bytes().decode("utf-8")  # written, and valid UTF-8
    assert not any(line.startswith(("ssh-ed25519", "# heading")) for line in md.splitlines())
    assert "bw\\\\n" + KEY + "\\\\n# heading \\<b>\\|\\`x\\`" in md  # inert: one cell
    html = (out / "report.html").read_text()
    assert "<b>" not in html and not any(line.startswith("ssh-") for line in html.splitlines())
    with open(out / "runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len((out / "runs.csv").read_text().splitlines()) == len(rows) + 1 == 6
    assert {r["run"] for r in rows} >= {"bw\\n" + KEY + "\\udcff_s2"}


def test_a_metrics_value_that_is_not_a_number_leaves_that_run_out_with_a_warning(sweep, capsys):
    path = sweep / "bw_s1" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[9] = json.dumps({"step": 9, "loss": 2.5, "val_loss": "2.4"})
    path.write_text("\n".join(lines) + "\n")
    assert main(["report", str(sweep)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stalepipe: warning: " in err
    assert "bw_s1/metrics.jsonl: the line of step 9 has val_loss '2.4', not a number" in err
    md = (sweep / "report" / "report.md").read_text()
    assert "unreadable, left out: bw_s1: metrics.jsonl: the line of step 9" in md
    with open(sweep / "report" / "runs.csv", newline="") as f:
        assert {r["run"]: r["status"] for r in csv.DictReader(f)}["bw_s1"] == "unreadable"


@pytest.mark.parametrize("content", ["null", "[1, 2]", '"bw"', '{"group": 3, "seed": 0}'])
def test_a_sweep_json_of_the_wrong_type_is_a_warning_and_the_run_is_labelled_by_its_config(
    sweep, content, capsys
):
    (sweep / "bw_s0" / "sweep.json").write_text(content)
    assert main(["report", str(sweep)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bw_s0/sweep.json" in err and "labelled by its config" in err


def test_a_config_json_that_is_null_reads_as_no_configuration(sweep, capsys):
    (sweep / "bw_s0" / "config.json").write_text("null")
    assert main(["report", str(sweep)]) == 0


def test_verdict_refuses_a_planted_link_and_escapes_labels(sweep, outside, capsys):
    (sweep / "verdict").mkdir()
    (sweep / "verdict" / "verdict.md").symlink_to(outside)
    assert main(["verdict", str(sweep), *SIM]) == EXIT_USER
    assert "verdict.md: it is a symbolic link" in _one_line_error(capsys)
    assert outside.read_text() == "ssh-ed25519 AAAAmine me@host\n"
    assert sorted(p.name for p in (sweep / "verdict").iterdir()) == ["verdict.md"]
    (sweep / "verdict" / "verdict.md").unlink()
    for s in range(2):  # a group that would close the code fence and start a key line
        spec = json.loads((sweep / f"bw_s{s}" / "sweep.json").read_text())
        spec["group"] = "bw\n```\n" + KEY
        (sweep / f"bw_s{s}" / "sweep.json").write_text(json.dumps(spec))
    assert main(["verdict", str(sweep), *SIM]) == 0
    md = (sweep / "verdict" / "verdict.md").read_text()
    assert not any(line.startswith("ssh-ed25519") for line in md.splitlines())
    assert "````" in md  # the fence outgrew the label's backticks


# --------------------------------------------------------------------------------------------
# Writers inside a run: metrics, meta, eval results, rank logs, tracker ids, error.json
# --------------------------------------------------------------------------------------------


def _train(tiny_config, *extra: str) -> int:
    m = tiny_config.model
    return main(["train", "--preset", "cpu-tiny", "--out_dir", tiny_config.out_dir,
                 "--name", "r", "--data.corpus", "excerpt", "--data.data_dir",
                 tiny_config.data.data_dir, "--data.seq_len", "32", "--model.dim", str(m.dim),
                 "--model.num_layers", "2", "--train.batch_size", "4",
                 "--train.num_eval_batches", "1", "--train.progress", "false",
                 "--train.num_steps", "4", "--train.ckpt_every", "2", *extra])  # fmt: skip


def test_resume_with_a_dangling_metrics_link_is_refused_and_creates_nothing(
    tiny_config, tmp_path, capsys
):
    assert _train(tiny_config) == 0
    run = Path(tiny_config.out_dir) / "r"
    meta = (run / "meta.json").read_text()
    (run / "metrics.jsonl").unlink()
    target = tmp_path / "elsewhere" / "metrics.jsonl"
    for link in (target, run / "old.jsonl"):  # out of the run, then inside it: both refused
        (run / "metrics.jsonl").symlink_to(link)
        capsys.readouterr()
        assert _train(tiny_config, "--resume", "--train.num_steps", "6") == EXIT_USER
        assert "metrics.jsonl" in _one_line_error(capsys)
        assert not target.parent.exists() and not (run / "old.jsonl").exists()
        assert (run / "meta.json").read_text() == meta  # nothing written before the refusal
        (run / "metrics.jsonl").unlink()


def test_run_writers_refuse_links(tmp_path, outside):
    from stalepipe.training.launch.task import write_error
    from stalepipe.training.rundir.trackers import ID_FILE, _run_id
    from stalepipe.training.tools.evaluate import save_results
    from stalepipe.training.train.ranklog import rank_log_path, tee_rank_log

    run = tmp_path / "sweep" / "run"
    (run / "ckpt_00000004").mkdir(parents=True)
    (run / "eval_00000004.json").symlink_to(outside)
    with pytest.raises(LinkError, match="eval_00000004.json: it is a symbolic link"):
        save_results({"checkpoint": str(run / "ckpt_00000004"), "step": 4})
    (run / ID_FILE).symlink_to(outside)
    with pytest.raises(LinkError, match="tracker_id is a symbolic link to"):
        _run_id(run)
    (run / "error.json").symlink_to(outside)
    with pytest.raises(LinkError, match="error.json: it is a symbolic link"):
        write_error(run, "boom")
    (run / "logs").symlink_to(outside.parent, target_is_directory=True)
    with pytest.raises(LinkError, match="logs is a symbolic link"):
        tee_rank_log(rank_log_path(run, 0), console=False)
    assert outside.read_text() == "ssh-ed25519 AAAAmine me@host\n"
    assert sorted(p.name for p in outside.parent.iterdir()) == ["authorized_keys"]
