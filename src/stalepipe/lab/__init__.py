"""The lab wing: what studies the delay and answers questions about it.

sweeps run grids of configurations; studies name them; analysis reads finished runs' records;
sim times pipeline schedules on a cluster model; verdict joins the two into an answer. The lab
never imports the runtime, peers, train or launch: it reads runs through rundir's record
readers, and a sweep is handed the task that trains a run (docs/design.md, 'Architecture').
"""
