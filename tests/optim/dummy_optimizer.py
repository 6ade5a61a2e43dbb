"""A dummy optimizer in one file: what adding an optimizer takes (docs/design.md, 'How to add
an optimizer'). Plain SGD with decoupled weight decay, registered under the name 'dummy' when
this module is imported; `test_dummy_optimizer.py` shows the config accepts it, the registry
builds it and `stalepipe train --optim.name dummy` trains with it."""

from __future__ import annotations

from stalepipe.config import OptimizerSpec, register_optimizer
from stalepipe.optim.specs import decay_groups


def build(cfg, split):
    """torch's SGD over the usual param groups (1-D parameters get no weight decay). torch is
    imported here, not at the top: a spec the config validates against stays torch-free."""
    import torch

    return torch.optim.SGD(decay_groups(cfg, split), lr=cfg.lr)


SPEC = register_optimizer(
    OptimizerSpec(
        name="dummy",
        reads=("lr", "weight_decay"),
        defaults={"lr": 0.05, "weight_decay": 0.0},
        build=build,
    )
)
