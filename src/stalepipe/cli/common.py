"""What every command module of the CLI shares."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

Subparsers = argparse._SubParsersAction


def flags(args: argparse.Namespace) -> dict[str, object]:
    """The command's flags as keywords, for a command whose `*_main` takes exactly its flags."""
    return {k: v for k, v in vars(args).items() if k not in ("command", "data_command", "fn")}


Command = Callable[[argparse.Namespace, list[str]], int]


def runs(target: str, *, prints: bool = True) -> Command:
    """The command that calls `target` ("module:function", imported only when the command runs,
    so `--help` stays fast) with the command's flags as keywords, and prints what it returns
    unless `prints` is false (a function that reports as it goes)."""
    module, _, name = target.partition(":")

    def command(args: argparse.Namespace, extra: list[str]) -> int:
        result = getattr(importlib.import_module(module), name)(**flags(args))
        if prints:
            print(result)
        return 0

    command.__name__ = command.__qualname__ = f"run {target}"
    return command
