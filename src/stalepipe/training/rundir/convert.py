"""`stalepipe checkpoint convert OLD NEW`: the one place that reads an older checkpoint.

Format 2 (DCP with a pickled `.metadata`) and format 1 (one `.pt` file) hold pickles, which no
load reads any more (`rundir.sharded.refuse_old`). Converting reads one once, through
`rundir.legacy`'s hardened unpickler, in a **child process** whose address space is capped
(`MEMORY_LIMIT`, RLIMIT_AS): whatever a crafted file makes the reader allocate stops there, in
a process that holds nothing of the user's. The child writes NEW as the current format into a
staging directory beside it (the same save and commit training uses: digests and all); the
parent then opens it as any load would (headers, digests, every tensor read back) and only
then renames it to NEW. OLD is never changed.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from stalepipe.errors import CheckpointError, UserError
from stalepipe.training.delay import tied
from stalepipe.training.rundir import checkpoint_parts, legacy, sharded
from stalepipe.training.rundir.checkpoint import checkpoint_step
from stalepipe.training.rundir.checkpoint_parts import from_merged

MEMORY_LIMIT = 16 << 30  # the child's address space: a 360M model's state is ~6 GB; raise it
LIMIT_ENV = "STALEPIPE_CONVERT_MEMORY"  # bytes, to raise (or lower) MEMORY_LIMIT


def convert(old: Path, new: Path) -> Path:
    """Convert the checkpoint `old` (format 1 or 2) into `new` (format 3); returns `new`."""
    old, new = Path(old), Path(new)
    _check_args(old, new)
    step = _old_step(old)
    staging = checkpoint_parts.staging_dir(new.parent, step)
    if staging.exists():
        raise UserError(f"{staging} exists (a save or conversion in progress?); remove it first")
    limit = int(os.environ.get(LIMIT_ENV, MEMORY_LIMIT))
    done = subprocess.run(
        [sys.executable, "-m", "stalepipe.training.rundir.convert", str(old), str(new)],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sharded.clear_staging(new.parent, step)
        said = [ln for ln in done.stderr.strip().splitlines() if ln.startswith("stalepipe: ")]
        why = said[-1].removeprefix("stalepipe: error: ") if said else _killed(done, limit)
        raise CheckpointError(f"could not convert {old}: {why}")
    flat = sharded.ShardedCheckpoint(new)  # as any load opens it: headers and digests
    flat.read(flat.stored_keys())
    return new


def _killed(done: subprocess.CompletedProcess, limit: int) -> str:
    tail = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
    if "MemoryError" in done.stderr or "alloc" in done.stderr or done.returncode < 0:
        said = tail[0][:120]
        return (
            f"its reader needed more than the {limit >> 20} MiB the conversion allows ({said}); "
            f"for a checkpoint you trust that is this large, set {LIMIT_ENV} in bytes"
        )
    return tail[0][:200]


def _check_args(old: Path, new: Path) -> None:
    if not (old.is_dir() or old.is_file()):
        raise UserError(f"{old} does not exist: give a checkpoint, e.g. RUN/ckpt_00001000")
    if new.exists() or new.is_symlink():
        raise UserError(f"{new} exists: give a new path for the converted checkpoint")
    if not new.parent.is_dir():
        raise UserError(f"{new.parent} is not a directory: create it or give another NEW")


def _old_step(old: Path) -> int:
    """The step of an old checkpoint, from its manifest (format 2) or its name (format 1);
    UserError when it is not an old checkpoint."""
    if old.is_file():
        step = checkpoint_step(old)
        if step is None or old.suffix != ".pt":
            raise UserError(f"{old} is not an older stalepipe checkpoint (ckpt_<step>.pt)")
        return step
    try:
        manifest = json.loads((old / "checkpoint.json").read_text())
        fmt, step = manifest["format"], int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(
            f"{old} has no readable checkpoint.json: not a stalepipe checkpoint"
        ) from None
    if fmt != 2:
        raise UserError(f"{old} is in format {fmt!r}, not an older one (2): nothing to convert")
    return step


def _child(old: Path, new: Path) -> None:
    """In the capped child: read `old` through `rundir.legacy`, write `new` as training does."""
    step = _old_step(old)
    if old.is_file():
        state = legacy.read_format1(old)
        config = state.get("config")
        tie = bool((config or {}).get("model", {}).get("tie_embeddings", False))
        aliases = tied.aliases(tie)
        if "engine" in state or "optimizer" in state:
            flat = from_merged(state, aliases)
            metas, shards = flat.metas, [flat.tensors]
        else:  # weights only (what `eval` and `export` read): one stage, no optimizer state
            weights = {f"model/{k}": t for k, t in state["model"].items() if k not in aliases}
            meta = {"step": step, "policy": None, "num_stages": 1, "stages": [0]}
            meta |= {"names": {"0": []}, "param_groups": [], "scalars": {}}
            metas, shards = [meta], [weights]
    else:
        manifest, metas, shards = legacy.read_format2(old)
        config = manifest.get("config")
    for r, (meta, tensors) in enumerate(zip(metas, shards, strict=True)):
        tensors = {k: t.contiguous() for k, t in tensors.items()}
        sharded.save_part(new.parent, step, r, tensors, json.loads(json.dumps(meta, default=_json)))
    sharded.commit(new.parent, step, new, {"config": config, "ranks": list(range(len(metas)))})


def _json(v: object) -> object:
    if isinstance(v, tuple):
        return list(v)
    raise TypeError(f"{type(v).__name__} in a checkpoint's state")


def main() -> int:
    try:
        _child(Path(sys.argv[1]), Path(sys.argv[2]))
    except UserError as e:
        print(f"stalepipe: error: {e}", file=sys.stderr)
        return 2
    except MemoryError:
        print("stalepipe: error: MemoryError", file=sys.stderr)
        return 3
    except Exception as e:  # a checkpoint of a shape no version wrote: one line, not a trace
        print(f"stalepipe: error: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
