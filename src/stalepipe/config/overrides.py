"""Dotted-key overrides (`--optim.lr 3e-4`) and dict round trips for a tree of frozen dataclasses.

Generic over the root class (`ExperimentConfig` in practice): a leaf is addressed as
'section.field', its string is parsed into the field's annotated type, and an unknown key gets
the closest known one as a hint. The settings registered components declare for a section
(`base.Setting`: an optimizer's own hyperparameters, a corrector's) are leaves beside the
section's own fields: `section.setting` in overrides, in dicts and in help.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import types
import typing
from typing import Any, NamedTuple, TypeVar

from stalepipe.config.base import DECLARED, ConfigError, declared_settings

T = TypeVar("T")

# Keys renamed so that counts read `num_*` (docs/design.md, 'Style', rule 10): old run records
# still load (their keys are translated), a command line or a new config file with an old key
# gets a one-line hint.
RENAMED_KEYS = {
    "train.steps": "train.num_steps",
    "train.eval_batches": "train.num_eval_batches",
    "pipeline.data_parallel": "pipeline.num_replicas",
}


def upgrade_record(d: dict[str, Any]) -> dict[str, Any]:
    """A parsed config.json (nested dicts) with the keys of `RENAMED_KEYS` under their new
    names: what every reader of a saved run record calls before using it."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    for old, new in RENAMED_KEYS.items():
        (section, key), (_, new_key) = old.split("."), new.split(".")
        block = out.get(section)
        if isinstance(block, dict) and key in block:
            block.setdefault(new_key, block.pop(key))
    return out


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """`cls`'s resolved annotations, once per class: a class's annotations do not change, and
    resolving them was most of the time of expanding a study's grid (every override parsed)."""
    return typing.get_type_hints(cls)


def from_dict(
    cls: type, d: dict[str, Any], *, prefix: str = "", root: type | None = None, **init: Any
) -> Any:
    """Build dataclass `cls` from nested dicts (a parsed config.json); an unknown key is a
    ConfigError that suggests the closest key of `root` (the top-level class, default `cls`).
    `init` goes to `cls` alone (its init-only arguments, e.g. `check_ignored`)."""
    root = root or cls
    hints = _hints(cls)
    kwargs = {}
    names = {f.name for f in dataclasses.fields(cls)} - {DECLARED} | set(declared_settings(cls))
    for key, value in d.items():
        if key not in names:
            raise ConfigError(_unknown_key_msg(prefix + key, _all_keys(root)))
        if key in hints and dataclasses.is_dataclass(hints[key]):
            kwargs[key] = from_dict(hints[key], value, prefix=prefix + key + ".", root=root)
        else:
            kwargs[key] = value
    return cls(**kwargs, **init)


def as_dict(cfg: Any) -> dict[str, Any]:
    """A config tree as nested dicts (what config.json holds): `dataclasses.asdict`, with each
    section's declared settings flat beside its own fields, every registered one at its value."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == DECLARED:
            out.update({name: getattr(cfg, name) for name in declared_settings(type(cfg))})
            out.update(value)  # a setting whose component is no longer registered, too
        elif dataclasses.is_dataclass(value):
            out[f.name] = as_dict(value)
        else:
            out[f.name] = copy.deepcopy(value)
    return out


# --------------------------------------------------------------------------------------------


class Leaf(NamedTuple):
    """One leaf of a config tree: its annotated type, its default, its help (a text, or a
    callable asked when shown)."""

    type: Any
    default: Any
    help: Any


def _all_keys(cls: type, prefix: str = "") -> dict[str, Leaf]:
    """Flat map 'section.field' -> Leaf for every leaf field and declared setting."""
    hints = _hints(cls)
    out: dict[str, Leaf] = {}
    for f in dataclasses.fields(cls):
        if f.name == DECLARED:
            for s in declared_settings(cls).values():
                out[prefix + s.name] = Leaf(s.type, s.default, s.help)
        elif dataclasses.is_dataclass(hints[f.name]):
            out.update(_all_keys(hints[f.name], prefix + f.name + "."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out[prefix + f.name] = Leaf(hints[f.name], default, f.metadata.get("help", ""))
    return out


def default_of(root: type, dotted: str) -> Any:
    """The default value of the leaf field 'section.field' of `root`."""
    return _all_keys(root)[dotted].default


def _unknown_key_msg(key: str, keys: dict[str, Any]) -> str:
    if key in RENAMED_KEYS:
        return f"config key --{key} is now --{RENAMED_KEYS[key]}; use that name"
    close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.5)
    hint = f"; did you mean --{close[0]}?" if close else "; see `stalepipe train --help`"
    return f"unknown config key --{key}{hint}"


def parse_value(text: str, tp: Any, key: str) -> Any:
    """Parse a CLI string into the field's annotated type (handles `X | None`)."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        if text.lower() in ("none", "null"):
            return None
        tp = next(a for a in args if a is not type(None))
    try:
        if tp is bool:
            low = text.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
        if tp is str:
            return text
    except ValueError:
        pass
    else:
        raise AssertionError(f"unsupported field type {tp} for {key}")
    raise ConfigError(f"--{key} expects a {tp.__name__}, got {text!r}")


def parse_field(root: type, key: str, text: str) -> Any:
    """`text` as the dotted field `key` of the config class `root` holds it (typed, not yet
    validated against the other fields); ConfigError for an unknown key or a bad value."""
    keys = _all_keys(root)
    if key not in keys:
        raise ConfigError(_unknown_key_msg(key, keys))
    return parse_value(text, keys[key].type, key)


def apply_overrides(cfg: T, overrides: dict[str, str], **init: Any) -> T:
    """Return `cfg` with dotted-key string overrides applied (validated, typed); `init` goes to
    the root class (its init-only arguments, e.g. `check_ignored`)."""
    root = type(cfg)
    nested: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, text in overrides.items():
        value = parse_field(root, key, text)
        if "." in key:
            section, leaf = key.split(".", 1)
            nested.setdefault(section, {})[leaf] = value
        else:
            top[key] = value
    changes = {s: dataclasses.replace(getattr(cfg, s), **v) for s, v in nested.items()}
    return dataclasses.replace(cfg, **changes, **top, **init)


def config_help(root: type) -> str:
    """Every overridable key of `root` with its type, default and help text, by section."""
    lines = []
    section = None
    default_cfg = root()
    for key, leaf in _all_keys(root).items():
        sec = key.split(".")[0] if "." in key else ""
        if sec != section:
            section = sec
            lines.append(f"\n[{sec or 'run'}]")
        obj = default_cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        tp = leaf.type
        tname = getattr(tp, "__name__", str(tp)).replace("NoneType", "None")
        if isinstance(tp, types.UnionType):
            tname = " | ".join(a.__name__ for a in typing.get_args(tp)).replace("NoneType", "None")
        text = leaf.help() if callable(leaf.help) else leaf.help
        lines.append(f"  --{key:<26} {tname:<12} default {obj!r}: {text}")
    return "\n".join(lines)
