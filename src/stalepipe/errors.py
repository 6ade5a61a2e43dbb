"""User-facing errors and the exit codes of every stalepipe command (docs/failures.md).

The CLI prints any `UserError` as one line (no traceback) and exits with its `exit_code`.
"""

EXIT_OK = 0  # finished
EXIT_BUG = 1  # an unexpected error: a traceback (please report it)
EXIT_USER = 2  # bad input (config, files, checkpoint): one line naming the fix, nothing written
EXIT_PEER = 3  # a pipeline worker stopped because a peer failed (a worker's status, not a cause)
EXIT_FAILED = 4  # training failed: diverged, or a worker crashed or was killed
EXIT_LEASED = 5  # the run is leased by a live owner elsewhere (a sweep's worker: skipped;
# `train`: refused, nothing read or written): wait for it, or stop it (rundir/lease.py)
EXIT_PREEMPTED = 75  # a signal stopped the run after a checkpoint (EX_TEMPFAIL): --resume
EXIT_REQUEUE_FAILED = 76  # so did a SLURM array task's, and its requeue was refused: rerun


class UserError(Exception):
    """Bad input from the user (config, files, checkpoints): the message names the fix."""

    exit_code = EXIT_USER


class DataError(UserError):
    """Missing, corrupt or mismatched token data."""


class CheckpointError(UserError):
    """Missing, corrupt or mismatched checkpoint."""


class TrainingError(UserError):
    """Training cannot continue (e.g. a non-finite loss); the last good checkpoint is kept."""

    exit_code = EXIT_FAILED


class Preempted(UserError):
    """A signal asked the run to stop; a checkpoint was written, `--resume` continues it."""

    exit_code = EXIT_PREEMPTED
