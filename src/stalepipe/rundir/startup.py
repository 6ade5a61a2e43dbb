"""How a run begins, as one value the entry points pass down, and the start-up both engines do.

`stalepipe train` starts a run fresh, continues it (`--resume`), replaces it (`--overwrite`) or
branches it from another run's checkpoint (`--init-from`). `StartUp` carries that choice from
the command line through the launcher and the workers; `begin_run` is the start-up every engine
runs once per run, in the order that loses nothing (rundir/directory.py): refusals, data, run
directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalepipe.config import ExperimentConfig
from stalepipe.data import check_vocab
from stalepipe.rundir.checkpoint import latest_checkpoint
from stalepipe.rundir.directory import open_run_dir, prepare_run
from stalepipe.rundir.resume import parent_meta


@dataclass(frozen=True)
class StartUp:
    """How a run begins: `resume` its own newest checkpoint, `overwrite` a run directory of
    stalepipe's, or start from the checkpoint `init_from` of another run (`rundir.resume`).
    The default is a fresh run into a directory that holds no run yet."""

    resume: bool = False
    overwrite: bool = False
    init_from: Path | None = None

    def checkpoint(self, run_dir: Path) -> Path | None:
        """The checkpoint the run starts from: its own newest one on `resume` (so a requeued
        branch continues itself), else the parent's (`init_from`), else none (a fresh start)."""
        if self.resume and (own := latest_checkpoint(run_dir)) is not None:
            return own
        return self.init_from


FRESH = StartUp()  # a new run into a directory that holds no run yet


def begin_run(
    cfg: ExperimentConfig,
    start: StartUp,
    *,
    verbose: bool,
    extra_meta: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Refuse what would lose data, prepare the data, open the run directory (config.json,
    meta.json with `extra_meta` and the parent of an `--init-from` run). Returns (data
    directory, run directory). The main process only: the others wait for it."""
    data_dir = prepare_run(cfg, resume=start.resume, overwrite=start.overwrite, progress=verbose)
    check_vocab(data_dir, cfg.model.vocab_size)
    run_dir = open_run_dir(
        cfg,
        resume=start.resume,
        overwrite=start.overwrite,
        extra_meta={**(extra_meta or {}), **parent_meta(start.init_from)},
        data_dir=data_dir,
    )
    return data_dir, run_dir
