"""User-facing errors. The CLI prints any `UserError` as one line and exits with status 2."""


class UserError(Exception):
    """Bad input from the user (config, files, checkpoints): the message names the fix."""


class DataError(UserError):
    """Missing, corrupt or mismatched token data."""


class CheckpointError(UserError):
    """Missing, corrupt or mismatched checkpoint."""


class TrainingError(UserError):
    """Training cannot continue (e.g. a non-finite loss); the last good checkpoint is kept."""
