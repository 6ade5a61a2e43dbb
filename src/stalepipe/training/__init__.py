"""The training wing: what trains a model under a delay and keeps its runs.

models, optim and data are a step's ingredients; delay is the one implementation of the delay
contract; schedules are pipeline schedules as data; runtime and peers execute them across
processes; rundir keeps run directories, checkpoints and records; train is the loop with its two
engines; launch starts processes; tools read trained models (export, evaluate). Nothing here
imports the lab (docs/design.md, 'Architecture').
"""
