"""`manifest.json`: what a prepared data directory holds, and the checks against it.

The manifest is written last, so a directory with a valid manifest is a complete one. It records
the corpus, the tokenizer (name, vocab size, eot id, files), per split the shards with their
token counts and SHA-256, document counts and text bytes, the validation documents, and the
source files. Listing shards checks their headers and sizes against it (cheap: `split_shards`);
a loader opening a split's shards to read tokens also checks each one's bytes against its
SHA-256 and its tokens against the tokenizer's vocabulary (`check_shard`, one read of the file
per process: a damaged shard is one line naming it, not an IndexError mid-training); `verify`
does that for every shard of a directory.

A directory of shards made by another tool (llm.c, modded-nanogpt) has no manifest; the loader
then takes `*train*.bin` / `*val*.bin` in sorted order and skips the vocabulary check.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from stalepipe.errors import DataError
from stalepipe.fileio import write_json_atomic
from stalepipe.training.data.shards import (
    HEADER_BYTES,
    REPREPARE,
    TOKEN_DTYPES,
    read_header,
    read_shard,
)

MANIFEST = "manifest.json"
FORMAT = "stalepipe-token-shards"
FORMAT_VERSION = 1
SPLITS = ("train", "val")


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: str | os.PathLike, manifest: dict[str, Any]) -> Path:
    """Write `manifest.json` atomically (temp file + rename)."""
    path = Path(directory) / MANIFEST
    return write_json_atomic(path, manifest, sort_keys=False)


def has_manifest(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a manifest (valid or not)."""
    return (Path(directory) / MANIFEST).is_file()


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """Parse and sanity-check `directory/manifest.json`; DataError naming the fix otherwise."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path} is missing; run `stalepipe data prepare` for {directory}")
    try:
        manifest = json.loads(path.read_text())
        ok = (
            manifest.get("format") == FORMAT
            and isinstance(manifest.get("tokenizer"), dict)
            and all(isinstance(manifest["splits"][s]["shards"], list) for s in SPLITS)
        )
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise DataError(f"{path} is corrupt or not a stalepipe manifest; {REPREPARE}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{path} has format version {manifest.get('format_version')}, this stalepipe reads "
            f"{FORMAT_VERSION}; {REPREPARE}"
        )
    return manifest


def split_shards(directory: str | os.PathLike, split: str) -> list[tuple[Path, int]]:
    """`(path, num_tokens)` of each shard of `split`, headers and sizes checked.

    With a manifest, its shard list and token counts are authoritative; without one (shards from
    another tool), every `*<split>*.bin` file in sorted order.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    directory = Path(directory)
    if has_manifest(directory):
        entries = read_manifest(directory)["splits"][split]["shards"]
        shards = []
        for entry in entries:
            path = directory / entry["file"]
            _, num_tokens = read_header(path)
            if num_tokens != entry["num_tokens"]:
                raise DataError(
                    f"token shard {path} holds {num_tokens} tokens but {MANIFEST} says "
                    f"{entry['num_tokens']}; {REPREPARE}"
                )
            shards.append((path, num_tokens))
        return shards
    if not directory.is_dir():
        raise DataError(f"data directory {directory} does not exist; run `stalepipe data prepare`")
    paths = sorted(directory.glob(f"*{split}*.bin"))
    if not paths:
        raise DataError(
            f"{directory} has no {MANIFEST} and no *{split}*.bin shards; run `stalepipe data prepare`"
        )
    return [(p, read_header(p)[1]) for p in paths]


def verify(directory: str | os.PathLike, fix: str = REPREPARE) -> None:
    """`check_shard` every shard of `directory` (reads all data: slow on big corpora)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for split in SPLITS:
        split_shards(directory, split)  # headers and sizes first: clearer errors
        for entry in manifest["splits"][split]["shards"]:
            check_shard(directory / entry["file"], entry, manifest, fix)


BLOCK = 1 << 24  # bytes read at a time: a multiple of every token size


def check_shard(path: Path, entry: dict[str, Any], manifest: dict[str, Any], fix: str) -> None:
    """DataError naming `path` and ending in `fix` unless the shard's bytes match the SHA-256
    its manifest `entry` recorded and every token is below the tokenizer's vocab size. One pass
    over the file (header and size checked first, `read_header`), hashing and scanning each
    block: 1.0-1.5 s per GB here (a 200 MB shard: 0.2-0.3 s; the hash alone 0.13 s), so
    20-30 s for a 10B-token GPT-2 set, once per process that opens it. The digest finds damage since the data was
    prepared; the range keeps a token no embedding has out of the model even when both the
    shard and its digest were rewritten (the digest says nothing of who wrote it)."""
    version, _ = read_header(path)
    dtype = TOKEN_DTYPES[version]
    digest, largest = hashlib.sha256(), -1
    with open(path, "rb") as f:
        digest.update(f.read(HEADER_BYTES))
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
            largest = max(largest, int(np.frombuffer(block, dtype).max()))
    vocab = manifest["tokenizer"]["vocab_size"]
    beyond = f"token id {largest}, outside the tokenizer's {vocab} ids" if largest >= vocab else ""
    if "sha256" in entry and digest.hexdigest() != entry["sha256"]:
        held = f": it holds {beyond}" if beyond else ""
        raise DataError(
            f"token shard {path} does not match the SHA-256 in its {MANIFEST} (damaged or "
            f"changed since it was prepared{held}); {fix}"
        )
    if beyond:
        raise DataError(
            f"token shard {path} holds {beyond}, though it matches its {MANIFEST} (the manifest "
            f"was made or edited for it); {fix}"
        )


def fingerprint(directory: str | os.PathLike) -> str:
    """Short identity of the data: SHA-256 of the manifest (or, without one, of the shard
    headers). A checkpoint can store it to notice that a resumed run's data changed."""
    directory = Path(directory)
    h = hashlib.sha256()
    if has_manifest(directory):
        h.update((directory / MANIFEST).read_bytes())
    else:
        for split in SPLITS:
            for path, num_tokens in split_shards(directory, split):
                h.update(f"{path.name}:{num_tokens};".encode())
    return h.hexdigest()[:16]


@functools.cache
def unigram_entropy(data_dir: str) -> float:
    """Entropy (nats) of the token frequencies of the train split: the loss of the best model
    that ignores context."""
    counts = np.zeros(1, dtype=np.int64)
    for path, _ in split_shards(Path(data_dir), "train"):
        c = np.bincount(read_shard(path).astype(np.int64))
        if len(c) > len(counts):
            counts = np.pad(counts, (0, len(c) - len(counts)))
        counts[: len(c)] += c
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
