"""What every command module of the CLI shares."""

from __future__ import annotations

import argparse

Subparsers = argparse._SubParsersAction


def flags(args: argparse.Namespace) -> dict[str, object]:
    """The command's flags as keywords, for a command whose `*_main` takes exactly its flags."""
    return {k: v for k, v in vars(args).items() if k not in ("command", "data_command", "fn")}
