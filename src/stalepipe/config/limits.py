"""The limits every config value passes whatever its section: a run name that is one safe
directory name, finite floats, and counts no run reaches.

A config is the first thing stalepipe reads from a user, a config file or a shared run record,
and what it accepts ends up in directory names, the commands stalepipe prints, reports and the
sizes it allocates. These rules are checked once, for the whole config (`ExperimentConfig`),
before anything is made: a section's own range (`optim.lr > 0`) says what makes sense, these
say what is safe to handle at all.
"""

from __future__ import annotations

import math
import re
from typing import Any

from stalepipe.config.base import ConfigError

MAX_NAME = 128  # characters of a run name (a derived sibling adds ~40; file systems take 255)
NAME_CHARS = "letters, digits and . _ - + ="
_NAME = re.compile(r"[A-Za-z0-9._+=-]+")
_NOT_NAME = re.compile(r"[^A-Za-z0-9._+=-]+")
# An int field's largest value: sizes and counts that torch indexes in 32 bits in places, and far
# past any run's. Seeds, which torch and numpy take as 64-bit, have their own bound.
MAX_INT = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_STEPS = 10**9  # 10 ms a step: four months; more is a typo (train.num_steps)


def check_name(name: str) -> None:
    """ConfigError unless `name` is one directory name of at most MAX_NAME characters of
    NAME_CHARS, not '.' or '..'. A newline, a control character or an undecodable byte (which
    Python hands over as a lone surrogate) in a run's name would break every command stalepipe
    prints about the run and the reports that list it; a long one the temporary and deleted
    siblings stalepipe names after it. The message suggests a name that passes."""
    if _NAME.fullmatch(name) and len(name) <= MAX_NAME and name not in (".", ".."):
        return
    fix = _NOT_NAME.sub("-", name).strip("-.")[:MAX_NAME].strip("-.") or "run"
    shown = repr(name) if len(name) <= 60 else f"{name[:40]!r}... ({len(name)} characters)"
    raise ConfigError(
        f"name must be one directory name of 1 to {MAX_NAME} characters, each one of "
        f"{NAME_CHARS} (not '.' or '..'), got {shown}; set name to {fix!r}"
    )


def check_numbers(flat: dict[str, Any], default_of: Any) -> None:
    """ConfigError for the first value of `flat` ('section.field' -> value) that is a
    non-finite float or an int past MAX_INT (a seed: past MAX_SEED): what no section's range
    would let through on its own (`inf > 0`), named with a value that passes (the field's
    default, `default_of(key)`)."""
    for key, value in flat.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            default = default_of(key)
            shown = "none (the component's own default)" if default is None else repr(default)
            raise ConfigError(
                f"{key} must be a finite number, got {value}; set it to a finite value, e.g. "
                f"its default {shown}"
            )
        bound = MAX_SEED if key.endswith("seed") else MAX_INT
        if isinstance(value, int) and abs(value) > bound:
            raise ConfigError(
                f"{key} must be at most {bound:,} in size, got {value:,}; set it to a value "
                f"a run can reach (its default is {default_of(key)!r})"
            )
