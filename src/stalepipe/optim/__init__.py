"""Optimizers behind one registry, parameter grouping, and LR schedules.

`build_optimizer(cfg, named_params)` is the entry point; `OPTIMIZERS` (config/registry.py) holds
the specs by name (adamw, muon, soap, adan, lion, mars, nadamw: `specs.py`); `resolve_config`
shows the defaults a config resolves to. Each optimizer module holds a pure `*_update` function
and a thin `torch.optim.Optimizer`. See docs/optimizers.md.

The names below load on first use (PEP 562): the package root imports the torch-free
`optim.specs` to register the optimizers, and that must not import torch through this file.
"""

import importlib

from stalepipe.config.registry import OPTIMIZERS, resolve_config

_LAZY = {
    "adamw_update": "adamw",
    "Adan": "adan",
    "adan_update": "adan",
    "ParamSplit": "groups",
    "param_kind": "groups",
    "split_params": "groups",
    "Lion": "lion",
    "lion_update": "lion",
    "MARS": "mars",
    "mars_update": "mars",
    "Muon": "muon",
    "muon_update": "muon",
    "newton_schulz": "muon",
    "NAdamW": "nadamw",
    "build_optimizer": "registry",
    "SOAP": "soap",
    "soap_update": "soap",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'stalepipe.optim' has no attribute {name!r}")
    return getattr(importlib.import_module(f"stalepipe.optim.{_LAZY[name]}"), name)


__all__ = ["OPTIMIZERS", "resolve_config", *_LAZY]
