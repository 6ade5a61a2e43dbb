"""Wall time, run counts and machine load of the studies in a sweep directory, from its records.

A study swept into one directory over several days and machines leaves only its run records
(`meta.json`, `metrics.jsonl`; checkpoints are not committed). This groups the finished runs by
the command that started them (`meta.json`'s first invocation) and prints, per command: the
runs, the first and last start, the wall span (first start to the last run's start plus its
training time), the median training time of one run (the loop's own clock, evaluations left
out, one thread), the commits, and the 1-minute load average at the runs' starts where the
records have it (stalepipe records it since 2026-12-03; older records show "-").

    python benchmarks/studies/study_walltime.py docs/results/optimizers-regime
    python benchmarks/studies/study_walltime.py docs/results/optimizers-regime --since 2026-12-03
    python benchmarks/studies/study_walltime.py docs/results/optimizers-regime --by-study

`--by-study` adds the commands of one study up (`stalepipe sweep STUDY ...` whatever its
flags; an ad-hoc `--grid` sweep and each script count as one study): runs, the sum of the
commands' spans, the median run. A span is an upper bound on the command's cost: a command
that was stopped and resumed later counts the pause too, unless no run of it started for
`GAP` (30 minutes) after the previous one ended: then the runs after the pause count as a
separate invocation of the command (the same command run again a day later).
"""

from __future__ import annotations

import math
import statistics
import sys
from datetime import datetime, timedelta
from pathlib import Path

from stalepipe.errors import UserError
from stalepipe.training.rundir.directory import invocations, read_meta
from stalepipe.training.rundir.metrics import read_metrics
from stalepipe.training.rundir.status import run_status

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import parser
from benchmarks.studies.regime_probe import train_seconds


def _command(argv: list[str], cwd: str) -> str:
    """The command without its program's directory (`stalepipe sweep ...`, `regime_probe.py
    ...`) and without the directory it ran in or this one (a sweep directory given as an
    absolute path: a clean checkout elsewhere may have run it on this checkout's records)."""
    prefixes = {d.rstrip("/") + "/" for d in (cwd, str(Path.cwd())) if d}
    args = argv[1:]
    for prefix in prefixes:
        args = [a.replace(prefix, "") for a in args]
    return " ".join([Path(argv[0]).name, *args])


def run_records(root: Path, since: str = "") -> list[dict]:
    """One record per finished run under `root`: command, start, training seconds, commit."""
    out = []
    for d in sorted(p for p in root.iterdir() if (p / "meta.json").is_file()):
        if run_status(d) != "finished":
            continue
        first = invocations(read_meta(d))[0]
        if first.get("started", "") < since:
            continue
        load = first.get("load_avg")
        out.append({
            "command": _command(first.get("argv", ["?"]), first.get("cwd", "")),
            "started": datetime.strptime(first["started"], "%Y-%m-%dT%H:%M:%S%z"),
            "seconds": train_seconds(d, read_metrics(d)),
            "commit": str(first.get("git_commit", "?"))[:7],
            "load": load[0] if load else None,
        })  # fmt: skip
    return out


def study_of(command: str) -> str:
    """`stalepipe sweep STUDY` for a study's sweep, `stalepipe sweep --grid` for an ad-hoc
    one, the script's name otherwise."""
    words = command.split()
    if words[:2] != ["stalepipe", "sweep"]:
        return words[0]
    named = len(words) > 2 and not words[2].startswith("-")
    return " ".join(words[:3]) if named else "stalepipe sweep --grid"


def _end(run: dict) -> datetime:
    """A run's start plus its training time (its start alone without tokens_per_s)."""
    secs = run["seconds"] if math.isfinite(run["seconds"]) else 0.0
    return run["started"] + timedelta(seconds=secs)


def _span(runs: list[dict]) -> timedelta:
    """First start to the last end."""
    return max(map(_end, runs)) - runs[0]["started"]


def _load(runs: list[dict]) -> str:
    loads = [r["load"] for r in runs if r["load"] is not None]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"


def _median_seconds(runs: list[dict]) -> float:
    secs = [r["seconds"] for r in runs if math.isfinite(r["seconds"])]
    return statistics.median(secs) if secs else math.nan


GAP = timedelta(minutes=30)


def _grouped(records: list[dict], key) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in sorted(records, key=lambda r: r["started"]):
        groups.setdefault(key(r), []).append(r)
    return groups


def _invocations(runs: list[dict]) -> list[list[dict]]:
    """A command's runs (by start) split where none started for GAP after the last ended."""
    out: list[list[dict]] = []
    end = None
    for r in runs:
        if end is None or r["started"] - end > GAP:
            out.append([])
        out[-1].append(r)
        end = max(end, _end(r)) if end else _end(r)
    return out


def table(records: list[dict]) -> str:
    """The markdown table: one row per command, in order of its first run's start."""
    lines = [
        "| command | runs | first start | last start | wall span | median run s | commits "
        "| load at starts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    invocations = [
        (command, runs)
        for command, all_runs in _grouped(records, lambda r: r["command"]).items()
        for runs in _invocations(all_runs)
    ]
    for command, runs in sorted(invocations, key=lambda c: c[1][0]["started"]):
        commits = ", ".join(sorted({r["commit"] for r in runs}))
        lines.append(
            f"| `{command}` | {len(runs)} | {runs[0]['started']:%Y-%m-%d %H:%M} "
            f"| {runs[-1]['started']:%m-%d %H:%M} | {_span(runs).total_seconds() / 60:.0f} min "
            f"| {_median_seconds(runs):.0f} | {commits} | {_load(runs)} |"
        )
    return "\n".join(lines)


def study_table(records: list[dict]) -> str:
    """One row per study: its commands' spans added up (overlapping commands count twice)."""
    lines = [
        "| study | invocations | runs | first start | wall time (sum of spans) | median run s "
        "| load at starts |",
        "|---|---|---|---|---|---|---|",
    ]
    for study, runs in _grouped(records, lambda r: study_of(r["command"])).items():
        commands = _grouped(runs, lambda r: r["command"])
        parts = [part for c in commands.values() for part in _invocations(c)]
        wall = sum((_span(part) for part in parts), timedelta())
        lines.append(
            f"| `{study}` | {len(parts)} | {len(runs)} | {runs[0]['started']:%Y-%m-%d %H:%M} "
            f"| {wall.total_seconds() / 3600:.1f} h | {_median_seconds(runs):.0f} "
            f"| {_load(runs)} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("runs", type=Path, help="a sweep directory")
    p.add_argument("--since", default="", help="only runs started at or after this ISO time")
    p.add_argument("--by-study", action="store_true", help="one row per study, not per command")
    args = p.parse_args()
    if not args.runs.is_dir():
        p.error(f"{args.runs} is not a directory; pass a sweep directory (stalepipe sweep --out)")
    if args.since:
        try:
            datetime.fromisoformat(args.since)
        except ValueError:
            p.error(f"--since {args.since!r} is not an ISO date or time; e.g. --since 2026-12-03")
    try:
        records = run_records(args.runs, args.since)
    except UserError as e:  # a corrupt meta.json: the message names the fix
        p.error(str(e))
    if not records:
        p.error(f"no finished runs with a meta.json under {args.runs}")
    print(study_table(records) if args.by_study else table(records))


if __name__ == "__main__":
    main()
