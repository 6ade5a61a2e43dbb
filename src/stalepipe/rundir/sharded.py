"""Checkpoints as `torch.distributed.checkpoint` (DCP) shards, one per process.

A checkpoint is a directory `ckpt_<step>/` (format 2):

    checkpoint.json      {"format": 2, "step", "config", "ranks", "files"}: written last;
                         "files" holds each file's size and SHA-256 (`rundir.verified`)
    rank_<r>/            process r's DCP checkpoint: `.metadata` and `__0_0.distcp`, its state
                         under global keys (`rundir.checkpoint_parts.flatten_part`), and
                         state.json, the non-tensor rest of its state (step, policy, its stages
                         and their parameter names, param groups, integer optimizer counters)
    .stalepipe.json      the owner marker (`fileio`): a pruned checkpoint is an owned directory

Each process saves with `dcp.save(..., no_dist=True)` into its own `rank_<r>/` of the staging
directory `.ckpt_<step>.tmp/` (so a save needs no collective: it cannot deadlock with the
runtime's asynchronous votes, and a stage that dies while saving is seen at once through the
failure records, `rundir.checkpoint_parts.wait_part`), then hashes its complete files into
`digests.json`. Rank 0 waits for every shard's digests, writes checkpoint.json with all of them
and renames the staging directory into place (`commit`): a checkpoint under its final name is
complete, and older ones are pruned only after it is.

A loader (`ShardedCheckpoint`) reads checkpoint.json, then every shard's small state.json and
`.metadata`, each checked against its digest, the metadata unpickled by
`rundir.verified.SafeUnpickler` (nothing in a checkpoint runs code); it `dcp.load`s only the
keys it asks for, each tensor's bytes checked as they are read: a process reads (and hashes)
the bytes of its own parameters only, whichever split wrote them. A checkpoint of a version
that recorded no digests still loads, unverified, with one warning (`warn_unverified`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from stalepipe.errors import CheckpointError
from stalepipe.fileio import mark_owned, remove_owned_dir, write_json_atomic
from stalepipe.rundir import verified
from stalepipe.rundir.checkpoint_parts import PART_DONE, part_dir, part_path, staging_dir

FORMAT = 2
MANIFEST = verified.MANIFEST_NAME  # "checkpoint.json"
STATE = "state.json"  # a shard's non-tensor state, beside its DCP files
KIND = "checkpoint"  # the owner marker's kind (fileio)
ENTRIES = (MANIFEST, "rank_*")  # what a checkpoint directory holds besides the marker


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every no_dist call that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def clear_staging(run_dir: Path, step: int | None = None) -> None:
    """Delete the staging directory of `step` (default: of every step) an interrupted save
    left: its shards must never be mixed into a later checkpoint."""
    steps = [staging_dir(run_dir, step)] if step is not None else Path(run_dir).glob(".ckpt_*.tmp")
    for path in steps:
        shutil.rmtree(path, ignore_errors=True)


def save_part(
    run_dir: Path, step: int, pipe_rank: int, tensors: dict[str, torch.Tensor], meta: dict
) -> Path:
    """Write one process's shard of the checkpoint of `step` into the staging directory:
    state.json, then the DCP files, then (once they are complete) the digests of all of them
    (`PART_DONE`: the shard is complete when it is there)."""
    import torch.distributed.checkpoint as dcp

    where = part_dir(run_dir, step, pipe_rank)
    where.mkdir(parents=True, exist_ok=True)
    write_json_atomic(where / STATE, meta)
    tensors = {k: t.detach() for k, t in tensors.items()}
    with _quiet():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(where), no_dist=True)
    md = verified.load_metadata((where / verified.METADATA).read_bytes(), _own_save(where))
    ranges: dict[str, list[tuple[int, int]]] = {}
    for info in md.storage_data.values():
        ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
    write_json_atomic(where / PART_DONE, verified.shard_digests(where, ranges))
    return where


def _own_save(where: Path):
    return lambda reason: CheckpointError(f"the checkpoint shard just saved in {where} {reason}")


def commit(run_dir: Path, step: int, final: Path, manifest: dict[str, Any]) -> Path:
    """Rename the staging directory of `step` (every shard written) to `final`, atomically:
    the manifest (with every shard's digests) and the owner marker go in first. A checkpoint
    already under that name (a save of the same step again) is moved aside first and deleted
    after."""
    staging = staging_dir(run_dir, step)
    files = {}
    for r in manifest["ranks"]:
        done = part_path(run_dir, step, r)
        files.update(
            {f"{done.parent.name}/{k}": v for k, v in json.loads(done.read_text()).items()}
        )
        done.unlink()
    mark_owned(staging, KIND)
    record = {"format": FORMAT, "step": step, **manifest, "files": files}
    write_json_atomic(staging / MANIFEST, record)
    _fsync_dir(staging)
    aside = None
    if final.exists():
        aside = final.with_name(f".{final.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(final, aside)
    os.replace(staging, final)
    _fsync_dir(Path(run_dir))
    if aside is not None:
        remove_checkpoint_dir(aside)
    return final


def remove_checkpoint_dir(path: Path) -> None:
    """Delete a checkpoint directory stalepipe wrote (marked, holding only its entries)."""
    remove_owned_dir(path, KIND, ENTRIES, fix="delete it by hand")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be synced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def corrupt(path: Path, reason: str) -> CheckpointError:
    """The one line for a checkpoint that cannot be read whole (either format)."""
    return CheckpointError(
        f"checkpoint {path} is corrupt or incomplete ({reason}); move it aside (mv {path} "
        f"{path}.damaged) to resume from the previous checkpoint, or start over with --overwrite"
    )


def _reason(e: BaseException) -> str:
    """The line that says what went wrong: DCP wraps a rank's error with its traceback."""
    lines = [ln.strip() for ln in str(e).strip().splitlines()]
    said = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception): ", ln)]
    return (said[-1] if said else lines[0] if lines else type(e).__name__)[:200]


