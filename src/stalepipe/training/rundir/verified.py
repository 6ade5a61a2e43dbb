"""Reading a checkpoint shard without trusting it: safetensors headers parsed and bounded by
hand, every path kept inside the checkpoint, every byte checked against the digests its save
recorded (issues 39 and 50).

Checkpoints travel (a shared run directory, a cluster's scratch space, a run someone sends to
reproduce a result), so a load trusts nothing in them:

- **Nothing is unpickled.** A shard's tensors are one safetensors file written through DCP's
  `HuggingFaceStorageWriter` (`sharded.streaming_writer`): an 8-byte header length, a JSON header (dtype, shape and byte
  range of every tensor) and the raw bytes. `read_header` parses the header itself and checks
  it before anything is allocated: the length no larger than the file, every dtype one we
  write, every shape's bytes equal to its range, every range inside the file and none
  overlapping. DCP then loads through `HuggingFaceStorageReader` with that checked metadata
  (its own header reader is never called), each tensor's bytes read straight into the tensor
  DCP allocated from that metadata (`make_reader`): nothing else is built. state.json and
  checkpoint.json are JSON.
- **Nothing outside the directory.** Every file a load opens is resolved inside the checkpoint
  directory (`inside`): a symlink that points out is refused, one line naming it.
- **Damage is seen.** After a process's shard is complete, the save hashes its files
  (`shard_digests`: SHA-256 of the small files whole, and of the data file's header and each
  tensor's byte range, which cover the file) and commit puts them in checkpoint.json
  (`"files"`). Every load checks what it reads before using it: the small files whole, the
  header before it is parsed, each tensor's bytes once read into it, before DCP may use it
  (`make_reader`: a process that reads only its own parameters' keys hashes only those bytes,
  and what is checked is what is loaded), and every file's size in
  the cheap check before a resume writes anything. docs/benchmarks.md ("Checkpoint cost") has
  what it costs a load.

The digests are not a signature: whoever can write a checkpoint can write its checkpoint.json
too. They find damage (a bad disk, a half-copied file, bytes overwritten in place); safety
against a crafted file is the bounded parser's and the pickle-free format's job, with or
without digests. Older checkpoints (a DCP `.metadata` pickle, or one `.pt` file) are read only
by `stalepipe checkpoint convert` (`rundir.legacy`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.futures import Future

from stalepipe import fileio
from stalepipe.errors import CheckpointError

DIGEST = "sha256"
VERIFY_ENV = "STALEPIPE_VERIFY"  # =0: skip the tensors' digests (sizes and small files stay)
DATA = "model-00001-of-00001.safetensors"  # the one data file `HuggingFaceStorageWriter` writes
INDEX = "model.safetensors.index.json"  # and its JSON index (hashed, never needed to load)
MANIFEST_NAME = "checkpoint.json"  # a checkpoint directory's manifest (rundir.sharded.MANIFEST)
HEADER_MAX = 64 << 20  # a header longer than this is not one we wrote (ours: ~200 B a tensor)
SMALL_MAX = 64 << 20  # nor a state.json (ours: a few kilobytes)
LEN_BYTES = 8  # safetensors: the header's length, little-endian u64, then the header
# safetensors' dtype names, for the dtypes a stalepipe checkpoint holds
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_DIMS = 8


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """{"size", "sha256"} of a whole (small) file."""
    data = path.read_bytes()
    return {"size": len(data), DIGEST: sha256(data)}


def damaged(ckpt: Path, rel: str, what: str) -> CheckpointError:
    """The one line for a checkpoint file that fails a check: the file, what failed, the fix
    (move the checkpoint aside, so the run's previous one is its newest; nothing is deleted)."""
    return CheckpointError(
        f"checkpoint file {Path(ckpt) / rel} {what}; move the checkpoint aside (mv {ckpt} "
        f"{ckpt}.damaged) to resume, eval or export from the run's previous one, or start over "
        f"with --overwrite"
    )


def inside(root: Path, rel: str) -> Path:
    """`root / rel`, refused (CheckpointError, one line naming the link and the copy that
    replaces it) when a symlink on the way leads out of `root` (`fileio.inside`); `root`
    itself may be a link, and a link that stays inside is followed."""
    try:
        return fileio.inside(root, Path(root) / rel)
    except fileio.LinkError as e:
        raise CheckpointError(f"checkpoint {root}: {e}") from None


class Verifier:
    """The checks of one checkpoint directory: its `"files"` record and how to word a
    failure (`damaged`)."""

    def __init__(self, ckpt: Path, files: dict[str, Any]) -> None:
        self.ckpt = Path(ckpt)
        self.files = files
        # the opt-out of hashing tensors' bytes (docs/runtime.md: what it costs a load)
        self.data = os.environ.get(VERIFY_ENV, "1") != "0"
        self._chunks: dict[str, dict[tuple[int, int], str]] = {}

    def damaged(self, rel: str, what: str) -> CheckpointError:
        return damaged(self.ckpt, rel, what)

    def record(self, rel: str) -> dict[str, Any]:
        want = self.files.get(rel)
        if not isinstance(want, dict) or not isinstance(want.get("size"), int):
            raise self.damaged(rel, f"is not in {MANIFEST_NAME}'s file list with its size")
        return want

    def read_small(self, rel: str) -> bytes:
        """The bytes of a small file of the checkpoint (a shard's state.json), checked against
        its recorded size before it is read and its digest before anyone parses it."""
        size = self.check_size(rel)  # before reading: a recorded size is never allocated on trust
        if size > SMALL_MAX:
            raise self.damaged(rel, f"is {size} bytes, more than any stalepipe shard's state")
        data = self.read_range(rel, 0, size)
        if sha256(data) != self.files[rel].get(DIGEST):
            raise self.damaged(rel, "does not match the digest its save recorded")
        return data

    def actual_size(self, rel: str) -> int | None:
        path = inside(self.ckpt, rel)
        return path.stat().st_size if path.is_file() else None

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        """`length` bytes of `rel` from `offset`; damaged when the file is shorter."""
        try:
            with open(inside(self.ckpt, rel), "rb") as f:
                f.seek(offset)
                data = f.read(length)
        except OSError as e:
            raise self.damaged(rel, f"unreadable: {e.strerror or type(e).__name__}") from None
        if len(data) != length:
            raise self.damaged(rel, "is shorter than its header or record says")
        return data

    def check_size(self, rel: str) -> int:
        """The size of `rel`, once it equals its record (missing, truncated or appended to:
        damaged); no byte is read."""
        want, size = self.record(rel)["size"], self.actual_size(rel)
        if size != want:
            raise self.damaged(
                rel, "is missing" if size is None else f"is {size} bytes, not {want}"
            )
        return size

    def check_sizes(self) -> None:
        """Every recorded file exists with its recorded size (no byte is read)."""
        for rel in self.files:
            self.check_size(rel)

    def chunks(self, rel: str) -> dict[tuple[int, int], str] | None:
        """The recorded byte ranges of a data file: {(offset, length): sha256}; None when
        `VERIFY_ENV` is 0."""
        if not self.data:
            return None
        if rel not in self._chunks:
            try:
                self._chunks[rel] = {
                    (int(o), int(n)): str(h) for o, n, h in self.record(rel)["chunks"]
                }
            except (TypeError, KeyError, ValueError):
                raise self.damaged(rel, f"has no byte ranges in {MANIFEST_NAME}") from None
        return self._chunks[rel]


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file, as its (checked) header gives it: absolute offsets."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # first byte in the file
    length: int


def read_header(verifier: Verifier, rel: str) -> dict[str, Entry]:
    """The tensors of the safetensors file `rel`, from its header, checked before anything is
    allocated past what the file holds: the header's length against the file, its digest (when
    recorded), then every entry (`_entries`)."""
    size = verifier.check_size(rel) if rel in verifier.files else verifier.actual_size(rel)
    if size is None:
        raise verifier.damaged(rel, "is missing")
    if size < LEN_BYTES:
        raise verifier.damaged(rel, "is too short to be a safetensors file")
    n = int.from_bytes(verifier.read_range(rel, 0, LEN_BYTES), "little")
    if not 2 <= n <= min(size - LEN_BYTES, HEADER_MAX):
        raise verifier.damaged(rel, f"claims a {n}-byte header in a {size}-byte file")
    head = verifier.read_range(rel, 0, LEN_BYTES + n)
    chunks = verifier.chunks(rel)
    if chunks is not None and chunks.get((0, LEN_BYTES + n)) != sha256(head):
        raise verifier.damaged(rel, "has a header that does not match its recorded digest")
    try:
        parsed = json.loads(head[LEN_BYTES:])
    except ValueError:
        raise verifier.damaged(rel, "has a header that is not JSON") from None
    problem, entries = _entries(parsed, LEN_BYTES + n, size)
    if problem:
        raise verifier.damaged(rel, problem)
    return entries


def _entries(parsed: Any, start: int, size: int) -> tuple[str | None, dict[str, Entry]]:
    """(what is wrong, the entries) of a parsed safetensors header whose data starts at byte
    `start` of a `size`-byte file: known dtypes, shapes whose bytes equal their ranges, ranges
    inside the file and not overlapping, whole tensors only (DCP's saved offsets all 0)."""
    if not isinstance(parsed, dict):
        return "has a header that is not a JSON object", {}
    meta = parsed.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        return "has a malformed __metadata__", {}
    out: dict[str, Entry] = {}
    for key, e in parsed.items():
        what = f"declares tensor {key[:60]!r} "
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            return what + "without exactly dtype, shape and data_offsets", {}
        dtype, shape, offs = DTYPES.get(e["dtype"]), e["shape"], e["data_offsets"]
        if dtype is None:
            return what + f"of dtype {str(e['dtype'])[:20]!r}", {}
        if not (
            nonneg_ints(shape) and len(shape) <= MAX_DIMS and nonneg_ints(offs) and len(offs) == 2
        ):
            return what + "with a malformed shape or byte range", {}
        begin, end = offs
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not (0 <= begin <= end and start + end <= size and end - begin == nbytes):
            return what + f"of shape {shape} in bytes {begin}-{end} of a {size}-byte file", {}
        out[key] = Entry(dtype, tuple(shape), start + begin, nbytes)
    spans = sorted((e.offset, e.offset + e.length) for e in out.values() if e.length)
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:], strict=False)):
        return "declares overlapping tensors", {}
    if (problem := _whole_tensors(meta, out)) is not None:
        return problem, {}
    return None, out


