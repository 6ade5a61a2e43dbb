"""Reading the checkpoints of older versions, for `stalepipe checkpoint convert` only.

Format 2 kept each shard's DCP metadata as a pickle (`.metadata`) and its tensors as
`.distcp` files that torch reads with `torch.load(weights_only=True)`; format 1 was one
`ckpt_<step>.pt` file, also a pickle. No load reads either any more (`rundir.sharded`
refuses them in one line): the conversion reads them once, in a child process with a memory
limit (`rundir.convert`), through this module:

- **No code runs, nothing is steered.** `SafeUnpickler` resolves only DCP's own metadata
  classes and the torch values they hold (`ALLOWED`, dtypes). It is the pure-Python unpickler
  with three opcodes hardened: BUILD applies state only to an instance of an allowed class,
  never to a class (a pickle could otherwise set `PosixPath.parent` for the whole process),
  the memo holds at most `MEMO_MAX` entries, and a frame may not claim more bytes than the
  pickle has. `check_metadata` then checks the shape of what came out (tensors only, data
  files inside the shard, no storage transforms).
- **Damage is seen.** Format 2 recorded digests of every file (`Verifier`, `check_data`):
  the small files are checked whole before they are parsed, each tensor's bytes as they are
  read. A format-2 checkpoint written before digests existed converts with one warning.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from stalepipe.errors import CheckpointError
from stalepipe.training.rundir.verified import (
    DIGEST,
    MANIFEST_NAME,
    VERIFY_ENV,
    damaged,
    file_record,
    read_json,
    sha256,
)

METADATA = ".metadata"  # DCP's name for a shard's metadata pickle
_DCP = "torch.distributed.checkpoint"
# Every global a DCP shard's `.metadata` names (torch 2.4-2.14 write these), besides torch's
# dtypes: its dataclasses, the path it was saved to, tensor sizes, layouts and memory formats.
ALLOWED = frozenset(
    {
        *(
            (f"{_DCP}.metadata", name)
            for name in (
                "Metadata",
                "TensorStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        (f"{_DCP}.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)


class UnsafePickle(Exception):
    """A pickle names a global outside `ALLOWED`: it would run code, so it is never loaded."""


MEMO_MAX = 1 << 20  # memo entries: DCP's metadata of a 70B model uses a few thousand


def _allowed_class(obj: Any) -> bool:
    return any(
        type(obj).__module__ == m and type(obj).__qualname__ == n for m, n in ALLOWED
    ) or type(obj) in (dict, list, tuple)


class SafeUnpickler(pickle._Unpickler):  # type: ignore[name-defined]  # the Python one: hookable
    """The pure-Python unpickler, resolving only `ALLOWED` globals and torch's dtypes, with
    BUILD, the memo and frames bounded (module docstring)."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._stream = file

    def _build(self) -> None:
        inst, state = self.stack[-2], self.stack[-1]
        if isinstance(inst, type) or not _allowed_class(inst):
            raise UnsafePickle(f"a BUILD on {getattr(inst, '__qualname__', type(inst).__name__)}")
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
        if getattr(type(inst), "__setstate__", None) is None and not all(
            p is None or (isinstance(p, dict) and all(type(k) is str for k in p)) for p in parts
        ):
            raise UnsafePickle("a BUILD with a state that is not a dict of names")
        # an allowed class's own __setstate__ (DCP's TensorProperties takes a tuple) runs as is
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    def _frame(self) -> None:
        (size,) = struct.unpack("<Q", self.read(8))
        if size > self._left():
            raise UnsafePickle(f"a frame of {size} bytes in a shorter pickle")
        self._unframer.load_frame(size)

    def _left(self) -> int:
        f = self._stream
        return len(f.getbuffer()) - f.tell() if isinstance(f, io.BytesIO) else sys.maxsize

    def _memo_put(self, op: Callable[[Any], None]) -> Callable[[Any], None]:
        def put(self: SafeUnpickler) -> None:
            if len(self.memo) >= MEMO_MAX:
                raise UnsafePickle(f"more than {MEMO_MAX} memo entries")
            op(self)

        return put

    for _op, _name in ((pickle.BUILD, "_build"), (pickle.FRAME, "_frame")):
        dispatch[_op[0]] = locals()[_name]
    for _op in (pickle.PUT, pickle.BINPUT, pickle.LONG_BINPUT, pickle.MEMOIZE):
        dispatch[_op[0]] = _memo_put(None, dispatch[_op[0]])  # type: ignore[arg-type]
    del _op, _name

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePickle(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle(f"a persistent id ({str(pid)[:40]})")


class Verifier:
    """The checks of one checkpoint directory: its `"files"` record (None for a checkpoint
    written before stalepipe recorded digests) and how to word a failure (`damaged`)."""

    def __init__(self, ckpt: Path, files: dict[str, Any] | None) -> None:
        self.ckpt = Path(ckpt)
        self.files = files
        # the opt-out of hashing tensors' bytes (docs/runtime.md: what it costs a load)
        self.data = os.environ.get(VERIFY_ENV, "1") != "0"
        self._chunks: dict[str, dict[int, tuple[int, str]]] = {}

    def damaged(self, rel: str, what: str) -> CheckpointError:
        return damaged(self.ckpt, rel, what)

    def read_small(self, rel: str) -> bytes:
        """The bytes of a small file of the checkpoint (a shard's `.metadata` or state.json),
        checked against its size and digest before anyone parses them."""
        path = self.ckpt / rel
        try:
            data = path.read_bytes()
        except OSError as e:
            raise self.damaged(rel, f"unreadable: {e.strerror or type(e).__name__}") from None
        if self.files is not None:
            want = self.files.get(rel)
            if not isinstance(want, dict):
                raise self.damaged(rel, "not in checkpoint.json's file list")
            if len(data) != want.get("size") or sha256(data) != want.get(DIGEST):
                raise self.damaged(rel, "does not match the digest its save recorded")
        return data

    def check_sizes(self) -> None:
        """Every recorded file exists with its recorded size (no byte is read)."""
        for rel, want in (self.files or {}).items():
            if not isinstance(want, dict):
                raise self.damaged(MANIFEST_NAME, f"records {rel!r} without a size")
            path = self.ckpt / rel
            size = path.stat().st_size if path.is_file() else None
            if size != want.get("size"):
                got = "is missing" if size is None else f"is {size} bytes, not {want.get('size')}"
                raise self.damaged(rel, got)

    def chunks(self, rel: str) -> dict[int, tuple[int, str]] | None:
        """The recorded byte ranges of a data file: {offset: (length, sha256)}; None when the
        checkpoint recorded none or `VERIFY_ENV` is 0."""
        if self.files is None or not self.data:
            return None
        if rel not in self._chunks:
            want = self.files.get(rel)
            try:
                self._chunks[rel] = {int(o): (int(n), str(h)) for o, n, h in want["chunks"]}
            except (TypeError, KeyError, ValueError):
                raise self.damaged(rel, "has no byte ranges in checkpoint.json") from None
        return self._chunks[rel]


def load_metadata(data: bytes, where: Callable[[str], CheckpointError]) -> Any:
    """A shard's DCP `Metadata` from the bytes of its `.metadata`, unpickled by `SafeUnpickler`
    and checked by `check_metadata`; `where(reason)` words the error."""
    try:
        md = SafeUnpickler(io.BytesIO(data)).load()
    except UnsafePickle as e:
        raise where(
            f"names {e}, which a DCP checkpoint never holds: not loaded, nothing of it ran"
        ) from None
    except Exception as e:  # truncated / garbage bytes: pickle raises many types
        raise where(f"is not DCP metadata ({type(e).__name__})") from None
    if (problem := check_metadata(md)) is not None:
        raise where(problem)
    return md


def check_metadata(md: Any) -> str | None:
    """What is wrong with an unpickled `.metadata` for a stalepipe shard, or None: every entry
    a tensor, every byte range in a plain file of the shard, no storage transforms."""

    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        return "is not DCP metadata"
    for key, entry in md.state_dict_metadata.items():
        if not (
            isinstance(key, str)
            and isinstance(entry, TensorStorageMetadata)
            and isinstance(entry.properties, TensorProperties)
            and isinstance(entry.properties.dtype, torch.dtype)
            and isinstance(entry.size, torch.Size)
        ):
            return f"holds an entry that is not a tensor ({str(key)[:60]!r})"
    for index, info in (md.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        if not (
            isinstance(index, MetadataIndex)
            and isinstance(info, _StorageInfo)
            and isinstance(name, str)
            and name == Path(name).name
            and not name.startswith(".")
            and all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length))
            and not info.transform_descriptors
        ):
            return f"points outside its shard or at a transform ({str(name)[:60]!r})"
    return None


