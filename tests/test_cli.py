"""CLI: a smoke run, help text, and one-line errors with exit status 2."""

from __future__ import annotations

import argparse
import importlib
import inspect
import os

import pytest

from stalepipe.cli import main, make_parser
from stalepipe.cli.common import flags as _flags


def _train_args(tiny_config, *extra):
    m = tiny_config.model
    return [
        "train",
        "--preset",
        "cpu-tiny",
        "--out_dir",
        tiny_config.out_dir,
        "--data.corpus",
        "excerpt",
        "--data.data_dir",
        tiny_config.data.data_dir,
        "--data.seq_len",
        "32",
        "--model.dim",
        str(m.dim),
        "--model.num_layers",
        "2",
        "--train.batch_size",
        "4",
        "--train.num_eval_batches",
        "1",
        "--train.progress",
        "false",
        *extra,
    ]


def test_train_smoke(tiny_config, capsys):
    assert main(_train_args(tiny_config, "--train.num_steps", "3", "--name", "smoke")) == 0
    out = capsys.readouterr().out
    assert "done: 3 steps" in out and "val loss" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--preset", "cpu-tinny"], "unknown preset 'cpu-tinny'"),
        (["train", "--optim.lrr", "1"], "did you mean --optim.lr"),
        (["train", "--optim.lr", "-1"], "optim.lr must be > 0"),
        (["train", "--train.batch_size", "10", "--train.num_microbatches", "3"], "divisible"),
        (["train", "--pipeline.num_stages", "99"], "num_stages"),
        (["train", "--config", "/nonexistent/config.json"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--name", "a" * 300], "name must be one directory name of 1 to 128 characters"),
        (["--name", "a\nb"], "got 'a\\nb'; set name to 'a-b'"),
        (["--name", "a\udcffb"], "set name to 'a-b'"),  # the byte \xff in argv
        (["--optim.lr", "inf"], "optim.lr must be a finite number, got inf"),
        (["--train.num_steps", str(10**20)], "train.num_steps must be in [1, 1,000,000,000]"),
    ],
)
def test_unsafe_names_and_numbers_are_one_line_before_anything_is_made(
    tiny_config, extra, message, capsys
):
    assert main(_train_args(tiny_config, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    out = tiny_config.out_dir
    assert not os.path.exists(out) or not os.listdir(out)


def test_existing_run_is_refused(tiny_config, capsys):
    args = _train_args(tiny_config, "--train.num_steps", "1", "--name", "again")
    assert main(args) == 0
    assert main(args) == 2
    assert "--resume" in capsys.readouterr().err


def test_help_documents_fields(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    assert "--optim.lr" in capsys.readouterr().out


def test_info_and_presets(capsys):
    assert main(["info", "--preset", "smollm-360m", "--pipeline.num_stages", "4"]) == 0
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "4-stage split" in out and "cpu-tiny" in out


def test_simulate_compare_and_refusal(tmp_path, capsys):
    plot = tmp_path / "g.png"
    assert (
        main(
            [
                "simulate",
                "--compare",
                "gpipe,1f1b,2bw",
                "--stages",
                "4",
                "--microbatches",
                "8",
                "--steps",
                "4",
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "2bw" in out and "gpipe" in out and plot.stat().st_size > 0
    assert main(["simulate", "--schedule", "2bw", "--stages", "8", "--microbatches", "4"]) == 2
    assert "microbatches >= stages - 1" in capsys.readouterr().err


def test_data_prepare_refuses_to_overwrite(tmp_path, capsys):
    out = str(tmp_path / "d")
    assert main(["data", "prepare", "--corpus", "excerpt", "--out", out]) == 0
    assert main(["data", "prepare", "--corpus", "excerpt", "--out", out]) == 2
    assert "--force" in capsys.readouterr().err


def _subcommands():
    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_every_command_has_help(capsys):
    names = list(_subcommands())
    assert names == ["train", "data", "demo", "simulate", "info", "config", "presets", "export", "eval",
                     "generate", "checkpoint", "sweep", "report", "verdict", "toy"]  # fmt: skip
    for argv in [[n] for n in names] + [["data", "prepare"], ["checkpoint", "convert"]]:
        with pytest.raises(SystemExit) as e:
            main([*argv, "--help"])
        assert e.value.code == 0, argv
        assert capsys.readouterr().out.startswith("usage: stalepipe " + " ".join(argv)), argv


@pytest.mark.parametrize(
    ("argv", "target", "signature"),
    [
        (["data", "prepare"], "stalepipe.training.data:prepare_main", None),
        (["simulate"], "stalepipe.lab.sim.simulate:simulate_main", None),
        (["eval", "RUN"], "stalepipe.training.tools.evaluate:eval_main", None),
        (["export", "RUN", "--out", "hf"], "stalepipe.training.tools.export:export_main", None),
        (["demo"], "stalepipe.cli.demo:run_demo", None),
        # verdict_main passes its keywords on to run_verdict: the flags must fit run_verdict
        (["verdict", "RUNS"], "stalepipe.lab.verdict.command:verdict_main",
         "stalepipe.lab.verdict.command:run_verdict"),
    ],
)  # fmt: skip
def test_flags_are_the_keywords_of_the_function_a_command_calls(argv, target, signature):
    """Commands that pass all their flags on (`cli.common.runs`) call `target`, and the flags
    match the signature of the function that takes them."""
    args = make_parser().parse_args(argv)
    assert args.fn.__name__ == f"run {target}"
    module, name = (signature or target).split(":")
    fn = getattr(importlib.import_module(module), name)
    flags = _flags(args)
    if name == "run_verdict":  # verdict_main keeps --json / --verbose / --overhead* (the output)
        main_fn = importlib.import_module(module).verdict_main
        for own in ("json", "verbose", "overhead", "overhead_fit"):
            assert own in inspect.signature(main_fn).parameters
            flags.pop(own)
    inspect.signature(fn).bind(**flags)  # raises on a mismatch


def test_export_format_choices_are_the_exporters():
    from stalepipe.training.tools.export import EXPORTERS

    fmt = next(a for a in _subcommands()["export"]._actions if a.dest == "format")
    assert set(fmt.choices) == set(EXPORTERS) and fmt.default in EXPORTERS


def test_every_help_imports_no_torch():
    """`stalepipe COMMAND --help` answers before torch loads (under 0.5 s; torch alone takes
    2 s here): the parsers, their epilogs and the study table are torch-free."""
    import subprocess
    import sys

    code = """
import sys
from stalepipe.cli import main, make_parser
commands = list(make_parser()._subparsers._group_actions[0].choices)
for c in commands:
    try:
        main([c, "--help"])
    except SystemExit:
        pass
loaded = [m for m in ("torch", "numpy.linalg") if m in sys.modules]
print(len(commands), loaded, file=sys.stderr)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    count, loaded = out.stderr.strip().splitlines()[-1].split(" ", 1)
    assert int(count) >= 12 and "torch" not in loaded


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_python_m_help_imports_no_torch(launcher):
    """`python -m stalepipe ... --help` (and `torchrun -m stalepipe`, the same entry point with
    RANK and WORLD_SIZE set) answers without importing torch, as the console script does."""
    import os
    import subprocess
    import sys

    code = (
        "import runpy, sys\n"
        "sys.argv = ['stalepipe', 'train', '--help']\n"
        "try:\n"
        "    runpy.run_module('stalepipe', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules, 'python -m stalepipe --help imported torch'\n"
    )
    env = dict(os.environ)
    if launcher == "torchrun":
        env.update(RANK="0", WORLD_SIZE="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "usage: stalepipe train" in out.stdout
