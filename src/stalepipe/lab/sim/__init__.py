"""The timing simulator: per-action costs, simulated runs, memory, Gantt charts."""