def shard_digests(shard: Path, data_files: dict[str, list[tuple[int, int]]]) -> dict[str, Any]:
    """The digests of a complete shard's files, by name in the shard: the small files whole,
    each data file as its byte ranges (`data_files`: name -> [(offset, length)], from its
    metadata) with their SHA-256s."""
    out = {name: file_record(shard / name) for name in sorted(_small_files(shard))}
    for name, ranges in sorted(data_files.items()):
        chunks = []
        with open(shard / name, "rb") as f:
            for offset, length in sorted(ranges):
                f.seek(offset)
                chunks.append([offset, length, sha256(f.read(length))])
        out[name] = {"size": (shard / name).stat().st_size, "chunks": chunks}
    return out


def _small_files(shard: Path) -> list[str]:
    return [p.name for p in shard.iterdir() if p.name == METADATA or p.suffix == ".json"]


def check_data(shard: Path, md: Any, verifier: Verifier) -> None:
    """Every tensor's bytes of a format-2 shard against the digests its save recorded (when it
    recorded them), before anything is loaded: a conversion reads each file once anyway."""
    for info in md.storage_data.values():
        rel = f"{shard.name}/{info.relative_path}"
        chunks = verifier.chunks(rel)
        if chunks is None:
            continue
        with open(shard / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if chunks.get(info.offset) != (info.length, sha256(data)):
            end = info.offset + info.length
            raise verifier.damaged(
                rel, f"does not match the digest its save recorded (bytes {info.offset}-{end})"
            )


def make_reader(shard: Path, md: Any):
    """torch's `FileSystemReader` for `shard` that takes its metadata as already read (`md`,
    from `SafeUnpickler`): the file is never unpickled by torch's plain `pickle.load`."""

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return md

    return Reader(shard)


def _where(ckpt: Path) -> Callable[[str], Callable[[str], CheckpointError]]:
    return lambda rel: lambda reason: damaged(ckpt, rel, reason)


def read_format2(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict]]:
    """A format-2 checkpoint directory whole: (its manifest, each shard's state.json, each
    shard's tensors), every file checked against its recorded digests when it has them."""
    where = _where(path)
    manifest = read_json((path / MANIFEST_NAME).read_bytes(), where(MANIFEST_NAME))
    files = manifest.get("files") if isinstance(manifest, dict) else None
    verifier = Verifier(path, files if isinstance(files, dict) else None)
    if verifier.files is None:
        print(
            f"stalepipe: warning: {path} carries no digests: converted unverified", file=sys.stderr
        )
    try:
        dirs = [f"rank_{int(r):03d}" for r in manifest["ranks"]]
    except (KeyError, TypeError, ValueError):
        raise damaged(path, MANIFEST_NAME, "names no shards") from None
    metas, shards = [], []
    for d in dirs:
        metas.append(read_json(verifier.read_small(f"{d}/state.json"), where(f"{d}/state.json")))
        rel = f"{d}/{METADATA}"
        md = load_metadata(verifier.read_small(rel), where(rel))
        _check_sizes(path / d, md, where(rel))
        want = {
            k: torch.empty(e.size, dtype=e.properties.dtype)
            for k, e in md.state_dict_metadata.items()
        }
        check_data(path / d, md, verifier)
        dcp.load(want, storage_reader=make_reader(path / d, md), no_dist=True)
        shards.append(want)
    return manifest, metas, shards


