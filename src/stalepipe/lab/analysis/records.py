"""What in a run's records a report can use: a sweep.json's group and seed, the numbers of
metrics.jsonl. Records travel (docs/failures.md, 'Sharing runs'), so a value of the wrong type
is named in a warning line and its run left out or relabelled, never a traceback halfway
through a report (`results.load_runs` asks these)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from stalepipe.fileio import inside, one_line, read_json_record, shown
from stalepipe.training.rundir.status import SPEC_FILE


def read_spec(root: Path, d: Path) -> dict[str, Any]:
    """A run's sweep.json: its group (a string) and seed (an integer); {} with a warning when
    it is not such an object (the run is then labelled by its config)."""
    path = inside(root, d / SPEC_FILE)
    if not path.exists():
        return {}
    try:
        spec = read_json_record(root, path)
    except ValueError as e:
        warn(
            f"{shown(path)} is unreadable ({one_line(e)}); run {one_line(d.name)} is labelled "
            "by its config (rewrite the file by rerunning the sweep, or delete it)"
        )
        return {}
    if not isinstance(spec.get("group", ""), str) or not _is_int(spec.get("seed", 0)):
        warn(
            f"{shown(path)}: its group is not a string or its seed not an integer; run "
            f"{one_line(d.name)} is labelled by its config (rewrite the file, or delete it)"
        )
        return {}
    return spec


def _is_int(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def seed_or_none(value: Any) -> int | None:
    """A run's seed when it is an integer; None otherwise (the run then pairs with no seed)."""
    return value if _is_int(value) else None


def wrong_value(records: list[dict[str, Any]]) -> str:
    """What makes a run's metrics unusable ('' when nothing): a step that is not an integer,
    a loss or val_loss that is not a number."""
    for r in records:
        if r.get("step") is None or not _is_int(r["step"]):
            return f"a line's step is {one_line(repr(r.get('step')))[:40]}, not an integer"
        for key in ("loss", "val_loss"):
            if key in r and not _is_number(r[key]):
                value = one_line(repr(r[key]))[:40]
                return f"the line of step {r['step']} has {key} {value}, not a number"
    return ""


def warn(text: str) -> None:
    """A warning line on stderr (the report still goes on)."""
    print(f"stalepipe: warning: {text}", file=sys.stderr)
