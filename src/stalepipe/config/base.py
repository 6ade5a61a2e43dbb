"""The pieces every config section uses: the error type, a field with help text, one check."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import field
from typing import Any

from stalepipe.errors import UserError


class ConfigError(UserError, ValueError):
    """A bad configuration value; the message names the field and what it accepts."""


def option(default: Any, help: str | Callable[[], str]) -> Any:
    """A dataclass field with its one-line help (shown by `stalepipe train --help`); a callable
    help is asked when shown (a text that lists a registry, which fills after this module)."""
    return field(default=default, metadata={"help": help})


def check(cond: bool, msg: str) -> None:
    """Raise ConfigError(msg) unless cond."""
    if not cond:
        raise ConfigError(msg)


def multiples_near(n: int, d: int) -> str:
    """The multiples of `d` next to `n` (>= 1), as 'a or b', for a divisibility fix."""
    below = n // d * d
    return f"{below} or {below + d}" if below else str(d)


def unknown_choice(
    what: str, name: str, choices: Iterable[str], key: str | None = None
) -> ConfigError:
    """The error for a name missing from a registry: lists the choices, suggests the closest.

    'unknown {what} {name!r}', or 'unknown {what} {key}={name!r}' when `key` is the config
    field the name came from.
    """
    choices = list(choices)
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.4)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    given = f"{key}={name!r}" if key else repr(name)
    return ConfigError(f"unknown {what} {given} (choose from {', '.join(choices)}){hint}")


# --------------------------------------------------------------------------------------------
