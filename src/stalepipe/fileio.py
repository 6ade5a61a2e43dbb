"""Small file and dict helpers every layer uses: one atomic write, one dict flattening, one
rule for the directories stalepipe owns.

An atomic write goes to a temporary file beside the target, is fsynced, then renamed over it:
a reader sees the old file or the new one, never half of either, even after a crash or a kill.

Run and sweep directories travel (a shared scratch space, a sweep copied from a cluster), so
what one holds is not trusted (docs/failures.md, 'Sharing runs'): a write never goes through a
symbolic link at the path written (`check_writable`, `open_append`'s O_NOFOLLOW), and neither
a read nor a write goes through a link inside the directory that leads out of it (`inside`).
Text from records reaches reports as one line (`one_line`, `csv_cell`).

Owned directories (docs/design.md, 'Style', rule 13: nothing stalepipe does can destroy what it did
not make): every directory stalepipe creates for a run, a sweep, an export or prepared data carries
a marker file (`MARKER`, naming its kind). `remove_owned_dir` deletes only such a directory, and
only when it holds nothing but what stalepipe writes there; it never deletes the working directory,
the home directory or one of their parents. Files and directories follow the user's umask.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import fnmatch
import io
import json
import os
import re
import secrets
import shlex
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from stalepipe.errors import UserError

MARKER = ".stalepipe.json"  # {"owner": "stalepipe", "kind": KIND, "created": ...}
Where = str | os.PathLike | None  # the run or sweep directory a path must not lead out of


def write_atomic(
    path: str | os.PathLike, write: Callable[[BinaryIO], None], *, within: Where = None
) -> Path:
    """Write `path` atomically: `write(f)` fills a new temporary file beside it, which is
    fsynced and renamed over `path`. A symbolic link at `path` is refused (LinkError), never
    written through; `within` (the run or sweep directory `path` lies in) also refuses a link
    on the way to it that leaves that directory. The temporary file is created exclusively
    (O_EXCL | O_NOFOLLOW: never an existing file or a link an attacker planted) under an
    unguessable name matching `*.tmp*`, with the permissions `open()` gives (the umask's)."""
    path = Path(path)
    check_writable(path, within=within)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{secrets.token_hex(8)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str, *, within: Where = None) -> Path:
    """`text` into `path`, atomically (UTF-8; `within` as in `write_atomic`). Text that cannot
    be encoded (a lone surrogate: an undecodable byte of a file name) raises before anything
    is written."""
    data = text.encode()
    return write_atomic(path, lambda f: f.write(data), within=within)


def write_json_atomic(
    path: str | os.PathLike, obj: Any, *, sort_keys: bool = True, within: Where = None
) -> Path:
    """`obj` as indented JSON (one trailing newline) into `path`, atomically."""
    text = json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n"
    return write_text_atomic(path, text, within=within)


def write_files(
    directory: str | os.PathLike, files: dict[str, bytes | str], *, within: Where = None
) -> Path:
    """Every file of `files` (name -> content) into `directory`, made if absent, each
    atomically; `within` as in `write_atomic`. Everything is checked and encoded before the
    first file is written: a link refused, or text that cannot be encoded, writes nothing, so
    a report or a verdict is never left half new and half old by bad input."""
    directory = Path(directory)
    if within is not None:
        inside(within, directory)
    data = {name: c.encode() if isinstance(c, str) else c for name, c in files.items()}
    if directory.is_symlink() and not directory.is_dir():  # a dangling link, or to a file
        raise LinkError(
            f"{shown(directory)} is a symbolic link to {shown(os.readlink(directory))}, which is "
            f"not a directory; create that directory, or give another output directory"
        )
    directory.mkdir(parents=True, exist_ok=True)
    for name in data:
        check_writable(directory / name, within=within)
    for name, content in data.items():
        write_atomic(directory / name, lambda f, c=content: f.write(c), within=within)
    return directory


def csv_text(rows: Iterable[Iterable[Any]]) -> str:
    """`rows` as CSV text, every text cell through `csv_cell`, so a name from a record can
    neither start a new line nor read as a spreadsheet formula."""
    buf = io.StringIO()
    writer = csv.writer(buf)  # "\r\n", as the csv module writes (committed CSVs)
    writer.writerows([csv_cell(c) for c in row] for row in rows)
    return buf.getvalue()


def open_append(path: str | os.PathLike, *, within: Where = None, buffering: int = -1) -> TextIO:
    """`path` opened to append text (created if absent), without following a symbolic link
    (O_NOFOLLOW: a live or dangling link there is a LinkError, so a log can never grow a file
    outside its run) and only when it is a regular file; `within` as in `write_atomic`."""
    path = Path(path)
    check_writable(path, within=within)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link put there after the check
            raise LinkError(_write_link_message(path)) from None
        if e.errno != errno.ENXIO:  # ENXIO: a FIFO without a reader, refused below
            raise
        fd = -1
    if fd < 0 or not stat.S_ISREG(os.fstat(fd).st_mode):
        with contextlib.suppress(OSError):
            os.close(fd)
        raise LinkError(
            f"refusing to append to {shown(path)}: it is not a regular file; move it aside "
            f"(mv {shlex.quote(shown(path))} {shlex.quote(shown(path) + '.aside')}), then rerun"
        )
    return os.fdopen(fd, "a", buffering, encoding="utf-8", errors="backslashreplace")


# --------------------------------------------------------------------------------------------
# Links: a run or sweep directory someone else wrote is read and written without leaving it
# --------------------------------------------------------------------------------------------


class LinkError(UserError):
    """A symbolic link where a record is written (never written through), or inside a run or
    sweep directory pointing out of it (never read or written through); the message names
    the link and how to put the real file there."""


def shown(path: str | os.PathLike) -> str:
    """A path as one printable line (a name holding a newline or an undecodable byte)."""
    return one_line(os.fspath(path))


def _fix(link: Path, *, reading: bool) -> str:
    """How to put the real file (or directory) where `link` is, or to drop the link: a read
    wants the copy first, a write (a report, a log) the removal."""
    try:
        target = shlex.quote(shown(link.resolve()))
    except (OSError, RuntimeError):  # a link loop
        target = "THE_REAL_FILE"
    name = shlex.quote(shown(link))
    if link.is_dir():
        copy = f"a copy of the directory it names (rm {name} && cp -r {target} {name})"
    else:
        copy = f"a copy of the file it names (cp --remove-destination {target} {name})"
    remove = f"remove the link (rm {name})"
    return (f"replace it with {copy} or {remove}" if reading else f"{remove} or replace it "
            f"with {copy}") + ", then rerun"  # fmt: skip


def _write_link_message(path: Path) -> str:
    return (
        f"refusing to write {shown(path)}: it is a symbolic link (to {shown(os.readlink(path))}), "
        f"and stalepipe never writes through one; {_fix(path, reading=False)}"
    )


def inside(root: str | os.PathLike, path: str | os.PathLike) -> Path:
    """`path`, a path under `root` (a run or sweep directory), once no symbolic link on the
    way from `root` to it (itself included) leads outside `root`; LinkError naming the first
    that does. `root` itself may be a link (a run kept on another disk); a link that stays
    inside is fine. Call it before every read of a record a directory holds (and
    `write_atomic(within=...)` before every write), so that a directory someone else wrote
    cannot make stalepipe read or write a file of the user's."""
    root, path = Path(root), Path(path)
    real_root = root.resolve()
    step = root
    for part in path.relative_to(root).parts:
        step = step / part
        if step.is_symlink() and not _leads_into(step, real_root):
            raise LinkError(
                f"{shown(step)} is a symbolic link to {shown(os.readlink(step))}, outside "
                f"{shown(root)}, and stalepipe reads and writes nothing outside a run or sweep "
                f"directory; {_fix(step, reading=True)}"
            )
    if not _leads_into(path, real_root):  # '..' in a name
        raise LinkError(f"{shown(path)} lies outside {shown(root)}; read the file where it is")
    return path


def _leads_into(path: Path, real_root: Path) -> bool:
    """Whether `path`, its links followed, lies in `real_root` (a link loop does not)."""
    try:
        return path.resolve().is_relative_to(real_root)
    except (OSError, RuntimeError):
        return False


def check_writable(path: str | os.PathLike, *, within: Where = None) -> Path:
    """LinkError unless `path` may be written in place: not a symbolic link (live or
    dangling), and, with `within`, in a directory reached from `within` without leaving it.
    Writers call it first; a command that writes several files checks them all before the
    first is written (nothing is half-written)."""
    path = Path(path)
    if within is not None:
        inside(within, path.parent)
    if path.is_symlink():
        raise LinkError(_write_link_message(path))
    return path


def read_record(root: str | os.PathLike, path: str | os.PathLike) -> str:
    """The text of a record file under `root` (`inside`: no link out of it), UTF-8 with
    undecodable bytes replaced, so a damaged record reads as a wrong value, not a traceback."""
    return inside(root, path).read_text(encoding="utf-8", errors="replace")


def read_json_record(root: str | os.PathLike, path: str | os.PathLike) -> dict[str, Any]:
    """A record file under `root` holding one JSON object; ValueError (which readers already
    take as "unreadable") when it is not JSON or not an object (`null`, a list, a number)."""
    value = json.loads(read_record(root, path))
    if not isinstance(value, dict):
        what = "null" if value is None else f"a JSON {type(value).__name__}"
        raise ValueError(f"it holds {what}, not an object")
    return value


# --------------------------------------------------------------------------------------------
# Text from records, into files people read
# --------------------------------------------------------------------------------------------


def one_line(text: object) -> str:
    """`text` as one printable line: a line break, a control or bidi-format character and any
    other unprintable character become its backslash escape (a newline the two characters
    backslash and n), and so does an undecodable byte of a file name (a lone surrogate in
    Python), so a name from a record can neither start a new line in a report nor fail to
    encode."""
    s = str(text).encode("utf-8", "backslashreplace").decode("utf-8")
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in s)


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|nan)", re.IGNORECASE)


def csv_cell(value: Any) -> Any:
    """A CSV cell: text as `one_line`, and text a spreadsheet would run as a formula (starting
    with =, +, -, @; not a number, nor a lone '-') prefixed with a quote; other values as they
    are."""
    if not isinstance(value, str):
        return value
    text = one_line(value)
    if len(text) > 1 and text[0] in "=+-@" and not _NUMBER.fullmatch(text):
        return "'" + text
    return text


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


def make_owned_dir(path: str | os.PathLike, kind: str, *, within: Where = None) -> Path:
    """Create `path` (and its parents) as a directory of `kind` that stalepipe owns. An existing
    empty directory is adopted (marked); an existing non-empty one is left as it is (unmarked if
    it was not ours: it then can never be deleted by `remove_owned_dir`). `within`: the sweep
    directory `path` lies in, which a link at `path` must not lead out of (`inside`)."""
    path = Path(path)
    if within is not None:
        inside(within, path)
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
    within: Where = None,
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
