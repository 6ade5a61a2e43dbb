"""Token shards in the llm.c / modded-nanogpt binary format.

Layout of one `.bin` shard (all little-endian):

    int32[256] header: [0] magic 20240520, [1] version, [2] number of tokens, rest zero
    tokens:            uint16 (version 1) or uint32 (version 2), `header[2]` of them

Version 1 is what llm.c writes for GPT-2 and modded-nanogpt reads; version 2 is llm.c's LLaMA-3
variant, used here whenever a vocabulary has more than 65536 ids. Shards written by those tools
can be read directly (the format is all that is shared; the manifest is ours).

Reading validates the header and the file size before memory-mapping, so a truncated download
or an interrupted write is reported up front instead of as garbage tokens mid-training.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from stalepipe.errors import DataError

MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# version -> token dtype; `<` pins little-endian regardless of the host.
TOKEN_DTYPES: dict[int, np.dtype] = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
REPREPARE = "re-run `stalepipe data prepare --force`"


def version_for_vocab(vocab_size: int) -> int:
    """Shard version that can hold ids `0 .. vocab_size-1` (1 = uint16, 2 = uint32)."""
    assert vocab_size >= 1
    return 1 if vocab_size <= 2**16 else 2


def _header(version: int, num_tokens: int) -> np.ndarray:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, version, num_tokens
    return header


class ShardWriter:
    """Streams tokens into one shard file without holding the shard in memory.

    Tokens go to `<path>.tmp`; `close()` patches the token count into the header and renames the
    file into place, so a crash never leaves a half-written file under the final name.
    Use as a context manager; on an exception the temporary file is removed.
    """

    def __init__(self, path: str | os.PathLike, version: int) -> None:
        if version not in TOKEN_DTYPES:
            raise ValueError(f"shard version must be one of {sorted(TOKEN_DTYPES)}, got {version}")
        self.path = Path(path)
        self.version = version
        self.dtype = TOKEN_DTYPES[version]
        self.num_tokens = 0
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._file = open(self._tmp, "wb")  # noqa: SIM115 -- closed in close()/abort()
        self._file.write(_header(version, 0).tobytes())

    def write(self, tokens: np.ndarray | list[int]) -> None:
        """Append tokens; raises ValueError if one does not fit the shard's dtype."""
        arr = np.asarray(tokens)
        if arr.size == 0:
            return
        # Check the range before the cast: a silent uint16 wrap-around would corrupt training.
        if arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max:
            raise ValueError(
                f"token ids must be in [0, {np.iinfo(self.dtype).max}] for shard version "
                f"{self.version}, got range [{arr.min()}, {arr.max()}]"
            )
        self._file.write(arr.astype(self.dtype, copy=False).tobytes())
        self.num_tokens += int(arr.size)

    def close(self) -> Path:
        """Finish the header and move the shard to its final path; returns that path."""
        self._file.seek(0)
        self._file.write(_header(self.version, self.num_tokens).tobytes())
        self._file.close()
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Drop the partial shard."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_shard(path: str | os.PathLike, tokens: np.ndarray | list[int], version: int) -> Path:
    """Write a whole shard at once (convenience wrapper around `ShardWriter`)."""
    with ShardWriter(path, version) as writer:
        writer.write(tokens)
    return Path(path)


def read_header(path: str | os.PathLike) -> tuple[int, int]:
    """Validate a shard's header and size; return `(version, num_tokens)`.

    Raises DataError naming the file for a missing file, a bad magic number, an unknown version
    or a size that does not match the header (truncated or padded file).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"token shard {path} is missing; {REPREPARE}")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(
            f"token shard {path} is truncated ({size} bytes, shorter than its header); {REPREPARE}"
        )
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, num_tokens = int(header[0]), int(header[1]), int(header[2])
    if magic != MAGIC:
        raise DataError(
            f"{path} is not a token shard (magic {magic}, expected {MAGIC}); {REPREPARE}"
        )
    if version not in TOKEN_DTYPES:
        raise DataError(
            f"token shard {path} has unknown version {version} (known: "
            f"{', '.join(map(str, TOKEN_DTYPES))}); {REPREPARE}"
        )
    expected = HEADER_BYTES + num_tokens * TOKEN_DTYPES[version].itemsize
    if num_tokens < 0 or size != expected:
        raise DataError(
            f"token shard {path} is {size} bytes but its header says {num_tokens} tokens "
            f"({expected} bytes): the file is truncated or corrupt; {REPREPARE}"
        )
    return version, num_tokens


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """Memory-map a shard's tokens (read-only, uint16 or uint32) after validating it."""
    version, num_tokens = read_header(path)
    if num_tokens == 0:
        # np.memmap refuses zero-length maps.
        return np.zeros(0, dtype=TOKEN_DTYPES[version])
    return np.memmap(
        path, dtype=TOKEN_DTYPES[version], mode="r", offset=HEADER_BYTES, shape=(num_tokens,)
    )
