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


# The extras of pyproject.toml that bring the optional packages, by what needs them.
EXTRAS = {
    "matplotlib": "plots",
    "submitit": "slurm",
    "tiktoken": "tokenizers",
    "tokenizers": "tokenizers",
    "pyarrow": "data",
    "transformers": "hf",
}


def require(module: str, what: str) -> Any:
    """`module` imported, for `what` (a command or a setting); when it is not installed, a
    UserError in one line naming the extra that brings it (`pip install 'stalepipe[EXTRA]'`)."""
    from stalepipe.errors import UserError

    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        raise UserError(
            f"{what} needs the {top} package, which is not installed; run "
            f"`pip install 'stalepipe[{EXTRAS[top]}]'`"
        ) from None
