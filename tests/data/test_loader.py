"""TokenLoader: batch k is a pure function of (seed, split, k); vocab checks; bad data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from stalepipe.errors import DataError
from stalepipe.training.data import TokenLoader, batch_seed, check_vocab, fingerprint, write_shard


def test_same_step_same_batch_across_loaders(excerpt_data_dir):
    a = TokenLoader(excerpt_data_dir, "train", 32, seed=7)
    b = TokenLoader(excerpt_data_dir, "train", 32, seed=7)
    later = [a.batch(k, 4) for k in (5, 2, 9)]  # call order must not matter
    for k, (x, y) in zip((5, 2, 9), later):
        xb, yb = b.batch(k, 4)
        assert torch.equal(x, xb) and torch.equal(y, yb)


def test_batches_differ_by_step_seed_and_split(excerpt_data_dir):
    base = TokenLoader(excerpt_data_dir, "train", 32, seed=0)
    x0, _ = base.batch(0, 8)
    assert not torch.equal(x0, base.batch(1, 8)[0])
    assert not torch.equal(x0, TokenLoader(excerpt_data_dir, "train", 32, seed=1).batch(0, 8)[0])
    assert not torch.equal(x0, TokenLoader(excerpt_data_dir, "val", 32, seed=0).batch(0, 8)[0])


def test_targets_are_inputs_shifted_by_one(excerpt_data_dir):
    loader = TokenLoader(excerpt_data_dir, "train", 16, seed=3)
    x, y = loader.batch(4, 5)
    assert x.shape == y.shape == (5, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    tokens = np.fromfile(Path(excerpt_data_dir) / "train_000000.bin", dtype="<u2", offset=1024)
    for row, (shard, start) in enumerate(loader.offsets(4, 5)):
        assert shard == 0
        assert x[row].tolist() == tokens[start : start + 16].tolist()
        assert y[row].tolist() == tokens[start + 1 : start + 17].tolist()


def test_batch_seed_is_stable():
    # Pinned: changing the seeding scheme would silently change every resumed run's data.
    assert batch_seed(0, "train", 0) == 4016518944836277306
    assert batch_seed(0, "train", 1) != batch_seed(0, "val", 1)


def test_manifest_metadata_and_vocab_check(excerpt_data_dir, tmp_path):
    loader = TokenLoader(excerpt_data_dir, "val", 8, seed=0)
    assert (loader.vocab_size, loader.eot) == (256, 0)
    check_vocab(excerpt_data_dir, 256)
    d = shutil.copytree(excerpt_data_dir, tmp_path / "d")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["tokenizer"].update(name="gpt2", vocab_size=50257, eot=50256)
    (d / "manifest.json").write_text(json.dumps(manifest))
    check_vocab(d, 50304)
    with pytest.raises(DataError) as err:
        check_vocab(d, 256)
    assert str(err.value) == (
        "model.vocab_size=256 is smaller than the tokenizer's 50257; use --model.vocab_size 50304"
    )


def test_foreign_multi_shard_uint32(tmp_path):
    # llm.c-style names, no manifest, uint32 tokens: shard i holds ids 100000*i + 0..99.
    for i in range(2):
        write_shard(
            tmp_path / f"fineweb_train_{i:06d}.bin", 100_000 * i + np.arange(100), version=2
        )
    write_shard(tmp_path / "fineweb_val_000000.bin", np.arange(50), version=2)
    loader = TokenLoader(tmp_path, "train", 10, seed=0)
    assert loader.num_tokens == 200 and loader.num_windows == 180
    assert loader.vocab_size is None
    check_vocab(tmp_path, 100_100)
    with pytest.raises(DataError, match=r"holds token id 100099 .* --model.vocab_size 100160"):
        check_vocab(tmp_path, 8)  # no manifest: nothing to check against
    seen = set()
    for step in range(20):
        x, y = loader.batch(step, 8)
        shard = x[:, :1] // 100_000
        # A window never crosses a shard: consecutive ids inside one shard.
        assert torch.equal(y - x, torch.ones_like(x)) and torch.equal(
            x // 100_000, shard.expand_as(x)
        )
        seen |= set(shard.flatten().tolist())
    assert seen == {0, 1}
    assert len(fingerprint(tmp_path)) == 16


def test_split_shorter_than_a_window(tmp_path):
    write_shard(tmp_path / "train.bin", np.arange(50), version=1)
    TokenLoader(tmp_path, "train", 49, seed=0)  # exactly seq_len + 1 tokens: one window
    with pytest.raises(DataError, match=r"fewer than seq_len\+1 = 51; lower --data.seq_len"):
        TokenLoader(tmp_path, "train", 50, seed=0)


def test_missing_and_corrupt_data(excerpt_data_dir, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        TokenLoader(tmp_path / "nothing", "train", 8, seed=0)
    d = shutil.copytree(excerpt_data_dir, tmp_path / "d")
    (d / "val_000000.bin").unlink()
    with pytest.raises(DataError, match=r"val_000000\.bin is missing.*--force"):
        TokenLoader(d, "val", 8, seed=0)
    raw = (d / "train_000000.bin").read_bytes()
    (d / "train_000000.bin").write_bytes(b"GARBAGE!" + raw[8:])
    with pytest.raises(DataError, match=r"train_000000\.bin is not a token shard"):
        TokenLoader(d, "train", 8, seed=0)
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match=r"manifest\.json is corrupt.*--force"):
        TokenLoader(d, "train", 8, seed=0)
