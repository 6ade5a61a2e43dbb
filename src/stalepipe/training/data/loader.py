"""Deterministic batches from token shards: batch k is a pure function of (seed, split, k).

Each batch is `batch_size` windows of `seq_len + 1` tokens at offsets drawn uniformly (with
replacement, nanoGPT-style) from all windows that fit inside one shard, using a torch generator
seeded from `(seed, split, step)`. Consequences the rest of stalepipe relies on:

- The loader holds no position: the training loop's `step` *is* the data position, so a resumed
  run, an emulator and every pipeline stage (each building its own loader) see the same tokens.
- Evaluation is `batch(i, ...)` for `i = 0..n-1` on the `val` split; with a fixed seed (e.g.
  `EVAL_SEED`) it is identical across runs, whatever the training seed.
- Changing `batch_size` changes every batch (offsets are drawn as one block).

Windows never cross a shard boundary, which only loses `seq_len` windows per shard.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from stalepipe.errors import DataError
from stalepipe.training.data.manifest import (
    SPLITS,
    check_shard,
    has_manifest,
    read_manifest,
    split_shards,
)
from stalepipe.training.data.prepare import reprepare
from stalepipe.training.data.shards import read_shard

EVAL_SEED = 0


def batch_seed(seed: int, split: str, step: int) -> int:
    """The generator seed of batch `step`: a hash, so nearby (seed, step) pairs are unrelated."""
    digest = hashlib.sha256(f"stalepipe-batch:{seed}:{split}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class TokenLoader:
    """Random-window batches over one split of a prepared (or llm.c-format) data directory.

    `batch(step, batch_size)` returns `(x, y)`, int64 CPU tensors of shape (batch_size, seq_len),
    with `y[:, t] == x[:, t + 1]` inside the window (next-token targets). Shards are
    memory-mapped, so opening is cheap and only the sampled windows are read.
    """

    def __init__(self, data_dir: str | os.PathLike, split: str, seq_len: int, seed: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.data_dir = Path(data_dir)
        self.split = split
        self.seq_len = seq_len
        self.seed = seed
        shards = split_shards(self.data_dir, split)
        self._manifest = read_manifest(self.data_dir) if has_manifest(self.data_dir) else None
        if self._manifest is not None:
            check_split(self.data_dir, split, self._manifest)
        self._tokens = [read_shard(path) for path, _ in shards]
        self.num_tokens = sum(n for _, n in shards)
        # Window starts per shard: 0 .. n - (seq_len + 1), none for shards that are too short.
        windows = np.array([max(0, len(t) - seq_len) for t in self._tokens], dtype=np.int64)
        if windows.sum() == 0:
            longest = max((len(t) for t in self._tokens), default=0)
            raise DataError(
                f"the {split} split of {self.data_dir} has {longest} tokens in its longest "
                f"shard, fewer than seq_len+1 = {seq_len + 1}; lower --data.seq_len or prepare "
                "more data"
            )
        self._window_ends = np.cumsum(windows)
        self.num_windows = int(self._window_ends[-1])

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocab size from the manifest (None for foreign shards)."""
        return self._manifest["tokenizer"]["vocab_size"] if self._manifest else None

    @property
    def eot(self) -> int | None:
        """The document-separator id from the manifest (None for foreign shards)."""
        return self._manifest["tokenizer"]["eot"] if self._manifest else None

    def offsets(self, step: int, batch_size: int) -> list[tuple[int, int]]:
        """`(shard index, start)` of each window of batch `step`: the pure part of `batch`."""
        if step < 0 or batch_size < 1:
            raise ValueError(f"need step >= 0 and batch_size >= 1, got {step}, {batch_size}")
        gen = torch.Generator().manual_seed(batch_seed(self.seed, self.split, step))
        flat = torch.randint(self.num_windows, (batch_size,), generator=gen).numpy()
        shard = np.searchsorted(self._window_ends, flat, side="right")
        start = flat - np.concatenate(([0], self._window_ends))[shard]
        return list(zip(shard.tolist(), start.tolist()))

    def full_split(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every token of the split as a target exactly once where a window fits: each shard
        cut into non-overlapping windows of `seq_len` inputs (window k's targets are tokens
        k*seq_len+1 .. (k+1)*seq_len), in order, `batch_size` windows a batch (the last may be
        smaller). A shard's tail shorter than a window is left out."""
        span, rows = self.seq_len + 1, []
        for tokens in self._tokens:
            for start in range(0, len(tokens) - span + 1, self.seq_len):
                rows.append(tokens[start : start + span])
                if len(rows) == batch_size:
                    yield _pair(rows)
                    rows = []
        if rows:
            yield _pair(rows)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of batch `step`, each (batch_size, seq_len) int64."""
        span = self.seq_len + 1
        return _pair([self._tokens[s][o : o + span] for s, o in self.offsets(step, batch_size)])


def check_split(data_dir: Path, split: str, manifest: dict) -> None:
    """Every shard of `split` against its manifest (`manifest.check_shard`: its digest and its
    token range), once per loader: a process reads each shard in full once when it opens it,
    never per batch. Shards of another tool (no manifest) are checked by `check_vocab` instead,
    whose scan of their largest id is the run's start-up."""
    fix = reprepare(data_dir, manifest)
    for entry in manifest["splits"][split]["shards"]:
        check_shard(data_dir / entry["file"], entry, manifest, fix)


class ReplicaBatches:
    """step -> one data-parallel replica's share of batch `step`, as microbatches: rows
    [d B / D, (d + 1) B / D) of `loader.batch(step, B)` for replica d of D, moved to `device`
    and split into `num_microbatches` (inputs, targets) lists. What the pipeline runtime's first
    and last stage read at each step."""

    def __init__(
        self,
        loader: TokenLoader,
        batch_size: int,
        replica: int,
        num_replicas: int,
        num_microbatches: int,
        device: torch.device,
    ) -> None:
        self.loader, self.batch_size = loader, batch_size
        self.m, self.device = num_microbatches, device
        share = batch_size // num_replicas
        self.rows = slice(replica * share, (replica + 1) * share)

    def __call__(self, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        x, y = self.loader.batch(step, self.batch_size)
        x, y = x[self.rows].to(self.device), y[self.rows].to(self.device)
        return list(x.chunk(self.m)), list(y.chunk(self.m))


def _pair(rows: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of seq_len + 1 tokens as (inputs, next-token targets), int64."""
    windows = torch.from_numpy(np.stack(rows).astype(np.int64))
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def check_vocab(data_dir: str | os.PathLike, model_vocab_size: int) -> None:
    """Raise DataError if a model with `model_vocab_size` ids cannot embed the data's tokens.

    With a manifest: its tokenizer's vocab, and the largest id of each split recorded when the
    data was prepared (nothing is read). Shards of another tool (llm.c's GPT-2 shards with a
    byte-vocab model, say) are scanned once for their largest id (`max_token_id`); that is
    skipped when the shard dtype cannot hold an id as large as the model's vocab.
    """
    if has_manifest(data_dir):
        manifest = read_manifest(data_dir)
        vocab = manifest["tokenizer"]["vocab_size"]
        if model_vocab_size < vocab:
            raise DataError(
                f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's {vocab}; "
                f"use --model.vocab_size {_round_vocab(vocab)}"
            )
        recorded = [manifest["splits"][s].get("max_token_id") for s in SPLITS]
        largest = max((m for m in recorded if isinstance(m, int)), default=-1)
        hint = ""
    else:
        largest = max(max_token_id(path, below=model_vocab_size) for path in _all_shards(data_dir))
        hint = " (or a preset made for these tokens, e.g. --preset smollm-135m for GPT-2 shards)"
    if largest >= model_vocab_size:
        raise DataError(
            f"{data_dir} holds token id {largest} but model.vocab_size is {model_vocab_size}; "
            f"set --model.vocab_size {_round_vocab(largest + 1)}{hint}"
        )


def _round_vocab(n: int) -> int:
    return -(-n // 64) * 64  # a multiple of 64: faster matmuls (nanoGPT's 50304)


def _all_shards(data_dir: str | os.PathLike) -> list[Path]:
    return [path for split in SPLITS for path, _ in split_shards(data_dir, split)]


def max_token_id(path: str | os.PathLike, below: int | None = None) -> int:
    """The largest token id in a shard (-1 for an empty one), one vectorised pass over the
    memory map: measured 0.01-0.03 s per 100M uint16 tokens (200 MB) from the page cache, so
    about 2 s for a 10B-token GPT-2 set; disk speed when cold (10 s at 2 GB/s).

    With `below`: returns early (-1) when the shard's dtype cannot hold an id >= `below`, so
    uint16 shards never need a scan for a model vocab above 65535."""
    tokens = read_shard(path)
    if below is not None and np.iinfo(tokens.dtype).max < below:
        return -1
    return int(tokens.max()) if len(tokens) else -1
