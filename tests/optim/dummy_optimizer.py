"""A dummy optimizer in one file: what adding an optimizer takes (docs/design.md, 'Add an
optimizer'). SGD with heavy-ball momentum 0.9 and decoupled weight decay, registered under the
name 'dummy' when this module is imported, with one hyperparameter of its own declared in its
spec: `dampening` (torch's SGD dampening, `--optim.dampening`). `test_dummy_optimizer.py` shows
the config accepts it, the registry builds it, `stalepipe train --optim.name dummy
--optim.dampening 0.5` trains with it, and `--help` and a report show it."""

from __future__ import annotations

from stalepipe.config import OptimizerSpec, Setting, register_optimizer
from stalepipe.training.optim.specs import decay_groups

MOMENTUM = 0.9  # fixed: the dummy reads no optim.beta1

DAMPENING = Setting(
    name="dampening",
    type=float | None,  # None: the optimizer's default (`defaults` below)
    default=None,
    help="dampening of the momentum buffer (dummy)",
    ok=lambda v: 0.0 <= v <= 1.0,
    allowed="in [0, 1]",
)


def build(cfg, split):
    """torch's SGD over the usual param groups (1-D parameters get no weight decay). torch is
    imported here, not at the top: a spec the config validates against stays torch-free."""
    import torch

    groups = decay_groups(cfg, split)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=MOMENTUM, dampening=cfg.dampening)


SPEC = register_optimizer(
    OptimizerSpec(
        name="dummy",
        reads=("lr", "weight_decay"),  # of the fields every optimizer shares
        settings=(DAMPENING,),  # its own; it reads them too
        defaults={"lr": 0.05, "weight_decay": 0.0, "dampening": 0.0},
        build=build,
    )
)
