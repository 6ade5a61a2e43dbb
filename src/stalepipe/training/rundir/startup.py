"""How a run begins, as one value the entry points pass down, and the start-up both engines do.

`stalepipe train` starts a run fresh, continues it (`--resume`), replaces it (`--overwrite`) or
branches it from another run's checkpoint (`--init-from`). `StartUp` carries that choice from
the command line through the launcher and the workers; `begin_run` is the start-up every engine
runs once per run, in the order that loses nothing (rundir/directory.py): refusals, data, run
directory; and it holds the run's lease (`rundir.lease`) for as long as the run writes, so that
one run has one writer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalepipe.config import ExperimentConfig
from stalepipe.fileio import make_owned_dir
from stalepipe.training.data import check_vocab
from stalepipe.training.rundir.checkpoint import latest_checkpoint
from stalepipe.training.rundir.directory import RUN_KIND, open_run_dir, prepare_run
from stalepipe.training.rundir.lease import RunLeased, lease_run, live_owner
from stalepipe.training.rundir.resume import parent_meta


@dataclass(frozen=True)
class StartUp:
    """How a run begins: `resume` its own newest checkpoint, `overwrite` a run directory of
    stalepipe's, or start from the checkpoint `init_from` of another run (`rundir.resume`).
    The default is a fresh run into a directory that holds no run yet."""

    resume: bool = False
    overwrite: bool = False
    init_from: Path | None = None
    leased: bool = False  # the caller holds the run's lease already (a sweep's worker)
    init_hf: Path | None = None  # `--init-from hf:DIR`: weights from an HF model directory

    def hf_weights(self, run_dir: Path) -> Path | None:
        """The HF directory (`rundir.hf_checkpoint`) whose weights the run starts from, with a
        fresh optimizer at step 0: only while the run has no checkpoint of its own."""
        return self.init_hf if self.checkpoint(run_dir) is None else None

    def checkpoint(self, run_dir: Path) -> Path | None:
        """The checkpoint the run starts from: its own newest one on `resume` (so a requeued
        branch continues itself), else the parent's (`init_from`), else none (a fresh start)."""
        if self.resume and (own := latest_checkpoint(run_dir)) is not None:
            return own
        return self.init_from


FRESH = StartUp()  # a new run into a directory that holds no run yet


# What a second `train` of a run that a live process trains is told to do.
LEASED_FIX = (
    "wait for it to finish, or stop it (a lease whose process is gone is taken over); or "
    "choose another --name"
)


@contextmanager
def begin_run(
    cfg: ExperimentConfig,
    start: StartUp,
    *,
    verbose: bool,
    extra_meta: dict[str, Any] | None = None,
) -> Iterator[tuple[Path, Path]]:
    """Refuse what would lose data, prepare the data, take the run's lease, open the run
    directory (config.json, meta.json with `extra_meta` and the parent of an `--init-from`
    run); yields (data directory, run directory) and holds the lease until the body ends: the
    caller trains inside it. The process that owns the run directory only (the launcher, or rank
    0): the others wait for it. A run another live process trains is `RunLeased`, exit 5, before
    anything is read or written; a stale lease is taken over with a note (`verbose`). With
    `start.leased` the caller holds the lease already (a sweep's worker) and nothing is taken."""
    run_dir = Path(cfg.out_dir) / cfg.name
    if not start.leased and (owner := live_owner(run_dir)) is not None:
        raise RunLeased(run_dir, owner, LEASED_FIX)  # at once, before the data is prepared
    data_dir = prepare_run(cfg, resume=start.resume, overwrite=start.overwrite, progress=verbose)
    check_vocab(data_dir, cfg.model.vocab_size)
    hf = {"parent": {"hf": str(start.init_hf.resolve())}} if start.init_hf else {}
    with contextlib.ExitStack() as held:
        owner = None
        if not start.leased:
            make_owned_dir(run_dir, RUN_KIND)  # every refusal passed: the lease needs it
            lease = lease_run(run_dir, then=LEASED_FIX, note=verbose)
            owner = held.enter_context(lease)
        run_dir = open_run_dir(
            cfg,
            resume=start.resume,
            overwrite=start.overwrite,
            extra_meta={**(extra_meta or {}), **parent_meta(start.init_from), **hf},
            data_dir=data_dir,
            lease=owner,
        )
        yield data_dir, run_dir
