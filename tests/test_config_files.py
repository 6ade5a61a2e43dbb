"""Config files (config/files.py): TOML and JSON read into the same config, and every bad file
is one line naming the fix (through the CLI: exit 2, no traceback)."""

import json
import re
from pathlib import Path

import pytest

from stalepipe.cli import build_config, main
from stalepipe.config import ConfigError


def test_toml_and_json_give_the_same_config(tmp_path):
    (tmp_path / "c.toml").write_text('name = "x"\n[train]\nnum_steps = 40\n[optim]\nlr = 0.01\n')
    (tmp_path / "c.json").write_text(
        json.dumps({"name": "x", "train": {"num_steps": 40}, "optim": {"lr": 0.01}})
    )
    a = build_config(None, str(tmp_path / "c.toml"), {})
    b = build_config(None, str(tmp_path / "c.json"), {})
    assert a == b and a.train.num_steps == 40 and a.optim.lr == 0.01 and a.name == "x"
    # flags win over the file
    assert (
        build_config(None, str(tmp_path / "c.toml"), {"train.num_steps": "7"}).train.num_steps == 7
    )


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("missing.toml", None, "does not exist; pass a .toml or .json file"),
        ("broken.toml", "[train\nnum_steps = 4\n", "is not valid TOML (Expected ']'"),
        ("broken.json", '{"train": ', "is not valid JSON (Expecting value, line 1)"),
        ("list.json", "[1, 2]", "must hold a table of sections, not a list"),
        (
            "type.json",
            '{"train": {"num_steps": "forty"}}',
            "train.num_steps must be int, got 'forty'",
        ),
        ("bool.toml", "[train]\nnum_steps = true\n", "train.num_steps must be int, got True"),
        ("float.toml", '[optim]\nlr = "fast"\n', "optim.lr must be float or int, got 'fast'"),
        (
            "section.toml",
            "[trian]\nnum_steps = 4\n",
            "unknown section or field 'trian'; did you mean 'train'?",
        ),
        ("field.toml", "[optim]\nlrr = 1\n", "optim has no field 'lrr'; did you mean optim.lr?"),
        ("table.toml", "train = 3\n", "[train] must be a table of fields"),
    ],
)
def test_every_bad_file_is_one_line(tmp_path, capsys, name, text, message):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=None) as e:
        build_config(None, str(path), {})
    assert message in str(e.value) and "\n" not in str(e.value)
    assert main(["train", "--config", str(path), "--print-config"]) == 2
    assert message in capsys.readouterr().err


def test_a_directory_points_at_its_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["train", "--config", str(tmp_path), "--print-config"]) == 2
    assert f"is a directory; pass a file (a run directory: --config {tmp_path}/config.json)" in (
        capsys.readouterr().err
    )


def test_set_with_a_space_names_the_fix(capsys):
    assert main(["sweep", "--grid", "delay.policy=sync", "--set", "train.num_steps", "40"]) == 2
    assert "--set expects KEY=VALUE: write --set train.num_steps=40" in capsys.readouterr().err


def test_config_show_names_where_each_value_comes_from(tmp_path, capsys):
    (tmp_path / "c.toml").write_text("[train]\nnum_steps = 40\n")
    assert main(["config", "show", "--config", str(tmp_path / "c.toml"), "--optim.lr", "0.01"]) == 0
    lines = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert lines["train.num_steps"] == ["40", "file"]
    assert lines["optim.lr"] == ["0.01", "flag"]
    assert lines["train.batch_size"][-1] == "default"
    assert main(["config", "show", "--preset", "cpu-small"]) == 0
    shown = {line.split()[0]: line.split()[-2:] for line in capsys.readouterr().out.splitlines()}
    assert shown["model.dim"] == ["preset", "cpu-small"]


def test_an_older_run_record_loads_under_its_renamed_keys(tmp_path):
    """A config.json written before a key was renamed (train.steps -> train.num_steps) is
    upgraded before it is checked, as every reader of a run record does."""
    (tmp_path / "config.json").write_text(json.dumps({"train": {"steps": 12}}))
    assert build_config(None, str(tmp_path / "config.json"), {}).train.num_steps == 12


