"""Names of a package loaded on first use (PEP 562), so that importing the package (as the
registries do, and every `--help`) does not import torch through it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `names[name]` (a module path) on first use."""

    def getattr_(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(names[name]), name)

    return getattr_