def read_json(data: bytes, where: Callable[[str], CheckpointError]) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        raise where("is not JSON") from None


def nonneg_ints(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)


def _whole_tensors(meta: dict[str, str], entries: dict[str, Entry]) -> str | None:
    """DCP records each tensor's offset in the global tensor; a stalepipe shard holds whole
    tensors only (its keys are the reshard), so every offset is 0."""
    info = meta.get("DCP_SHARDING_INFO")
    if info is None:
        return None
    try:
        offsets = {k: v["saved_offsets"] for k, v in json.loads(info).items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return "has malformed DCP sharding info"
    if any(not nonneg_ints(o) or any(o) for o in offsets.values()) or set(offsets) - set(entries):
        return "holds a piece of a tensor, which a stalepipe shard never does"
    return None


def dcp_metadata(shard: Path, entries: dict[str, Entry]) -> Any:
    """DCP `Metadata` for a shard's checked entries, as `HuggingFaceStorageReader` would build
    it from the same header (so DCP's planner and reader work unchanged)."""
    # here, not at the top: DCP takes ~1.7 s to import, and the loop imports this module
    from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    state, storage = {}, {}
    for key, e in entries.items():
        zeros = [0] * len(e.shape)
        state[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=e.dtype),
            size=torch.Size(e.shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(zeros), sizes=torch.Size(e.shape))],
        )
        storage[MetadataIndex(fqn=key, offset=zeros)] = _HFStorageInfo(
            relative_path=str(shard / DATA), shape=torch.Size(e.shape), dtype=e.dtype
        )
    return Metadata(state_dict_metadata=state, storage_data=storage)


