"""Run directories: `runs/<name>/` with config.json, meta.json, metrics.jsonl and checkpoints.

Reports read only these files. Opening a run directory decides between a fresh start, a resume
and a refusal, so that nothing already saved is ever overwritten by accident.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import stalepipe
from stalepipe.config import ExperimentConfig, upgrade_record
from stalepipe.errors import CheckpointError, DataError, UserError
from stalepipe.fileio import (
    MARKER,
    check_removable,
    check_writable,
    flatten_dict,
    make_owned_dir,
    mark_owned,
    owned_kind,
    read_json_record,
    remove_owned_dir,
    write_json_atomic,
)
from stalepipe.training.data import ensure_prepared, is_data_dir
from stalepipe.training.rundir.checkpoint import check_complete, checkpoint_step, latest_checkpoint
from stalepipe.training.rundir.checkpoint_parts import PARTS_DIR
from stalepipe.training.rundir.lease import Owner, restore_lease
from stalepipe.training.rundir.metrics import read_metrics
from stalepipe.training.rundir.resume import config_diff
from stalepipe.training.rundir.status import RUN_KIND


def _git(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            ["git", *args],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(stalepipe.__file__).parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit() -> str | None:
    """The commit of the installed stalepipe's checkout (None outside a git checkout)."""
    out = _git("rev-parse", "HEAD")
    return (out.stdout.strip() or None) if out is not None and out.returncode == 0 else None


def git_dirty() -> bool | None:
    """Whether the checkout has uncommitted changes to tracked files outside docs/ and
    Markdown, i.e. whether `git_commit` alone does not describe the code that ran (None
    outside a git checkout). A sweep into a committed study directory under docs/ rewrites
    its tracked records, and a README being edited changes no code: neither counts."""
    code = (":(top)", ":(top,exclude)docs", ":(top,exclude,glob)**/*.md")
    out = _git("status", "--porcelain", "--untracked-files=no", "--", *code)
    return bool(out.stdout.strip()) if out is not None and out.returncode == 0 else None


# Everything stalepipe writes at the top of a run directory: the loop's files, checkpoints (and
# the temporary files of an interrupted atomic write), TensorBoard, the pipeline runtime's rank
# logs and checkpoint parts, `stalepipe eval`'s results, and the sweep's sweep.json/error.json
# (experiments.sweep SPEC_FILE / ERROR_FILE). --overwrite deletes a run directory only when it
# holds nothing else: add any new file a run directory gets here.
RUN_ENTRIES = (
    "config.json",
    "meta.json",
    "metrics.jsonl",
    "ckpt_*",  # checkpoint directories (rundir.sharded) and older versions' files
    "*.tmp*",
    "tensorboard",
    "logs",
    PARTS_DIR,
    "eval_*.json",
    "sweep.json",
    "error.json",
    ".claim.json*",  # rundir.lease: the owner training it (and a stale lease being replaced)
    *("wandb", "mlruns", ".tracker_id"),  # rundir.trackers: W&B's, MLflow's, the run's id
)
RUN_FIX = "choose another --name"
META_FORMAT = 2  # meta.json with the list of invocations


def open_run_dir(
    cfg: ExperimentConfig,
    *,
    resume: bool,
    overwrite: bool,
    extra_meta: dict[str, Any] | None = None,
    data_dir: str | os.PathLike | None = None,
    lease: Owner | None = None,
) -> Path:
    """Create or reopen `cfg.out_dir/cfg.name`, write config.json and record this invocation
    in meta.json (with `data_dir`, the data directory the run reads: default `cfg`'s). Every
    refusal (`check_run_dir`) is raised before anything is written or deleted.

    - no directory, an empty one, or one no run has trained in yet (no checkpoint, no metrics:
      a failed start, or a run a sweep planned): start fresh, with or without --resume;
    - a run that has trained, without --resume / --overwrite: refuse;
    - --resume: its newest checkpoint must be complete, and the saved config must match `cfg`
      except for the changes `rundir.resume.config_diff` allows;
    - --overwrite: delete the old run first, only if stalepipe made it and it holds nothing
      but a run's files (`fileio.remove_owned_dir`), and put back the `lease` held here;
    - a directory that holds anything else and no run: refuse whatever the flags.
    """
    state, resumed_from = check_run_dir(cfg, resume=resume, overwrite=overwrite)
    run_dir = Path(cfg.out_dir) / cfg.name
    if state == "trained" and overwrite:
        remove_owned_dir(run_dir, RUN_KIND, RUN_ENTRIES, within=cfg.out_dir, fix=RUN_FIX)
        restore_lease(make_owned_dir(run_dir, RUN_KIND), lease, RUN_FIX)  # gone with the run
        state = "new"
    data = Path(cfg.data.resolved_dir() if data_dir is None else data_dir)
    meta = _updated_meta(run_dir, state, data, resumed_from, extra_meta or {})
    make_owned_dir(run_dir, RUN_KIND)
    if state == "unstarted" and owned_kind(run_dir) is None:
        mark_owned(run_dir, RUN_KIND)  # only a run's files in it (run_state): ours
    saved = _saved_config(run_dir) if resumed_from is not None else None
    config = cfg.to_dict()
    # an absolute out_dir inside the working directory is written relative to it (as the
    # command line in meta.json is), so the record names no machine's paths
    config["out_dir"] = _relative_to_cwd(cfg.out_dir)
    if saved is not None and isinstance(saved.get("out_dir"), str):
        # out_dir may differ on resume (another working directory): keep the saved spelling,
        # so a run's config.json stays as portable as it was written
        config["out_dir"] = saved["out_dir"]
    write_json_atomic(run_dir / "config.json", config, within=run_dir)
    write_json_atomic(run_dir / "meta.json", meta, within=run_dir)
    return run_dir


