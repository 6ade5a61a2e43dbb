"""Small file and dict helpers every layer uses: one atomic write, one dict flattening.

An atomic write goes to a temporary file beside the target, is fsynced, then renamed over it:
a reader sees the old file or the new one, never half of either, even after a crash or a kill.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch


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
