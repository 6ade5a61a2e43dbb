"""Data directories: an explicit data_dir without data is an error (never silently filled with
Shakespeare), only the default cache is prepared; token ids beyond the model's vocab are caught
when the shards are opened; --force replaces only data stalepipe prepared and marked; files
follow the user's umask."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from stalepipe.cli import main
from stalepipe.config import DataConfig
from stalepipe.errors import DataError
from stalepipe.fileio import MARKER, NotOwnedError, make_temp_dir
from stalepipe.training.data import (
    check_vocab,
    ensure_prepared,
    max_token_id,
    prepare_corpus,
    prepare_main,
    read_manifest,
    write_shard,
)


def _train_args(tiny_config, data_dir: str, *extra: str) -> list[str]:
    return [
        "train", "--preset", "cpu-tiny", "--out_dir", tiny_config.out_dir, "--name", "r",
        "--data.corpus", "excerpt", "--data.data_dir", data_dir, "--data.seq_len", "32",
        "--model.dim", "64", "--model.num_layers", "2", "--train.batch_size", "4",
        "--train.num_steps", "1", "--train.eval_every", "0", "--train.num_eval_batches", "1",
        "--train.progress", "false", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("state", ["missing", "empty", "other files"])
def test_explicit_data_dir_without_data_is_an_error(tmp_path, state):
    d = tmp_path / "typo"
    if state != "missing":
        d.mkdir()
    if state == "other files":
        (d / "notes.txt").write_text("mine")
    cfg = DataConfig(corpus="excerpt", data_dir=str(d))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    want = {"missing": "does not exist", "empty": "is empty", "other files": "holds no token"}
    with pytest.raises(DataError, match=want[state]) as err:
        ensure_prepared(cfg, progress=False)
    assert f"`stalepipe data prepare --corpus excerpt --out {d}`" in str(err.value)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing created
    if state != "other files":  # the command the message recommends works
        prepare_main(corpus="excerpt", out=str(d), progress=False)
        assert ensure_prepared(cfg, progress=False) == d


def test_cli_typo_in_data_dir_creates_nothing(tiny_config, tmp_path, capsys):
    assert main(_train_args(tiny_config, str(tmp_path / "typo"))) == 2
    err = capsys.readouterr().err
    assert "does not exist; prepare it with `stalepipe data prepare" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "typo").exists() and not Path(tiny_config.out_dir).exists()


def test_default_cache_is_still_prepared(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = ensure_prepared(DataConfig(corpus="excerpt"), progress=False)
    assert d == Path("data_cache/excerpt-byte") and read_manifest(d)["corpus"] == "excerpt"


def _gpt2_like_shards(d: Path) -> None:
    """llm.c-style GPT-2 shards (uint16, no manifest) whose largest id is 50256 (eot)."""
    d.mkdir()
    ids = np.arange(1000) % 300
    write_shard(d / "fineweb_train_000000.bin", np.concatenate([[50256], ids]), version=1)
    write_shard(d / "fineweb_val_000000.bin", ids, version=1)


def test_foreign_token_ids_beyond_the_vocab_are_caught(tmp_path):
    d = tmp_path / "gpt2"
    _gpt2_like_shards(d)
    with pytest.raises(DataError) as err:
        check_vocab(d, 256)
    assert str(err.value).startswith(f"{d} holds token id 50256 but model.vocab_size is 256;")
    assert "--model.vocab_size 50304" in str(err.value)
    check_vocab(d, 50304)  # the recommended fix
    assert max_token_id(d / "fineweb_val_000000.bin") == 299
    assert max_token_id(d / "fineweb_train_000000.bin", below=70000) == -1  # uint16: no scan


def test_cli_foreign_vocab_fails_before_the_run_directory(tiny_config, tmp_path, capsys):
    d = tmp_path / "gpt2"
    _gpt2_like_shards(d)
    args = _train_args(tiny_config, str(d))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "holds token id 50256" in err and err.count("\n") == 1
    assert not (Path(tiny_config.out_dir) / "r").exists()  # nothing blocks the rerun
    assert main([*args, "--model.vocab_size", "50304"]) == 0


def test_manifest_records_the_largest_token_id(excerpt_data_dir, tmp_path):
    m = read_manifest(excerpt_data_dir)
    assert all(0 < m["splits"][s]["max_token_id"] < 256 for s in ("train", "val"))
    # a manifest claiming an id beyond the model's vocab is refused without reading shards
    d = tmp_path / "d"
    prepare_corpus(DataConfig(corpus="excerpt", data_dir=str(d)), progress=False)
    m = read_manifest(d)
    m["splits"]["val"]["max_token_id"] = 300
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="holds token id 300 .* --model.vocab_size 320"):
        check_vocab(d, 256)


def test_force_replaces_only_marked_data(tmp_path):
    cfg = DataConfig(corpus="excerpt", data_dir=str(tmp_path / "d"))
    d = prepare_corpus(cfg, progress=False)
    assert json.loads((d / MARKER).read_text())["kind"] == "data"
    (d / "notes.txt").write_text("mine")
    with pytest.raises(NotOwnedError, match="holds 'notes.txt'"):
        prepare_corpus(cfg, force=True, progress=False)
    (d / "notes.txt").unlink()
    (d / MARKER).unlink()  # prepared by an older stalepipe
    with pytest.raises(NotOwnedError, match="no .stalepipe.json marker.*delete it by hand"):
        prepare_corpus(cfg, force=True, progress=False)
    assert (d / "manifest.json").exists() and (d / "train_000000.bin").exists()


def test_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        d = prepare_corpus(
            DataConfig(corpus="excerpt", data_dir=str(tmp_path / "d")), progress=False
        )
        staging = make_temp_dir(tmp_path, prefix=".x-")
    finally:
        os.umask(old)
    assert stat.S_IMODE(d.stat().st_mode) == 0o755
    assert stat.S_IMODE(staging.stat().st_mode) == 0o755
    for f in d.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f.name


def test_data_prepare_cli_force_on_a_foreign_directory(tmp_path, capsys):
    out = tmp_path / "d"
    prepare_main(corpus="excerpt", out=str(out), progress=False)
    capsys.readouterr()
    (out / "thesis.tex").write_text("precious")
    args = ["data", "prepare", "--corpus", "excerpt", "--out", str(out), "--force"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "refusing to delete" in err and err.count("\n") == 1
    assert (out / "thesis.tex").read_text() == "precious"


def _plant_token(shard: Path, token: int) -> None:
    """Overwrite every token of `shard` with `token`, size and header unchanged: any batch then
    reads it."""
    tokens = np.memmap(shard, dtype="<u2", mode="r+", offset=1024)
    tokens[:] = token
    tokens.flush()
    del tokens


def test_an_out_of_vocab_token_in_a_right_sized_shard_is_one_line_naming_it(
    tiny_config, excerpt_data_dir, tmp_path, capsys
):
    """Token 65535 planted in a shard of the right size was an IndexError deep in the first
    forward; the loader checks each shard's digest (and token range) when it opens it, so train
    and eval stop with one line naming the shard and the command that re-prepares it, and that
    command fixes it."""
    import shutil

    data = shutil.copytree(excerpt_data_dir, tmp_path / "data")
    assert main(_train_args(tiny_config, str(data), "--name", "good")) == 0
    capsys.readouterr()
    _plant_token(data / "train_000000.bin", 65535)
    _plant_token(data / "val_000000.bin", 65535)
    assert main(_train_args(tiny_config, str(data))) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    fix = f"stalepipe data prepare --corpus excerpt --out {data} --force"
    assert err == (
        f"stalepipe: error: token shard {data / 'train_000000.bin'} does not match the SHA-256 in "
        f"its manifest.json (damaged or changed since it was prepared: it holds token id 65535, "
        f"outside the tokenizer's 256 ids); re-prepare it: `{fix}`"
    )
    run = Path(tiny_config.out_dir) / "good"
    assert main(["eval", str(run), "--no-tasks"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "val_000000.bin does not match the SHA-256" in err
    assert not list(run.glob("eval_*.json"))
    assert main(fix.split()[1:]) == 0  # the printed fix works
    assert main(_train_args(tiny_config, str(data), "--overwrite")) == 0


def test_a_shard_whose_digest_was_rewritten_still_has_its_tokens_checked(
    excerpt_data_dir, tmp_path
):
    """A manifest rewritten to match a planted shard (the digest proves no authorship): the
    token range, scanned in the same pass, still keeps the id out of the model."""
    import shutil

    from stalepipe.training.data import TokenLoader
    from stalepipe.training.data.manifest import file_sha256

    data = shutil.copytree(excerpt_data_dir, tmp_path / "data")
    _plant_token(data / "val_000000.bin", 300)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["splits"]["val"]["shards"][0]["sha256"] = file_sha256(data / "val_000000.bin")
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"val_000000\.bin holds token id 300, outside the "
                       r"tokenizer's 256 ids, though it matches its manifest\.json"):  # fmt: skip
        TokenLoader(data, "val", 32, seed=0)
    TokenLoader(data, "train", 32, seed=0)  # the untouched split opens
