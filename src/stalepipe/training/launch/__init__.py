"""Starting and supervising worker processes (spawned, pooled, torchrun)."""
