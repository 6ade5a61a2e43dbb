"""Rewrite run records' meta.json so they name no machine's paths (run it before committing
records made by stalepipe older than this script's commit, which wrote absolute paths).

    python benchmarks/records/portable_meta.py docs/results          # rewrite in place
    python benchmarks/records/portable_meta.py docs/results --check  # exit 1 if a record has one

`cwd` and `data_dir` become relative to the run directory (as `rundir.directory` now writes
them; a `cwd` outside the run's checkout, a temporary one, becomes null), `run_dir` is dropped (it is the directory the file is in), and the command line names
its program without a directory, with absolute paths inside the old working directory made
relative to it. The run's config.json gets the same treatment for `out_dir` (older records
wrote it absolute): it becomes the path from the checkout's docs/results/ on, as later
records spell it. Idempotent; other fields are untouched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _portable(record: dict, run_dir: str | None) -> dict:
    out = dict(record)
    base = out.pop("run_dir", None) or run_dir
    cwd = out.get("cwd")
    if base and isinstance(cwd, str) and os.path.isabs(cwd):
        # a working directory outside the run's checkout is another machine's temporary one
        inside = (cwd + "/").startswith(base.partition("/docs/results/")[0] + "/")
        out["cwd"] = os.path.relpath(cwd, base) if inside else None
    if base and isinstance(out.get("data_dir"), str) and os.path.isabs(out["data_dir"]):
        out["data_dir"] = os.path.relpath(out["data_dir"], base)
    argv = out.get("argv")
    if isinstance(argv, list) and argv:
        # absolute arguments inside the old working directory or the run's checkout (the part
        # of its path before docs/results/) become relative to it
        roots = [d.rstrip("/") + "/" for d in (cwd, (base or "").partition("/docs/results/")[0])
                 if isinstance(d, str) and os.path.isabs(d)]  # fmt: skip
        out["argv"] = [Path(argv[0]).name, *(_strip(a, roots) for a in argv[1:])]
    return out


def _strip(arg: str, roots: list[str]) -> str:
    for root in roots:
        if arg.startswith(root):
            return arg[len(root) :]
    return arg


def portable_meta(meta: dict) -> dict:
    """meta.json with every invocation (and the top-level copy of the first) made portable."""
    run_dir = meta.get("run_dir")
    out = _portable(meta, run_dir)
    if isinstance(meta.get("invocations"), list):
        out["invocations"] = [
            _portable(r, r.get("run_dir") or run_dir) for r in meta["invocations"]
        ]
    return out


def machine_paths(meta: dict) -> list[str]:
    """The absolute paths a record still names (cwd, run_dir, data_dir, argv)."""
    found = []
    for r in [meta, *meta.get("invocations", [])]:
        for key in ("cwd", "run_dir", "data_dir"):
            if isinstance(r.get(key), str) and os.path.isabs(r[key]):
                found.append(f"{key}={r[key]}")
        found += [a for a in r.get("argv", []) if os.path.isabs(a)]
    return found


def portable_config(config: dict) -> dict:
    """config.json with an absolute `out_dir` inside a checkout's docs/results/ made relative
    to the checkout (as `stalepipe sweep --out docs/results/...` writes it)."""
    out_dir = config.get("out_dir")
    if isinstance(out_dir, str) and os.path.isabs(out_dir) and "/docs/results/" in out_dir:
        return {**config, "out_dir": "docs/results/" + out_dir.partition("/docs/results/")[2]}
    return config


def config_paths(config: dict) -> list[str]:
    """The absolute paths a config.json still names (out_dir)."""
    out_dir = config.get("out_dir")
    return [f"out_dir={out_dir}"] if isinstance(out_dir, str) and os.path.isabs(out_dir) else []


def _records(root: str) -> list[tuple[Path, dict, dict]]:
    """(path, record, its portable form) of every meta.json and config.json under `root`."""
    out = []
    for path in sorted(Path(root).rglob("meta.json")) + sorted(Path(root).rglob("config.json")):
        record = json.loads(path.read_text())
        new = portable_meta(record) if path.name == "meta.json" else portable_config(record)
        out.append((path, record, new))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("roots", nargs="+", help="directories searched for */meta.json")
    ap.add_argument("--check", action="store_true", help="only report; exit 1 if any path")
    args = ap.parse_args(argv)
    bad = changed = 0
    for root in args.roots:
        for path, record, new in _records(root):
            if args.check:
                meta = path.name == "meta.json"
                if found := machine_paths(record) if meta else config_paths(record):
                    bad += 1
                    print(f"{path}: {', '.join(found)}")
                continue
            if new != record:
                path.write_text(
                    json.dumps(new, indent=2, sort_keys=path.name == "meta.json") + "\n"
                )
                changed += 1
    print(f"{bad} record(s) with machine paths" if args.check else f"{changed} record(s) rewritten")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
