"""The process plumbing of multi-process runs: joining the process group (`group`), where each
rank sits (`topology`), waits with deadlines (`waits`), failure records that name the rank that
stopped first (`failures`), and the signals and checkpoint clock a process answers
(`interrupts`). Nothing here knows about stages, steps or weights."""
