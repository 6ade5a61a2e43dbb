"""Small file and dict helpers every layer uses: one atomic write, one dict flattening, one
rule for the directories stalepipe owns.

An atomic write goes to a temporary file beside the target, is fsynced, then renamed over it:
a reader sees the old file or the new one, never half of either, even after a crash or a kill.

Owned directories (docs/design.md, 'Style', rule 13: nothing stalepipe does can destroy what it did
not make): every directory stalepipe creates for a run, a sweep, an export or prepared data carries
a marker file (`MARKER`, naming its kind). `remove_owned_dir` deletes only such a directory, and
only when it holds nothing but what stalepipe writes there; it never deletes the working directory,
the home directory or one of their parents. Files and directories follow the user's umask.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

from stalepipe.errors import UserError

MARKER = ".stalepipe.json"  # {"owner": "stalepipe", "kind": KIND, "created": ...}


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Write `path` atomically: `write(f)` fills a temporary file, which is fsynced and renamed
    over `path`. The temporary name carries the pid, so concurrent writers never share it."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """`text` into `path`, atomically (UTF-8)."""
    return write_atomic(path, lambda f: f.write(text.encode()))


def write_json_atomic(path: str | os.PathLike, obj: Any, *, sort_keys: bool = True) -> Path:
    """`obj` as indented JSON (one trailing newline) into `path`, atomically."""
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


def torch_save_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """`torch.save(obj)` into `path`, atomically."""
    import torch  # here: the rest of this module must stay cheap to import (the CLI's --help)

    return write_atomic(path, lambda f: torch.save(obj, f))


def flatten_dict(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts to one level with dotted keys: {"a": {"b": 1}} -> {"a.b": 1} (the form of
    CLI overrides, sweep axes and report columns)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten_dict(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# --------------------------------------------------------------------------------------------
# Permissions
# --------------------------------------------------------------------------------------------


def current_umask() -> int:
    """The process's umask (read by setting and restoring it: there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str | os.PathLike) -> Path:
    """Give a file written by a library that ignores the umask (safetensors writes 0600) the
    permissions `open()` would have given it: 0666 minus the umask."""
    os.chmod(path, 0o666 & ~current_umask())
    return Path(path)


def make_temp_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A new uniquely named directory in `parent` (a staging directory to be renamed into
    place), with the permissions a plain `mkdir` gives (0777 minus the umask), not the 0700 of
    `tempfile.mkdtemp`: renamed into place, it must be as readable as any other directory."""
    path = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
    os.chmod(path, 0o777 & ~current_umask())
    return path


# --------------------------------------------------------------------------------------------
# Directories stalepipe owns
# --------------------------------------------------------------------------------------------


class NotOwnedError(UserError):
    """A directory stalepipe refuses to delete; the message names why and what to do."""


def mark_owned(directory: str | os.PathLike, kind: str) -> None:
    """Write the marker that makes `directory` one stalepipe owns (`kind`: run, sweep, export,
    data). Only call it on a directory stalepipe just created (or found empty)."""
    info = {"owner": "stalepipe", "kind": kind, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json_atomic(Path(directory) / MARKER, info)


def owned_kind(directory: str | os.PathLike) -> str | None:
    """The kind in `directory`'s marker, or None when it has no (readable) marker."""
    try:
        info = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("owner") != "stalepipe":
        return None
    kind = info.get("kind")
    return kind if isinstance(kind, str) else None


def make_owned_dir(path: str | os.PathLike, kind: str) -> Path:
    """Create `path` (and its parents) as a directory of `kind` that stalepipe owns. An existing
    empty directory is adopted (marked); an existing non-empty one is left as it is (unmarked if
    it was not ours: it then can never be deleted by `remove_owned_dir`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if not any(path.iterdir()):
        mark_owned(path, kind)
    return path


def _protected() -> list[Path]:
    """Directories that are never deleted, nor any of their parents."""
    out = []
    with contextlib.suppress(OSError):  # a working directory deleted under us
        out.append(Path.cwd().resolve())
    with contextlib.suppress(RuntimeError, OSError):  # no home directory (some containers)
        out.append(Path.home().resolve())
    return out


def refuse_protected(path: str | os.PathLike, *, fix: str) -> None:
    """NotOwnedError if `path` is the working directory, the home directory or a parent of
    either: stalepipe never deletes or replaces those, even empty ones."""
    real = Path(os.path.abspath(path)).resolve()
    for keep in _protected():
        if keep == real or keep.is_relative_to(real):
            raise NotOwnedError(
                f"refusing to delete {path}: it is {keep} or one of its parents; {fix}"
            )


def check_removable(
    path: str | os.PathLike,
    kind: str,
    allowed: Iterable[str],
    *,
    within: str | os.PathLike | None = None,
    fix: str,
) -> Path:
    """Raise NotOwnedError unless `remove_owned_dir` may delete `path`; return it resolved.

    Deletable: a real directory (not a symbolic link), not the working or home directory nor
    a parent of either, strictly inside `within` when given, carrying stalepipe's marker for
    `kind`, and holding only top-level entries that match a glob in `allowed` (what stalepipe
    writes into such a directory). `fix` ends every message: what the user can do instead
    (e.g. "delete it yourself or choose another --name").
    """
    target = Path(os.path.abspath(path))  # lexical: runs/.. is the working directory
    if target.is_symlink():
        raise NotOwnedError(f"refusing to delete {path}: it is a symbolic link; {fix}")
    if not target.is_dir():
        raise NotOwnedError(f"refusing to delete {path}: it is not a directory; {fix}")
    refuse_protected(path, fix=fix)
    real = target.resolve()
    if within is not None:
        parent = Path(within).resolve()
        if real == parent or not real.is_relative_to(parent):
            raise NotOwnedError(f"refusing to delete {path}: it is not inside {within}; {fix}")
    have = owned_kind(real)
    if have is None:
        raise NotOwnedError(
            f"refusing to delete {path}: it has no {MARKER} marker (not made by stalepipe, or by "
            f"an older version); delete it by hand if it is yours, or {fix}"
        )
    if have != kind:
        raise NotOwnedError(
            f"refusing to delete {path}: it is a stalepipe {have} directory, not a {kind} "
            f"directory; {fix}"
        )
    patterns = [MARKER, *allowed]
    for entry in sorted(p.name for p in real.iterdir()):
        if not any(fnmatch.fnmatchcase(entry, pat) for pat in patterns):
            raise NotOwnedError(
                f"refusing to delete {path}: it holds {entry!r}, which stalepipe does not write "
                f"there; move it out or delete the directory by hand, or {fix}"
            )
    return real


def remove_owned_dir(
    path: str | os.PathLike, kind: str, allowed: Iterable[str], **rule: Any
) -> None:
    """Delete `path` if `check_removable(path, kind, allowed, **rule)` allows it (`rule`: its
    `within` and `fix`; NotOwnedError otherwise, nothing deleted).

    The directory is first renamed to a hidden sibling, so a crash halfway through the deletion
    never leaves a half-deleted directory under the original name."""
    real = check_removable(path, kind, allowed, **rule)
    doomed = real.with_name(f".{real.name}.deleting-{os.getpid()}-{time.monotonic_ns()}")
    os.replace(real, doomed)
    shutil.rmtree(doomed)
