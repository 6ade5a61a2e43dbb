"""The multi-process pipeline runtime: the stage executor, its channels, its per-step
exchanges and the tied embedding's transport. Process plumbing is `peers`; checkpoint parts are
`rundir.checkpoint_parts`."""
