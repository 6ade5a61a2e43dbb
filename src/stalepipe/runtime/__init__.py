"""The multi-process pipeline runtime: stage executor, communication, checkpoint parts."""