def shard_digests(shard: Path, chunks: list[list] | None = None) -> dict[str, Any]:
    """The digests of a complete shard's files, by name in the shard: the small files (JSON)
    whole, the data file as its header and each tensor's byte range with their SHA-256s:
    `chunks` as the writer hashed them while writing ([offset, length, sha256]), or else read
    back from the file. Either way the header is parsed as a load parses it, so a shard its
    own reader would refuse is never recorded as complete."""
    out = {p.name: file_record(p) for p in sorted(shard.iterdir()) if p.suffix == ".json"}
    size = (shard / DATA).stat().st_size
    own = Verifier(shard, {DATA: {"size": size}})
    own.data = False  # nothing recorded yet: this is what gets recorded
    entries = read_header(own, DATA)
    if chunks is None:
        chunks = []
        with open(shard / DATA, "rb") as f:
            n = LEN_BYTES + int.from_bytes(f.read(LEN_BYTES), "little")
            for offset, length in [(0, n), *sorted((e.offset, e.length) for e in entries.values())]:
                f.seek(offset)
                chunks.append([offset, length, sha256(f.read(length))])
    out[DATA] = {"size": size, "chunks": chunks}
    return out


def make_reader(shard: Path, md: Any, entries: dict[str, Entry], verifier: Verifier):
    """A DCP `HuggingFaceStorageReader` for `shard` that takes its metadata as already read and
    checked (`md`, from `read_header`: no one else parses the header) and reads each tensor's
    bytes straight into the tensor DCP hands it (`readinto`, no memory map and no temporary
    copy), and hashes those very bytes against `verifier`'s digest (on a thread, while the next
    tensor is read), every digest checked before DCP returns: one read, and what is checked is
    what is loaded. A failure is kept in `.failure` (DCP wraps what a reader raises in its own
    exception)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader  # here: DCP (see above)

    rel = f"{shard.name}/{DATA}"

    class VerifiedReader(HuggingFaceStorageReader):
        failure: CheckpointError | None = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return md

        def read_data(self, plan: Any, planner: Any) -> Future:
            try:
                chunks = verifier.chunks(rel)
                # a thread hashes each tensor while the next one is read (hashlib releases the
                # GIL); every digest is checked before DCP returns, so no tensor is used unchecked
                with ThreadPoolExecutor(1, thread_name_prefix="stalepipe-digest") as hasher:
                    pending = []
                    with open(inside(verifier.ckpt, rel), "rb") as f:
                        for item in plan.items:
                            key, buf = self._read(f, item, planner)
                            if chunks is not None:
                                pending.append((key, hasher.submit(sha256, buf)))
                    for key, digest in pending:
                        self._check(key, digest.result(), chunks)
            except CheckpointError as e:
                self.failure = e
                raise
            fut: Future = Future()
            fut.set_result(None)
            return fut

        def _read(self, f: Any, item: Any, planner: Any) -> tuple[str, memoryview]:
            key = item.storage_index.fqn
            e = entries[key]
            target = planner.resolve_tensor(item).detach()
            whole = (
                list(item.storage_offsets) == [0] * len(e.shape) and tuple(item.lengths) == e.shape
            )
            if (
                not whole
                or target.shape != e.shape
                or target.dtype != e.dtype
                or not target.is_contiguous()
            ):
                raise verifier.damaged(rel, f"holds {key[:60]!r} as {e.shape}, not as asked")
            buf = memoryview(target.reshape(-1).view(torch.uint8).numpy())
            f.seek(e.offset)
            if f.readinto(buf) != e.length:
                raise verifier.damaged(rel, "is shorter than its header says")
            planner.commit_tensor(item, target)
            return key, buf

        def _check(self, key: str, digest: str, chunks: dict) -> None:
            e = entries[key]
            if chunks.get((e.offset, e.length)) != digest:
                end = e.offset + e.length
                what = f"does not match the digest its save recorded (bytes {e.offset}-{end}, tensor {key[:60]})"
                raise verifier.damaged(rel, what)

    return VerifiedReader(str(shard))