def _check_sizes(shard: Path, md: Any, where: Callable[[str], CheckpointError]) -> None:
    """Every tensor's declared size fits the bytes its storage records and every record fits
    its file, before anything is allocated (a 10^12-element claim in 4 bytes is refused)."""
    stored: dict[str, int] = {}
    for index, info in md.storage_data.items():
        f = shard / info.relative_path
        size = f.stat().st_size if f.is_file() and not f.is_symlink() else -1
        if info.offset + info.length > size:
            raise where(
                f"points at bytes {info.offset}-{info.offset + info.length} of "
                f"{info.relative_path}, which is missing, a link or shorter"
            )
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
    for key, e in md.state_dict_metadata.items():
        if math.prod(e.size) * e.properties.dtype.itemsize > stored.get(key, 0):
            raise where(f"declares {key[:60]!r} of shape {list(e.size)[:8]}, more than its bytes")


def read_format1(path: Path) -> dict[str, Any]:
    """An older version's single file `ckpt_<step>.pt` (format 1), through torch's restricted
    unpickler (`weights_only=True`)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for truncated / foreign files
        reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise CheckpointError(f"{path} is not a readable stalepipe checkpoint ({reason})") from None
    if not isinstance(state, dict) or state.get("format") != 1 or "model" not in state:
        raise CheckpointError(f"{path} is not a stalepipe checkpoint of format 1")
    return state
