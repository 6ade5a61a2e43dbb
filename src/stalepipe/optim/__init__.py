"""Optimizers behind one registry, parameter grouping, and LR schedules.

`build_optimizer(cfg, named_params)` is the entry point; `OPTIMIZERS` lists the names
(adamw, muon, soap, adan, lion, mars, nadamw); `resolve_config` shows the defaults a config resolves to.
Each optimizer module holds a pure `*_update` function and a thin `torch.optim.Optimizer`.
See docs/optimizers.md.
"""

from stalepipe.optim.adamw import adamw_update
from stalepipe.optim.adan import Adan, adan_update
from stalepipe.optim.groups import ParamSplit, param_kind, split_params
from stalepipe.optim.lion import Lion, lion_update
from stalepipe.optim.mars import MARS, mars_update
from stalepipe.optim.muon import Muon, muon_update, newton_schulz
from stalepipe.optim.nadamw import NAdamW
from stalepipe.optim.registry import DEFAULTS, OPTIMIZERS, build_optimizer, resolve_config
from stalepipe.optim.soap import SOAP, soap_update

__all__ = [
    "DEFAULTS",
    "MARS",
    "OPTIMIZERS",
    "SOAP",
    "Adan",
    "Lion",
    "Muon",
    "NAdamW",
    "ParamSplit",
    "adamw_update",
    "adan_update",
    "build_optimizer",
    "lion_update",
    "mars_update",
    "muon_update",
    "newton_schulz",
    "param_kind",
    "resolve_config",
    "soap_update",
    "split_params",
]
