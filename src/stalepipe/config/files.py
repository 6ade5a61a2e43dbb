"""Config files: TOML (Python's `tomllib`) or JSON, read into an `ExperimentConfig`.

A file holds any subset of the config's sections and fields (a run's own `config.json` holds
all of them), and may start from a preset (`preset = "..."` at the top level; the file's values
over the preset's, flags over both):

    # my.toml
    preset = "cpu-small"
    name = "muon-2bw"
    [optim]
    name = "muon"
    lr = 0.01
    [delay]
    policy = "2bw"

Every way a file can be wrong ends in one `ConfigError` line naming the file and the fix,
never a traceback: a missing path, a directory, a file that is not text, a syntax error (with
its line), a top level that is not a table, an unknown or misspelt section or field, or a value
of the wrong type.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from stalepipe.config.base import DECLARED, ConfigError, declared_settings


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The table a config file holds (module docstring); ConfigError naming the fix."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {path} does not exist; pass a .toml or .json file")
    if p.is_dir():
        inside = p / "config.json"
        hint = f" (a run directory: --config {inside})" if inside.is_file() else ""
        raise ConfigError(f"config file {path} is a directory; pass a file{hint}")
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not text; pass a .toml or .json file") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror})") from None
    data = _parse(text, path, toml=p.suffix.lower() == ".toml")
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a table of sections, not a {type(data).__name__}"
        )
    return data


def file_preset(data: dict[str, Any], path: str | Path) -> str | None:
    """Take a config file's top-level `preset = "..."` out of `data`: the preset the file
    starts from, under its own values (the CLI looks the name up)."""
    name = data.pop("preset", None)
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"config file {path}: preset must be a preset's name, got {name!r}")
    return name


def over(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top`'s values over `base`'s, section by section (nested dicts merged)."""
    out = dict(base)
    for key, value in top.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = over(out[key], value) if both else value
    return out


def _parse(text: str, path: str | Path, *, toml: bool) -> Any:
    if toml:
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML ({e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = f"{e.msg}, line {e.lineno}"
        raise ConfigError(
            f"config file {path} is not valid JSON ({where}); a TOML file must end in .toml"
        ) from None


def check_types(data: dict[str, Any], root: type, source: str) -> None:
    """Unknown or misspelt sections and fields, and values of the wrong type, in a config
    table for the dataclass `root`, as one ConfigError naming `source` and the fix."""
    for key, value in data.items():
        fields = _fields(root)
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(fields)}"
            raise ConfigError(f"{source}: unknown section or field {key!r}{hint}")
        kind = fields[key]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: [{key}] must be a table of fields, not {value!r}")
            _check_section(key, value, kind, source)
        else:
            _check_value(key, value, kind, source)


def _check_section(name: str, table: dict[str, Any], kind: type, source: str) -> None:
    fields = _fields(kind)
    for key, value in table.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {name}.{close[0]}?" if close else ""
            raise ConfigError(f"{source}: {name} has no field {key!r}{hint}")
        _check_value(f"{name}.{key}", value, fields[key], source)


def _check_value(key: str, value: Any, kind: Any, source: str) -> None:
    allowed = _scalar_types(kind)
    if allowed is None:  # a structured field (tuple, dict): its own validation says more
        return
    ok = any(
        isinstance(value, t) and not (t in (int, float) and isinstance(value, bool))
        for t in allowed
    ) or (value is None and type(None) in allowed)
    if not ok:
        want = " or ".join(sorted({t.__name__ for t in allowed} - {"NoneType"}))
        raise ConfigError(f"{source}: {key} must be {want}, got {value!r}; fix it in the file")


def _scalar_types(kind: Any) -> tuple[type, ...] | None:
    """The Python types a TOML/JSON value of a field of type `kind` may have (ints stand for
    floats); None for non-scalar fields."""
    args = (
        typing.get_args(kind)
        if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union
        else (kind,)
    )
    out: list[type] = []
    for a in args:
        if a in (int, str, bool, type(None)):
            out.append(a)
        elif a is float:
            out += [float, int]
        else:
            return None
    return tuple(out)


def _fields(kind: type) -> dict[str, Any]:
    """The fields of section `kind` with their types, its declared settings among them."""
    declared = {s.name: s.type for s in declared_settings(kind).values()}
    return {**_own_fields(kind), **declared}


@functools.cache
def _own_fields(kind: type) -> dict[str, Any]:
    hints = typing.get_type_hints(kind)
    return {
        f.name: hints[f.name] for f in dataclasses.fields(kind) if f.init and f.name != DECLARED
    }


def value_sources(
    cfg: Any, *, preset: str | None, file_data: dict[str, Any] | None, overrides: dict[str, str]
) -> list[tuple[str, Any, str]]:
    """(dotted key, value, where it came from) for every field of the resolved `cfg`: 'flag'
    (a --section.field override), 'file' (the --config file sets it), 'preset' (the preset
    differs from the default there), or 'default'."""
    from stalepipe.config.experiment import ExperimentConfig
    from stalepipe.fileio import flatten_dict

    final = flatten_dict(cfg.to_dict())
    default = flatten_dict(ExperimentConfig().to_dict())
    in_file = set(flatten_dict(file_data)) if file_data else set()
    out = []
    for key, value in final.items():
        if key in overrides:
            where = "flag"
        elif key in in_file:
            where = "file"
        elif preset and value != default.get(key):
            where = f"preset {preset}"
        else:
            where = "default"
        out.append((key, value, where))
    return out
