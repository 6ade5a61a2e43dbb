"""Optimizers behind one registry, parameter grouping, and LR schedules.

`build_optimizer(cfg, named_params)` is the entry point; `OPTIMIZERS` (config/registry.py) holds
the specs by name (adamw, muon, soap, adan, lion, mars, nadamw: `specs.py`); `resolve_config`
shows the defaults a config resolves to. Each optimizer module holds a pure `*_update` function
and a thin `torch.optim.Optimizer`. See docs/optimizers.md.

The names below load on first use (PEP 562): the package root imports the torch-free
`optim.specs` to register the optimizers, and that must not import torch through this file.
"""

from stalepipe.config.registry import OPTIMIZERS, resolve_config
from stalepipe.lazy import lazy_getattr

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


__getattr__ = lazy_getattr(
    "stalepipe.training.optim", {k: f"stalepipe.training.optim.{v}" for k, v in _LAZY.items()}
)


__all__ = ["OPTIMIZERS", "resolve_config", *_LAZY]