def prepare_run(
    cfg: ExperimentConfig, *, resume: bool, overwrite: bool, progress: bool = False
) -> Path:
    """Start-up before a run directory is opened, in the order that loses nothing: every
    refusal first (`check_run_dir`), then the data the run reads (on --resume the data it
    trained on, found from any working directory: `run_data_dir`). Returns the data dir."""
    check_run_dir(cfg, resume=resume, overwrite=overwrite)
    if resume:
        return run_data_dir(Path(cfg.out_dir) / cfg.name, cfg, progress=progress)
    return ensure_prepared(cfg.data, progress)


def _saved_config(run_dir: Path) -> dict[str, Any] | None:
    try:
        return upgrade_record(read_json_record(run_dir, run_dir / "config.json"))
    except (OSError, ValueError):
        return None


def check_run_dir(
    cfg: ExperimentConfig, *, resume: bool, overwrite: bool
) -> tuple[str, Path | None]:
    """Every refusal of `open_run_dir`, writing and deleting nothing: call it before slow
    start-up work so a refused run fails at once. Returns the directory's `run_state` and the
    checkpoint a --resume continues from (None for a fresh start)."""
    if resume and overwrite:
        raise UserError("--resume and --overwrite exclude each other; pick one")
    run_dir = Path(cfg.out_dir) / cfg.name
    state = run_state(run_dir)
    if state == "foreign":
        entry = _first_foreign(run_dir) or sorted(p.name for p in run_dir.iterdir())[0]
        raise UserError(
            f"{run_dir} exists and is not a stalepipe run directory (it holds {entry!r}); "
            f"{RUN_FIX} or another --out_dir"
        )
    for name in ("config.json", "meta.json", "metrics.jsonl"):  # links refused before any write
        check_writable(run_dir / name, within=run_dir)
    if state != "trained":
        return state, None
    if overwrite:
        check_removable(run_dir, RUN_KIND, RUN_ENTRIES, within=cfg.out_dir, fix=RUN_FIX)
        return state, None
    if not resume:
        fix = "--resume to continue it, " if latest_checkpoint(run_dir) else ""
        raise UserError(
            f"run directory {run_dir} already exists; pass {fix}--overwrite to replace it, "
            f"or {RUN_FIX}"
        )
    return state, _check_resumable(run_dir, cfg)


def run_state(run_dir: Path) -> str:
    """What `run_dir` is: 'new' (absent or empty), 'unstarted' (a run stalepipe set up, marked
    or with its meta.json / sweep.json, holding only a run's files, but no checkpoint and no
    metrics: a failed start or a planned sweep run), 'trained' (a checkpoint or a metrics line)
    or 'foreign' (anything else, e.g. a directory of the user's)."""
    if not run_dir.exists():
        return "new"
    if not run_dir.is_dir():
        return "foreign"
    if latest_checkpoint(run_dir) is not None or read_metrics(run_dir):
        return "trained"
    if not any(run_dir.iterdir()):
        return "new"
    ours = owned_kind(run_dir) == RUN_KIND or any(
        (run_dir / name).is_file() for name in ("meta.json", "sweep.json")
    )
    return "unstarted" if ours and _first_foreign(run_dir) is None else "foreign"