def _failed(e: BaseException) -> bool:
    """An error of reading a shard (DCP's CheckpointException is a BaseException)."""
    return isinstance(e, Exception) or type(e).__name__ == "CheckpointException"


_WARNED: set[Path] = set()


def warn_unverified(path: Path, why: str) -> None:
    """One warning per checkpoint and process that `path` carries no digests."""
    if Path(path).resolve() not in _WARNED:
        _WARNED.add(Path(path).resolve())
        print(
            f"stalepipe: warning: checkpoint {path} carries no digests ({why}): it loads, but "
            f"damage inside its files cannot be detected",
            file=sys.stderr,
        )


class ShardedCheckpoint:
    """A format-2 checkpoint directory, read lazily: the manifest and every shard's state.json
    and DCP `.metadata` at once (small, each checked against its digest), tensors only by key
    (`read`, each tensor's bytes checked as read). Anything missing, damaged, truncated or
    foreign raises CheckpointError naming the file and the fix; nothing in it is unpickled but
    by `verified.SafeUnpickler`."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        where = lambda rel: lambda reason: verified.damaged(self.path, rel, reason)  # noqa: E731
        try:
            data = (self.path / MANIFEST).read_bytes()
        except OSError as e:
            raise corrupt(self.path, f"{MANIFEST}: {e.strerror or type(e).__name__}") from None
        self.manifest = verified.read_json(data, where(MANIFEST))
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
            raise CheckpointError(
                f"{self.path / MANIFEST} is not a stalepipe checkpoint's (format {FORMAT}); move "
                f"{self.path} aside or start over with --overwrite"
            )
        files = self.manifest.get("files")
        self.verifier = verified.Verifier(self.path, files if isinstance(files, dict) else None)
        try:
            ranks = [f"rank_{int(r):03d}" for r in self.manifest["ranks"]]
        except (KeyError, TypeError, ValueError):
            raise verified.damaged(self.path, MANIFEST, "names no shards") from None
        self.metas = []
        for d in ranks:
            rel = f"{d}/{STATE}"
            meta = verified.read_json(self.verifier.read_small(rel), where(rel))
            try:  # JSON made the param groups' tuples (betas) lists
                for g in meta["param_groups"]:
                    lists = [k for k, v in g.items() if isinstance(v, list) and k != "param_names"]
                    g.update({k: tuple(g[k]) for k in lists})
            except (KeyError, TypeError, AttributeError):
                raise where(rel)("is not a stalepipe shard's state") from None
            self.metas.append(meta)
        self._shards = {
            self.path / d: verified.load_metadata(
                self.verifier.read_small(f"{d}/{verified.METADATA}"),
                where(f"{d}/{verified.METADATA}"),
            )
            for d in ranks
        }
        self._where = {
            key: (d, md)
            for d, meta in self._shards.items()
            for key, md in meta.state_dict_metadata.items()
        }

    @property
    def verifies(self) -> bool:
        """Whether the checkpoint recorded digests (every version since issue 39 does)."""
        return self.verifier.files is not None

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def stored_keys(self) -> set[str]:
        return set(self._where)

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors of `keys`, read from the shards that hold them (only those bytes), each
        checked against its digest before it is used."""
        import torch.distributed.checkpoint as dcp

        by_shard: dict[Path, dict[str, torch.Tensor]] = {}
        for key in keys:
            shard, md = self._where[key]
            by_shard.setdefault(shard, {})[key] = torch.empty(md.size, dtype=md.properties.dtype)
        for shard, want in by_shard.items():
            reader = verified.make_reader(shard, self._shards[shard], self.verifier)
            try:
                with _quiet():
                    dcp.load(want, storage_reader=reader, no_dist=True)
                reader.finish()  # every digest in, before any tensor leaves this method
            except BaseException as e:  # a missing, truncated, damaged or unreadable data file
                if not _failed(e):
                    raise
                with contextlib.suppress(CheckpointError):  # damaged bytes explain the error
                    reader.finish()
                if reader.failure is not None:
                    raise reader.failure from None
                raise corrupt(self.path, f"{shard.name}: {_reason(e)}") from None
            finally:
                reader.close()
        return {k: t for want in by_shard.values() for k, t in want.items()}

    def check_files(self) -> None:
        """Cheap check before a resume writes anything: every recorded file has its recorded
        size, and every data file the shards' metadata names is long enough (no tensor is
        read; the tensors' digests are checked as they are read)."""
        self.verifier.check_sizes()
        for shard, meta in self._shards.items():
            for info in (meta.storage_data or {}).values():
                f = shard / info.relative_path
                if not f.is_file() or f.stat().st_size < info.offset + info.length:
                    raise corrupt(
                        self.path, f"{shard.name}/{info.relative_path} is missing or short"
                    )
