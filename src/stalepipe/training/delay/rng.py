"""Per-(stage, step, microbatch) random streams, shared by the emulator and the runtime."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run the block with the device's generator seeded by `seed`, then restore it: what
    `torch.random.fork_rng` + `torch.manual_seed` do to the generator a stage draws from (same
    state, same numbers), without their per-call cost (manual_seed also queues lazy seeding of
    every other accelerator type; about 1 ms a call)."""
    gens = [torch.default_generator]
    if device.type == "cuda":
        gens.append(torch.cuda.default_generators[device.index or 0])
    states = [g.get_state() for g in gens]
    for g in gens:
        g.manual_seed(seed)
    try:
        yield
    finally:
        for g, st in zip(gens, states, strict=True):
            g.set_state(st)
