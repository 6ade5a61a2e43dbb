"""prepare_corpus / ensure_prepared / prepare_main: split by document, manifest, no overwrite."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from stalepipe.config import DataConfig
from stalepipe.errors import DataError
from stalepipe.training.data import (
    ensure_prepared,
    load_corpus,
    load_tokenizer,
    prepare_corpus,
    prepare_main,
    read_manifest,
    read_shard,
    val_mask,
    verify,
)
from stalepipe.training.data.manifest import file_sha256


def _docs_of(directory, split):
    """Texts of the documents in a split, recovered from the shards (eot before each)."""
    tok = load_tokenizer(directory)
    manifest = read_manifest(directory)
    ids = np.concatenate(
        [read_shard(directory / s["file"]) for s in manifest["splits"][split]["shards"]]
    )
    starts = np.flatnonzero(ids == tok.eot).tolist() + [len(ids)]
    assert starts[0] == 0, "every shard starts with eot"
    return [tok.decode(ids[a + 1 : b].tolist()) for a, b in zip(starts, starts[1:])]


def _user_corpus(root):
    root.mkdir()
    for i in range(4):
        (root / f"doc{i}.txt").write_text(f"text file number {i}\n" * (20 + i))
    (root / "more.jsonl").write_text(
        "".join(json.dumps({"text": f"json document {i} " * 30}) + "\n" for i in range(4))
    )
    return root


def test_val_mask_counts_and_order_independence():
    names = [f"doc{i}" for i in range(100)]
    mask = val_mask(names, 0.1)
    assert sum(mask) == 10
    shuffled = names[:]
    random.Random(1).shuffle(shuffled)
    val = {n for n, v in zip(names, mask) if v}
    assert val == {n for n, v in zip(shuffled, val_mask(shuffled, 0.1)) if v}
    assert sum(val_mask(names[:3], 0.01)) == 1  # at least one val document
    assert sum(val_mask(names[:3], 0.99)) == 2  # at least one train document
    assert sum(val_mask(["same", "same"], 0.5)) == 1  # duplicate names still split exactly


def test_val_mask_needs_two_documents():
    with pytest.raises(DataError, match="needs at least 2"):
        val_mask(["only"], 0.5)


def test_excerpt_byte_manifest_and_contents(excerpt_data_dir):
    from pathlib import Path

    d = Path(excerpt_data_dir)
    m = read_manifest(d)
    assert m["corpus"] == "excerpt"
    assert m["tokenizer"] == {"name": "byte", "vocab_size": 256, "eot": 0, "files": []}
    assert m["shard_version"] == 1
    train, val = m["splits"]["train"], m["splits"]["val"]
    assert (train["num_documents"], val["num_documents"]) == (5, 1)
    for split in (train, val):
        # Byte tokenizer: one token per byte plus one eot per document.
        assert split["num_tokens"] == split["text_bytes"] + split["num_documents"]
        for shard in split["shards"]:
            assert shard["sha256"] == file_sha256(d / shard["file"])
    assert sorted(p.name for p in d.iterdir()) == [
        ".stalepipe.json",
        "manifest.json",
        "train_000000.bin",
        "val_000000.bin",
    ]
    docs = dict(load_corpus("excerpt", None).documents())
    assert _docs_of(d, "val") == [docs[n] for n in m["val_documents"]]
    assert sorted(_docs_of(d, "train")) == sorted(
        t for n, t in docs.items() if n not in m["val_documents"]
    )
    verify(d)


def test_user_text_split_by_document_with_bpe(tmp_path):
    root = _user_corpus(tmp_path / "in")
    cfg = DataConfig(
        corpus="text",
        tokenizer="bpe",
        bpe_vocab_size=300,
        val_fraction=0.25,
        data_dir=str(tmp_path / "out"),
    )
    d = prepare_corpus(cfg, text_paths=[root], progress=False)
    m = read_manifest(d)
    assert m["tokenizer"]["name"] == "bpe" and m["tokenizer"]["files"] == ["tokenizer.json"]
    assert (d / "tokenizer.json").is_file()
    assert m["splits"]["train"]["num_documents"] == 6 and m["splits"]["val"]["num_documents"] == 2
    docs = dict(load_corpus("text", [root]).documents())
    assert _docs_of(d, "val") == [docs[n] for n in m["val_documents"]]
    assert sorted(_docs_of(d, "train")) == sorted(
        t for n, t in docs.items() if n not in m["val_documents"]
    )
    assert m["sources"] == sorted(str(p.resolve()) for p in root.iterdir())


def test_refuses_overwrite_without_force(tmp_path):
    cfg = DataConfig(corpus="excerpt", data_dir=str(tmp_path / "d"))
    d = prepare_corpus(cfg, progress=False)
    before = (d / "manifest.json").read_bytes()
    with pytest.raises(DataError, match="already holds prepared data; pass --force"):
        prepare_corpus(dataclasses.replace(cfg, val_fraction=0.5), progress=False)
    assert (d / "manifest.json").read_bytes() == before
    prepare_corpus(dataclasses.replace(cfg, val_fraction=0.5), force=True, progress=False)
    assert read_manifest(d)["splits"]["val"]["num_documents"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no staging leftovers


def test_never_replaces_a_foreign_directory(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    cfg = DataConfig(corpus="excerpt", data_dir=str(tmp_path / "mine"))
    with pytest.raises(DataError, match="not a stalepipe data directory"):
        prepare_corpus(cfg, force=True, progress=False)
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "precious"


def test_failed_prepare_leaves_nothing(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text(
        '{"text": "fine"}\n{"text": "also fine"}\n{"oops": 1}\n'
    )
    cfg = DataConfig(corpus="text", data_dir=str(tmp_path / "out"))
    with pytest.raises(DataError, match=r"a\.jsonl:3"):
        prepare_corpus(cfg, text_paths=[tmp_path / "in"], progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_too_few_documents(tmp_path):
    (tmp_path / "one.txt").write_text("a single document")
    cfg = DataConfig(corpus="text", data_dir=str(tmp_path / "out"))
    with pytest.raises(DataError, match="at least 2"):
        prepare_corpus(cfg, text_paths=[tmp_path / "one.txt"], progress=False)


def test_shards_roll_over(tmp_path):
    cfg = DataConfig(corpus="excerpt", data_dir=str(tmp_path / "d"))
    d = prepare_corpus(cfg, progress=False, shard_tokens=40_000)
    train = read_manifest(d)["splits"]["train"]
    assert [s["file"] for s in train["shards"]] == [f"train_{i:06d}.bin" for i in range(3)]
    assert sum(s["num_tokens"] for s in train["shards"]) == train["num_tokens"]
    verify(d)


def test_verify_detects_changed_bytes(tmp_path):
    d = prepare_corpus(DataConfig(corpus="excerpt", data_dir=str(tmp_path / "d")), progress=False)
    shard = d / "val_000000.bin"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1  # same size, header intact: only the hash can tell
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"val_000000\.bin does not match the SHA-256.*--force"):
        verify(d)


def test_ensure_prepared(tmp_path):
    cfg = DataConfig(corpus="excerpt", data_dir=str(tmp_path / "d"))
    d = prepare_corpus(cfg, progress=False)
    stamp = (d / "manifest.json").stat().st_mtime_ns
    assert ensure_prepared(cfg, progress=False) == d
    assert (d / "manifest.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    with pytest.raises(DataError, match="holds corpus=excerpt tokenizer=byte.*tokenizer=gpt2"):
        ensure_prepared(dataclasses.replace(cfg, tokenizer="gpt2"), progress=False)
    (d / "train_000000.bin").write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match=r"train_000000\.bin .*truncated"):
        ensure_prepared(cfg, progress=False)


def test_ensure_prepared_refuses_another_split_or_bpe_size(tmp_path):
    # The default cache is named by corpus and tokenizer only: data prepared with another
    # val_fraction (or BPE size) must not be read as this config's.
    cfg = DataConfig(corpus="excerpt", tokenizer="bpe", bpe_vocab_size=300, data_dir=str(tmp_path))
    d = prepare_corpus(dataclasses.replace(cfg, data_dir=str(tmp_path / "d")), progress=False)
    cfg = dataclasses.replace(cfg, data_dir=str(d))
    assert ensure_prepared(cfg, progress=False) == d
    with pytest.raises(DataError, match=r"data\.val_fraction=0\.05 \(the config asks for 0\.5\)"):
        ensure_prepared(dataclasses.replace(cfg, val_fraction=0.5), progress=False)
    with pytest.raises(DataError, match=r"bpe_vocab_size=300 .*--bpe-vocab-size 400 .*--force`$"):
        ensure_prepared(dataclasses.replace(cfg, bpe_vocab_size=400), progress=False)


def test_ensure_prepared_text_needs_explicit_prepare(tmp_path):
    cfg = DataConfig(corpus="text", data_dir=str(tmp_path / "t"))
    with pytest.raises(DataError, match=r"--corpus text --text PATH --out .*t`"):
        ensure_prepared(cfg, progress=False)


def test_prepare_main_prints_summary(tmp_path, capsys):
    root = _user_corpus(tmp_path / "in")
    d = prepare_main(text=[str(root)], out=str(tmp_path / "out"), val_fraction=0.25, progress=False)
    out = capsys.readouterr().out
    assert f"prepared text with the byte tokenizer (vocab 256, eot 0) in {d}" in out
    assert "train: 6 documents" in out and "val:   2 documents" in out
    with pytest.raises(DataError, match="--force"):
        prepare_main(text=[str(root)], out=str(tmp_path / "out"), progress=False)