def test_set_hint_only_where_set_exists(capsys):
    assert main(["train", "--set", "train.num_steps", "5"]) == 2
    assert "overrides look like --train.num_steps 100" in capsys.readouterr().err


def _doc_toml_blocks():
    root = Path(__file__).resolve().parents[1]
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for i, block in enumerate(re.findall(r"```toml\n(.*?)```", doc.read_text(), re.S)):
            yield pytest.param(block, id=f"{doc.name}-{i}")


@pytest.mark.parametrize("block", list(_doc_toml_blocks()))
def test_every_toml_example_in_the_docs_trains_the_model_it_says(block, tmp_path, capsys):
    """Each config example of the docs starts from a preset (a file without one trains the
    default 3-block model, silently) and `config show` resolves it to that preset's model, the
    file's values over the preset's, flags over both."""
    from stalepipe.cli import main
    from stalepipe.presets import get_preset

    preset = re.search(r'^preset = "([\w-]+)"', block, re.M)
    assert preset, f"a docs config example without a top-level preset line:\n{block}"
    path = tmp_path / "example.toml"
    path.write_text(block)
    assert main(["config", "show", "--config", str(path), "--train.num_steps", "7"]) == 0
    shown = {ln.split()[0]: ln.split()[1:] for ln in capsys.readouterr().out.splitlines()[1:]}
    want = get_preset(preset.group(1)).model
    for field in ("dim", "num_layers", "num_heads", "vocab_size"):
        value, *source = shown[f"model.{field}"]
        assert json.loads(value) == getattr(want, field), field
    assert shown["train.num_steps"] == ["7", "flag"]


def test_a_file_starts_from_its_preset_and_flags_win(tmp_path):
    from stalepipe.presets import get_preset

    path = tmp_path / "p.json"
    path.write_text(json.dumps({"preset": "cpu-small", "model": {"num_layers": 2}}))
    cfg = build_config(None, str(path), {"model.dim": "128"})
    small = get_preset("cpu-small")
    assert cfg.model.num_layers == 2  # the file over the preset
    assert cfg.model.dim == 128  # the flag over both
    assert cfg.model.ffn_dim == small.model.ffn_dim and cfg.train == small.train  # the preset
    path.write_text(json.dumps({"preset": "cpu-smal"}))
    with pytest.raises(ConfigError, match=r"p.json: preset 'cpu-smal' is not one of cpu-tiny"):
        build_config(None, str(path), {})
    with pytest.raises(ConfigError, match='top-level line preset = "cpu-tiny"'):
        build_config("cpu-tiny", str(path), {})


def test_a_runtime_runs_config_resumes_on_the_emulator_with_no_extra_flag(tmp_path):
    """docs/runtime.md: `--config RUN/config.json --pipeline.engine emulate --resume` for a 2bw
    runtime run; the schedule, chunks and replicas only the runtime reads go back to the
    emulator's, since 2bw's delay is the policy's. A schedule whose delay is not the run's
    policy is still refused, naming the fix."""
    from stalepipe.config import ExperimentConfig, apply_overrides
    from stalepipe.training.rundir.resume import config_diff

    runtime = apply_overrides(ExperimentConfig(), {
        "pipeline.engine": "distributed", "pipeline.num_stages": "2", "pipeline.schedule": "2bw",
        "delay.policy": "2bw", "pipeline.num_replicas": "2", "train.batch_size": "8",
        "model.num_layers": "4",
    })  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(runtime.to_dict()))
    emu = build_config(None, str(path), {"pipeline.engine": "emulate"})
    assert (emu.pipeline.schedule, emu.pipeline.num_replicas) == ("1f1b", 1)
    assert emu.delay.policy == "2bw" and config_diff(runtime.to_dict(), emu.to_dict()) == []
    with pytest.raises(ConfigError, match="pipeline.schedule 2bw is run only by the distributed"):
        build_config(None, str(path), {"pipeline.engine": "emulate", "pipeline.schedule": "2bw"})
    # a deeper split that needs more microbatches may take them on --resume (rounding only)
    deeper = apply_overrides(runtime, {"pipeline.num_stages": "4", "train.num_microbatches": "4"})
    assert config_diff(runtime.to_dict(), deeper.to_dict()) == []