def _first_foreign(run_dir: Path) -> str | None:
    """The first top-level entry of `run_dir` that stalepipe does not write there."""
    if not run_dir.is_dir():
        return run_dir.name
    patterns = (MARKER, *RUN_ENTRIES)
    for name in sorted(p.name for p in run_dir.iterdir()):
        if not any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
            return name
    return None


def _check_resumable(run_dir: Path, cfg: ExperimentConfig) -> Path:
    """The checkpoint `--resume` continues from; UserError naming what is missing otherwise
    (no checkpoint, a truncated one, a config the checkpoint cannot continue under)."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        done = len({r.get("step") for r in read_metrics(run_dir)})
        raise CheckpointError(
            f"--resume: {run_dir} has no checkpoint (ckpt_XXXXXXXX) to continue from (it "
            f"stopped after {done} logged step(s), before its first checkpoint); start it over "
            f"with --overwrite, or {RUN_FIX}"
        )
    check_complete(ckpt)  # cheap: a truncated file, a missing or short shard
    saved_cfg = run_dir / "config.json"
    if saved_cfg.is_file():
        try:
            saved = upgrade_record(read_json_record(run_dir, saved_cfg))
        except ValueError:  # not JSON, or not an object
            raise UserError(
                f"{saved_cfg} is corrupt; fix it or start over with --overwrite"
            ) from None
        diff = config_diff(saved, cfg.to_dict(), resumed_step=checkpoint_step(ckpt))
        if diff:
            shown = ", ".join(
                f"{k}: {flatten_dict(saved).get(k)!r} -> {flatten_dict(cfg.to_dict()).get(k)!r}"
                for k in diff[:3]
            )
            raise UserError(
                f"--resume with a different config ({shown}); resume with the run's own "
                f"settings (stalepipe train --config {saved_cfg} --resume), or start a new run "
                f"from its checkpoint with the new settings (--init-from {run_dir} --name NEW)"
            )
    return ckpt


# --------------------------------------------------------------------------------------------
# meta.json: one record per invocation
# --------------------------------------------------------------------------------------------
#
#   {"meta_format": 2,
#    ...the first invocation's fields (stalepipe, git_commit, git_dirty, torch, python,
#       platform, host, argv, started, cwd, run_dir, data_dir, resumed_from_step, and the
#       caller's extra fields, e.g. data_parallel_ranks): written once, never changed...,
#    "resumed": whether any invocation resumed from a checkpoint,
#    "invocations": [the first invocation's record, then one per later invocation]}
#
# A meta.json of an older stalepipe (no "invocations") becomes the first record as it is.


def invocation_record(run_dir: Path, data_dir: Path, resumed_from: Path | None) -> dict[str, Any]:
    """This process's record for meta.json: code, versions, host, command, times, places."""
    return {
        "stalepipe": stalepipe.__version__,
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        # the kernels torch picks follow the CPU: the same run on another CPU can differ in
        # the last bits (docs/RESULTS.md: Muon's runs did), so a bitwise comparison needs both
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "host": socket.gethostname(),
        "argv": portable_argv(sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # the machine's 1/5/15-minute load at the start: a run's speed moves with it, and a
        # study's wall time is only comparable with the load beside it
        "load_avg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        # places relative to the run directory, so a committed record names no machine's
        # paths: where the command ran, and the data it read (run_data_dir looks there)
        "cwd": os.path.relpath(os.getcwd(), run_dir.resolve()),
        "data_dir": os.path.relpath(data_dir.resolve(), run_dir.resolve()),
        "resumed_from_step": None if resumed_from is None else checkpoint_step(resumed_from),
    }


def _relative_to_cwd(arg: str) -> str:
    """An absolute path inside the working directory relative to it; anything else as given."""
    p, cwd = Path(arg), Path.cwd()
    if p.is_absolute() and p.is_relative_to(cwd):
        return str(p.relative_to(cwd)) or "."
    return arg


def portable_argv(argv: list[str]) -> list[str]:
    """The command line without this machine's paths: the program by its name, absolute
    paths inside the working directory relative to it (others stay: the user typed them)."""
    return [Path(argv[0]).name, *map(_relative_to_cwd, argv[1:])] if argv else []


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def read_meta(run_dir: Path) -> dict[str, Any] | None:
    """A run's meta.json (None when absent); UserError naming the fix when unreadable."""
    path = Path(run_dir) / "meta.json"
    if not path.is_file():
        return None
    try:
        meta = read_json_record(run_dir, path)  # no link out of the run
    except (OSError, ValueError):
        meta = None
    if meta is None:
        raise UserError(
            f"{path} is corrupt; move it aside (it records the run's earlier invocations) and "
            f"run the command again"
        )
    return meta


def invocations(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Every invocation recorded in a meta.json, oldest first (an older meta.json: one)."""
    records = meta.get("invocations")
    if isinstance(records, list):
        return records
    return [{k: v for k, v in meta.items() if k != "meta_format"}]


def _updated_meta(
    run_dir: Path,
    state: str,
    data_dir: Path,
    resumed_from: Path | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """meta.json after this invocation: a fresh one for a new run, else the old one with this
    invocation appended (the first invocation's fields stay as they were)."""
    record = {**invocation_record(run_dir, data_dir, resumed_from), **extra}
    old = read_meta(run_dir) if state == "trained" else None
    if old is None:
        return {"meta_format": META_FORMAT, **record, "resumed": bool(resumed_from),
                "invocations": [record]}  # fmt: skip
    history = [*invocations(old), record]
    first = {k: v for k, v in old.items() if k not in ("invocations", "resumed")}
    any_resumed = any(r.get("resumed_from_step") is not None or r.get("resumed") for r in history)
    return {**first, "meta_format": META_FORMAT, "resumed": any_resumed, "invocations": history}


# --------------------------------------------------------------------------------------------
# Finding a run's data from any working directory
# --------------------------------------------------------------------------------------------


def locate_run_data(run_dir: str | os.PathLike | None, cfg: ExperimentConfig) -> Path | None:
    """The directory holding the token data `cfg` (a run's config) trained on, or None.

    config.json keeps `data.data_dir` as the user gave it (often relative, so the file stays
    portable between machines), so a reader running elsewhere looks, in order, at: an absolute
    `data_dir`; the directories meta.json recorded (newest invocation first); the
    directory the run was started in, inferred from where the run directory is and its
    relative `out_dir` (runs of older versions); the working directory. Nothing is prepared.
    """
    rel = Path(cfg.data.resolved_dir())
    candidates: list[Path] = []
    if rel.is_absolute():
        candidates.append(rel)
    if run_dir is not None:
        run_dir = Path(run_dir)
        with_meta = _meta_or_none(run_dir)
        for record in reversed(invocations(with_meta) if with_meta else []):
            if isinstance(record.get("data_dir"), str):  # relative to the run (older: absolute)
                candidates.append((run_dir / record["data_dir"]).resolve())
        started_in = _started_in(run_dir, cfg)
        if started_in is not None:
            candidates.append(started_in / rel)
    candidates.append(rel)
    return next((c for c in candidates if is_data_dir(c)), None)


def run_data_dir(
    run_dir: str | os.PathLike | None,
    cfg: ExperimentConfig,
    *,
    progress: bool = False,
    fix: str | None = None,
) -> Path:
    """The checked data directory of a run (`locate_run_data`), for a resume from another
    working directory, eval and other readers. Not found: the default cache is prepared here
    (`ensure_prepared`: built-in corpora); an explicit `data_dir` is a DataError, ending with
    `fix` when given (e.g. eval's "pass --data-dir DIR"), else ensure_prepared's own."""
    found = locate_run_data(run_dir, cfg)
    if found is not None:
        return ensure_prepared(dataclasses.replace(cfg.data, data_dir=str(found)), progress)
    if cfg.data.data_dir and fix:
        raise DataError(
            f"the token data of run {run_dir} (data.data_dir {cfg.data.data_dir}) is not found "
            f"from here; {fix}"
        )
    return ensure_prepared(cfg.data, progress)


def _meta_or_none(run_dir: Path) -> dict[str, Any] | None:
    try:
        return read_meta(run_dir)
    except UserError:  # a corrupt meta.json only loses this hint
        return None


def _started_in(run_dir: Path, cfg: ExperimentConfig) -> Path | None:
    """The working directory a run started in: `run_dir` minus the relative `out_dir/name`
    the config names (None when they do not line up, e.g. a copied or renamed run)."""
    tail = Path(cfg.out_dir) / cfg.name
    if tail.is_absolute() or ".." in tail.parts:
        return None
    real = run_dir.resolve()
    parts = [p for p in tail.parts if p != "."]
    if list(real.parts[len(real.parts) - len(parts) :]) != parts:
        return None
    return Path(*real.parts[: len(real.parts) - len(parts)])
