"""The pieces every config section uses: the error type, a field with help text, one check,
and the settings a registered component declares for a section (`Setting`)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
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


# ---- settings a registered component declares ------------------------------------------------

DECLARED = "declared"  # the field of a section that holds its components' settings


@dataclass(frozen=True, kw_only=True)
class Setting:
    """A config field that a registered component declares for a section instead of the
    section listing it: an optimizer's own hyperparameter in `optim` (`OptimizerSpec.settings`),
    a corrector's in `delay` (`CorrectorSpec.settings`). The command line (`--optim.ns_steps`),
    config files, config.json and `--help` show it like the section's own fields
    (`declares_settings`). `type` is its annotation (`int | None`); `ok` its range, which a
    None value (the component's own default) always passes; `allowed` that range in words."""

    name: str
    type: Any
    default: Any
    help: str
    ok: Callable[[Any], bool] | None = None
    allowed: str = ""

    def check(self, section: str, value: Any) -> None:
        """ConfigError '<section>.<name> must be <allowed>, got <value>' for a value out of
        range."""
        if value is None or self.ok is None or self.ok(value):
            return
        got = repr(value) if isinstance(value, str) else value
        raise ConfigError(f"{section}.{self.name} must be {self.allowed}, got {got}")


def declares_settings(
    section: str, settings: Callable[[], dict[str, Setting]]
) -> Callable[[type], type]:
    """Class decorator (above `@dataclass`) of a section that holds the settings its registered
    components declare: `settings()` by name, asked each time (a component registered later
    brings its own). The dataclass has a field `declared`: the (name, value) pairs that differ
    from their defaults, sorted, so equal configs are equal. A setting is read as an attribute
    (`cfg.ns_steps`: its default when unset), given by keyword (`OptimConfig(name="muon",
    ns_steps=3)`, `dataclasses.replace`) and range-checked then (`Setting.check`, before the
    section's `__post_init__`); config/overrides.py puts it beside the section's own fields."""

    def wrap(cls: type) -> type:
        init = cls.__init__
        own = {f.name for f in dataclasses.fields(cls)}
        assert DECLARED in own, f"{cls.__name__} needs a field {DECLARED!r}"

        def known() -> dict[str, Setting]:
            out = settings()
            assert not set(out) & own, f"settings shadow {section} fields: {set(out) & own}"
            return out

        @functools.wraps(init)
        def __init__(self: Any, **kwargs: Any) -> None:
            values = dict(kwargs.pop(DECLARED, ()))
            values.update({k: kwargs.pop(k) for k in list(kwargs) if k not in own})
            declared = known()
            for name, value in values.items():
                if name not in declared:
                    raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}")
                declared[name].check(section, value)
            pairs = sorted((k, v) for k, v in values.items() if v != declared[k].default)
            init(self, **{DECLARED: tuple(pairs)}, **kwargs)

        def __getattr__(self: Any, name: str) -> Any:  # only for names that are no attribute
            if not name.startswith("__") and DECLARED in self.__dict__:
                for k, v in self.__dict__[DECLARED]:
                    if k == name:
                        return v
                if name in known():
                    return known()[name].default
            raise AttributeError(f"{cls.__name__!r} object has no attribute {name!r}")

        cls.__init__ = __init__  # type: ignore[misc]
        cls.__getattr__ = __getattr__  # type: ignore[attr-defined]
        cls.declared_settings = staticmethod(known)  # type: ignore[attr-defined]
        return cls

    return wrap


def declared_settings(cls: type) -> dict[str, Setting]:
    """The settings the components registered for section `cls` declare ({} for a section
    without `declares_settings`)."""
    settings = getattr(cls, "declared_settings", None)
    return settings() if settings is not None else {}
