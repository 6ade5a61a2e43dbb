"""Sweeps: grids of runs, their plan, a pool of workers and the submitit executors."""
