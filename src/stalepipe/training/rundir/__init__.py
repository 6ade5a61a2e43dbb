"""Run directories: config and meta records, metrics files, checkpoints, resume rules."""
