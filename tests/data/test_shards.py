"""llm.c / modded-nanogpt shard format: round trips, foreign files, and corrupt-file errors."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from stalepipe.errors import DataError
from stalepipe.training.data.shards import (
    HEADER_BYTES,
    MAGIC,
    ShardWriter,
    read_header,
    read_shard,
    version_for_vocab,
    write_shard,
)


def _llmc_shard(path, tokens, version=1, magic=MAGIC, count=None):
    """A shard written the way llm.c's `write_datafile` does, independently of our writer."""
    header = [0] * 256
    header[0], header[1] = magic, version
    header[2] = len(tokens) if count is None else count
    fmt = "<%dH" if version == 1 else "<%dI"
    path.write_bytes(struct.pack("<256i", *header) + struct.pack(fmt % len(tokens), *tokens))
    return path


def test_uint16_round_trip_and_header(tmp_path):
    tokens = np.array([0, 1, 255, 50256, 65535, 7], dtype=np.int64)
    path = write_shard(tmp_path / "a.bin", tokens, version=1)
    assert path.stat().st_size == HEADER_BYTES + 2 * len(tokens)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert header[:3].tolist() == [20240520, 1, len(tokens)]
    assert not header[3:].any()
    assert read_header(path) == (1, len(tokens))
    back = read_shard(path)
    assert back.dtype == np.dtype("<u2")
    assert back.tolist() == tokens.tolist()
    assert not list(tmp_path.glob("*.tmp"))


def test_uint32_round_trip(tmp_path):
    tokens = [0, 65536, 100_000, 2**32 - 1]
    path = write_shard(tmp_path / "b.bin", tokens, version=2)
    assert path.stat().st_size == HEADER_BYTES + 4 * len(tokens)
    assert read_header(path) == (2, 4)
    assert read_shard(path).tolist() == tokens


def test_version_follows_vocab_size():
    assert version_for_vocab(256) == 1
    assert version_for_vocab(2**16) == 1  # ids 0..65535 fit uint16
    assert version_for_vocab(2**16 + 1) == 2


def test_streaming_writes_concatenate(tmp_path):
    with ShardWriter(tmp_path / "s.bin", 1) as w:
        w.write([1, 2, 3])
        w.write(np.array([], dtype=np.uint32))
        w.write(np.arange(4, 10))
    assert read_shard(tmp_path / "s.bin").tolist() == list(range(1, 10))


def test_out_of_range_token_is_rejected_and_leaves_no_file(tmp_path):
    with pytest.raises(ValueError, match="65535"), ShardWriter(tmp_path / "x.bin", 1) as w:
        w.write([1, 70000])
    assert list(tmp_path.iterdir()) == []


def test_reads_llmc_written_shards(tmp_path):
    v1 = _llmc_shard(tmp_path / "fineweb_train_000001.bin", [50256, 15496, 995])
    v2 = _llmc_shard(tmp_path / "llama_val_000000.bin", [128000, 9906, 1917], version=2)
    assert read_shard(v1).tolist() == [50256, 15496, 995]
    assert read_shard(v2).tolist() == [128000, 9906, 1917]


def test_empty_shard(tmp_path):
    path = write_shard(tmp_path / "e.bin", [], version=1)
    assert read_shard(path).tolist() == []


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"nope\.bin is missing.*prepare --force"):
        read_shard(tmp_path / "nope.bin")


def test_bad_magic(tmp_path):
    path = _llmc_shard(tmp_path / "m.bin", [1, 2], magic=20240521)
    with pytest.raises(DataError, match=r"m\.bin is not a token shard.*prepare --force"):
        read_shard(path)


def test_unknown_version(tmp_path):
    path = _llmc_shard(tmp_path / "v.bin", [1, 2], version=1)
    raw = bytearray(path.read_bytes())
    raw[4:8] = struct.pack("<i", 3)
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"v\.bin has unknown version 3.*prepare --force"):
        read_shard(path)


@pytest.mark.parametrize("cut", [1, 2, 500])
def test_truncated_file(tmp_path, cut):
    path = write_shard(tmp_path / "t.bin", list(range(200)), version=1)
    path.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(DataError, match=r"t\.bin .*truncated.*prepare --force"):
        read_shard(path)


def test_count_larger_than_file(tmp_path):
    path = _llmc_shard(tmp_path / "c.bin", [1, 2, 3], count=4)
    with pytest.raises(DataError, match="header says 4 tokens"):
        read_header(path)


def test_trailing_garbage(tmp_path):
    path = write_shard(tmp_path / "g.bin", [1, 2, 3], version=1)
    path.write_bytes(path.read_bytes() + b"\0\0")
    with pytest.raises(DataError, match="corrupt"):
        read_header(path)
