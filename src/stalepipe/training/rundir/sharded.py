"""Checkpoints as `torch.distributed.checkpoint` (DCP) shards in safetensors, one per process.

A checkpoint is a directory `ckpt_<step>/` (format 3):

    checkpoint.json      {"format": 3, "step", "config", "ranks", "files"}: written last;
                         "files" holds each file's size and SHA-256 (`rundir.verified`)
    rank_<r>/            process r's DCP checkpoint, written by DCP's `HuggingFaceStorageWriter`:
                         `model-00001-of-00001.safetensors` (its state under global keys,
                         `rundir.checkpoint_parts.flatten_part`) and its JSON index, beside
                         state.json, the non-tensor rest of its state (step, policy, its stages
                         and their parameter names, param groups, integer optimizer counters)
    .stalepipe.json      the owner marker (`fileio`): a pruned checkpoint is an owned directory

Nothing in it is a pickle: a load parses the safetensors header itself, bounded by the file
(`rundir.verified.read_header`), and reads tensors through DCP's `HuggingFaceStorageReader`.
Format 2 (the same layout with DCP's pickled `.metadata` and `.distcp` files) and format 1 (one
`ckpt_<step>.pt`) are refused with one line naming `stalepipe checkpoint convert`, the one
place that reads them (`rundir.legacy`).

Each process saves with `dcp.save(..., no_dist=True)` into its own `rank_<r>/` of the staging
directory `.ckpt_<step>.tmp/` (so a save needs no collective: it cannot deadlock with the
runtime's asynchronous votes, and a stage that dies while saving is seen at once through the
failure records, `rundir.checkpoint_parts.wait_part`), then hashes its complete files into
`digests.json`. Rank 0 waits for every shard's digests, writes checkpoint.json with all of them
and renames the staging directory into place (`commit`): a checkpoint under its final name is
complete, and older ones are pruned only after it is. A save that fills the disk removes its
staging directory and stops with one line (`disk_full`): the previous checkpoint stays.

A loader (`ShardedCheckpoint`) reads checkpoint.json, then every shard's small state.json and
safetensors header, each checked against its digest and every path kept inside the checkpoint
directory; it `dcp.load`s only the keys it asks for, each tensor's bytes checked as they are
read: a process reads (and hashes) the bytes of its own parameters only, whichever split wrote
them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import struct
import time
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.futures import Future

from stalepipe.errors import CheckpointError, TrainingError
from stalepipe.fileio import mark_owned, remove_owned_dir, write_json_atomic
from stalepipe.training.rundir import verified
from stalepipe.training.rundir.checkpoint_parts import PART_DONE, part_dir, part_path, staging_dir

FORMAT = 3
OLD_FORMATS = (1, 2)  # read only by `stalepipe checkpoint convert` (rundir.legacy)
MANIFEST_MAX = 64 << 20  # a checkpoint.json larger than this is not one we wrote
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
    state.json, then the safetensors file (`streaming_writer`), then (once they
    are complete) the digests of all of them (`PART_DONE`: the shard is complete when it is
    there). A full disk is one line and leaves no staging directory (`disk_full`)."""
    import torch.distributed.checkpoint as dcp  # here: DCP (see streaming_writer)

    where = part_dir(run_dir, step, pipe_rank)
    tensors = {k: t.detach() for k, t in tensors.items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    with disk_full(run_dir, step, nbytes):
        where.mkdir(parents=True, exist_ok=True)
        write_json_atomic(where / STATE, meta)
        writer = streaming_writer(where)
        with _quiet():
            dcp.save(tensors, storage_writer=writer, no_dist=True)
        write_json_atomic(where / PART_DONE, verified.shard_digests(where, writer.chunks))
    return where


def _raw(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def streaming_writer(where: Path) -> Any:
    """DCP's `HuggingFaceStorageWriter` for the shard `where`, writing its one safetensors file
    as a stream: the header DCP's writer would write (the same keys, dtypes, shapes, offsets and
    DCP's sharding info), then each tensor's bytes straight from its memory. DCP's own writer
    first builds the whole file as one bytes object (`safetensors.torch.save`), a second copy
    of the state in memory and ~4x the save time here (420 MB: 7.1-7.5 s against 1.5-1.7 s).
    Planning and the index file are DCP's; what DCP's reader reads is this same format."""
    # here, not at the top: DCP takes ~1.7 s to import, and the loop imports this module
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    names = {dtype: name for name, dtype in verified.DTYPES.items()}

    class StreamingWriter(HuggingFaceStorageWriter):
        chunks: list[list] | None = None  # [offset, length, sha256] of what write_data wrote

        def write_data(self, plan: Any, planner: Any) -> Future:
            items = [(wi, planner.resolve_data(wi).detach().contiguous()) for wi in plan.items]
            header: dict[str, Any] = {}
            offset = 0
            for wi, t in items:
                n = t.numel() * t.element_size()
                shape, span = list(t.shape), [offset, offset + n]
                header[wi.index.fqn] = {
                    "dtype": names[t.dtype],
                    "shape": shape,
                    "data_offsets": span,
                }
                offset += n
            sharding = {
                wi.index.fqn: {"saved_offsets": list(wi.tensor_data.chunk.offsets)}
                for wi, _ in items
            }
            header["__metadata__"] = {
                "DCP_SHARDING_INFO": json.dumps(sharding),
                "DCP_VERSION": "1.0",
                "format": "pt",
            }
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # the data 8-byte aligned, as safetensors writes it
            start = verified.LEN_BYTES + len(raw)
            head = struct.pack("<Q", len(raw)) + raw
            # a thread hashes each piece while the next is written (hashlib releases the GIL):
            # the digests of what was written, without reading the file back
            with ThreadPoolExecutor(1) as hasher, open(where / verified.DATA, "wb") as f:
                pieces = [(0, head)]
                pieces += [
                    (start + header[wi.index.fqn]["data_offsets"][0], _raw(t)) for wi, t in items
                ]
                hashes = []
                for at, data in pieces:
                    f.write(data)
                    hashes.append((at, len(data), hasher.submit(verified.sha256, data)))
                f.flush()
                os.fsync(f.fileno())
                self.chunks = [[at, n, h.result()] for at, n, h in hashes]
            results = [
                WriteResult(
                    index=wi.index,
                    size_in_bytes=(n := t.numel() * t.element_size()),
                    storage_data=_StorageInfo(
                        verified.DATA, start + header[wi.index.fqn]["data_offsets"][0], n
                    ),
                )
                for wi, t in items
            ]
            fut: Future = Future()
            fut.set_result(results)
            return fut

    return StreamingWriter(str(where))


ENOSPC_TEXT = ("[Errno 28]", "No space left on device", "[Errno 122]")  # ENOSPC, EDQUOT


def _is_disk_full(e: BaseException) -> bool:
    """Whether `e` (or what it wraps: DCP wraps a writer's error in its CheckpointException,
    with the original inside its failures) is a full disk or quota."""
    seen: set[int] = set()
    todo: list[object] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(x, tuple):  # DCP's wrapped exception: (exception, stack summary)
            todo += list(x)
        elif isinstance(x, BaseException):
            failures = getattr(x, "failures", None)
            todo += [x.__cause__, x.__context__]
            todo += list(failures.values()) if isinstance(failures, dict) else []
    return any(t in str(e) for t in ENOSPC_TEXT)


@contextlib.contextmanager
def disk_full(run_dir: Path, step: int, nbytes: int) -> Iterator[None]:
    """Turn a full disk while saving the checkpoint of `step` into one line (TrainingError):
    what filled, about how much the save needed and how much is free; the staging directory
    is removed first, so the previous checkpoint is the newest and the disk is as it was."""
    try:
        yield
    except BaseException as e:
        if not _is_disk_full(e):
            raise
        clear_staging(run_dir, step)
        free = shutil.disk_usage(run_dir).free if Path(run_dir).is_dir() else 0
        kept = sorted(p.name for p in Path(run_dir).glob("ckpt_*") if (p / MANIFEST).is_file())
        raise TrainingError(
            f"the checkpoint of step {step} was not saved: no space left on the device of "
            f"{run_dir} (it needs about {nbytes / 1e6:.1f} MB, {free / 1e6:.1f} MB are free); "
            + (
                f"its partial files are removed and {kept[-1]} is the newest: free space, then "
                f"--resume"
                if kept
                else "its partial files are removed and the run has no earlier checkpoint: free "
                "space, then start it over with --overwrite"
            )
        ) from None


def commit(run_dir: Path, step: int, final: Path, manifest: dict[str, Any]) -> Path:
    """Rename the staging directory of `step` (every shard written) to `final`, atomically:
    the manifest (with every shard's digests) and the owner marker go in first. A checkpoint
    already under that name (a save of the same step again) is moved aside first and deleted
    after."""
    staging = staging_dir(run_dir, step)
    with disk_full(run_dir, step, 1 << 20):
        return _commit(run_dir, step, final, manifest, staging)


def _commit(run_dir: Path, step: int, final: Path, manifest: dict[str, Any], staging: Path) -> Path:
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


def refuse_old(path: Path, what: str) -> CheckpointError:
    """The one line for a checkpoint of an older format: it holds a pickle, which no load
    reads; `stalepipe checkpoint convert` reads it once, hardened, and writes format 3 (for a
    `.pt` file, as the directory of the same step beside it)."""
    if path.suffix == ".pt":
        new = path.with_suffix("")
        steps = f"stalepipe checkpoint convert {path} {new} && mv {path} {path}.old"
    else:
        new = Path(f"{path}.v3")
        steps = (
            f"stalepipe checkpoint convert {path} {new} && mv {path} {path}.old && mv {new} {path}"
        )
    return CheckpointError(
        f"checkpoint {path} is {what}, which holds a pickle that stalepipe no longer loads; "
        f"convert it once: `{steps}`"
    )


class ShardedCheckpoint:
    """A format-3 checkpoint directory, read lazily: the manifest and every shard's state.json
    and safetensors header at once (small, each checked against its digest), tensors only by
    key (`read`, each tensor's bytes checked as read). Anything missing, damaged, truncated,
    foreign, too large for its files or reached through a link out of the directory raises
    CheckpointError naming the file and the fix; nothing in it is unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        where = lambda rel: lambda reason: verified.damaged(self.path, rel, reason)  # noqa: E731
        self.manifest = verified.read_json(read_manifest(self.path), where(MANIFEST))
        fmt = self.manifest.get("format") if isinstance(self.manifest, dict) else None
        if fmt in OLD_FORMATS:
            raise refuse_old(self.path, f"in stalepipe's format {fmt} (a DCP .metadata pickle)")
        if fmt != FORMAT:
            raise CheckpointError(
                f"{self.path / MANIFEST} is not a stalepipe checkpoint's (format {FORMAT}); move "
                f"{self.path} aside or start over with --overwrite"
            )
        files = self.manifest.get("files")
        if not isinstance(files, dict):
            raise verified.damaged(self.path, MANIFEST, "records no file digests")
        self.verifier = verified.Verifier(self.path, files)
        ranks = self.manifest.get("ranks")
        if not (
            isinstance(ranks, list) and ranks and len(ranks) <= 4096 and verified.nonneg_ints(ranks)
        ):
            raise verified.damaged(self.path, MANIFEST, "names no shards")
        dirs = [f"rank_{r:03d}" for r in ranks]
        self.metas = [self._state(d, where(f"{d}/{STATE}")) for d in dirs]
        self._entries = {
            d: verified.read_header(self.verifier, f"{d}/{verified.DATA}") for d in dirs
        }
        self._shards = {
            d: verified.dcp_metadata(verified.inside(self.path, d), e)
            for d, e in self._entries.items()
        }
        self._where = {key: d for d, entries in self._entries.items() for key in entries}

    def _state(self, d: str, where: Any) -> dict[str, Any]:
        """A shard's state.json, checked against its digest; JSON made the param groups'
        tuples (betas) lists, so they are tuples again."""
        meta = verified.read_json(self.verifier.read_small(f"{d}/{STATE}"), where)
        try:
            for g in meta["param_groups"]:
                lists = [k for k, v in g.items() if isinstance(v, list) and k != "param_names"]
                g.update({k: tuple(g[k]) for k in lists})
        except (KeyError, TypeError, AttributeError):
            raise where("is not a stalepipe shard's state") from None
        return meta

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def stored_keys(self) -> set[str]:
        return set(self._where)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every stored tensor's shape, from the checked headers (nothing read or allocated)."""
        return {k: e.shape for entries in self._entries.values() for k, e in entries.items()}

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors of `keys`, read from the shards that hold them (only those bytes), each
        checked against its digest before it is used."""
        import torch.distributed.checkpoint as dcp  # here: DCP (see streaming_writer)

        by_shard: dict[str, dict[str, torch.Tensor]] = {}
        for key in keys:
            d = self._where[key]
            e = self._entries[d][key]
            by_shard.setdefault(d, {})[key] = torch.empty(e.shape, dtype=e.dtype)
        for d, want in by_shard.items():
            shard = verified.inside(self.path, d)
            reader = verified.make_reader(shard, self._shards[d], self._entries[d], self.verifier)
            try:
                with _quiet():
                    dcp.load(want, storage_reader=reader, no_dist=True)
            except BaseException as e:  # a missing, truncated, damaged or unreadable data file
                if not _failed(e):
                    raise
                if reader.failure is not None:  # damaged bytes explain DCP's wrapped error
                    raise reader.failure from None
                raise corrupt(self.path, f"{d}: {_reason(e)}") from None
        return {k: t for want in by_shard.values() for k, t in want.items()}

    def check_files(self) -> None:
        """Cheap check before a resume writes anything: every recorded file has its recorded
        size (no tensor is read; the headers were checked against the files when opened, the
        tensors' digests are checked as they are read)."""
        self.verifier.check_sizes()


def read_manifest(path: Path) -> bytes:
    """A checkpoint's checkpoint.json, inside it and no larger than `MANIFEST_MAX`."""
    try:
        f = verified.inside(path, MANIFEST)
        size = f.stat().st_size
        if size > MANIFEST_MAX:
            raise corrupt(path, f"{MANIFEST} is {size} bytes, larger than any stalepipe writes")
        return f.read_bytes()
    except OSError as e:
        raise corrupt(path, f"{MANIFEST}: {e.strerror or type(e).__name__}") from None
