"""The optimizer registry: defaults per optimizer, config resolution, and construction.

`resolve_config` turns an `OptimConfig` whose fields may be `None` ("the optimizer's default")
into a fully specified one. Which fields each optimizer reads is `config.OPTIMIZER_FIELDS`;
`OptimConfig` itself refuses an unknown name or a value in a field the optimizer does not read.
`build_optimizer` builds the optimizer for a set of named parameters (a whole model, or one
pipeline stage). Defaults and their sources are in docs/optimizers.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from stalepipe.config import FIXED_OPTIM_FIELDS, ConfigError, OptimConfig
from stalepipe.optim import lr_schedule
from stalepipe.optim.adan import Adan
from stalepipe.optim.groups import ParamSplit, split_params
from stalepipe.optim.lion import Lion
from stalepipe.optim.mars import MARS
from stalepipe.optim.muon import Muon
from stalepipe.optim.nadamw import NAdamW
from stalepipe.optim.soap import SOAP

# Betas/eps of the AdamW part inside Muon and MARS (Jordan's MuonWithAuxAdam and MARS's
# `betas_1d` both use (0.9, 0.95)); not configurable (muon records its eps: FIXED_OPTIM_FIELDS).
AUX_ADAMW_BETAS = (0.9, 0.95)
AUX_ADAMW_EPS = 1e-8
# SOAP: sides longer than this get no rotation (the reference's default; excludes vocab sizes).
SOAP_MAX_PRECOND_DIM = 10000

DEFAULTS: dict[str, dict[str, Any]] = {
    "adamw": dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1),
    # muon: lr / weight_decay / adam_lr depend on muon_scale, see _MUON_BY_SCALE
    "muon": dict(beta1=0.95, nesterov=True, ns_steps=5, muon_scale="original"),
    "soap": dict(lr=3e-3, beta1=0.95, beta2=0.95, eps=1e-8, weight_decay=0.01, precond_freq=10),
    "adan": dict(lr=3e-3, beta1=0.98, beta2=0.92, beta3=0.99, eps=1e-8, weight_decay=0.02),
    "lion": dict(lr=1e-4, beta1=0.95, beta2=0.98, weight_decay=1.0),
    "mars": dict(
        lr=3e-3, beta1=0.95, beta2=0.99, eps=1e-8, weight_decay=0.01, gamma=0.025, adam_lr=3e-3
    ),
    # Ajanthan et al. (ICML 2025; AsyncPP's run.bash): lr 3e-4, momentum 0.99; beta2 and eps
    # Dozat's / torch NAdam's; weight decay the AdamW baseline's.
    "nadamw": dict(lr=3e-4, beta1=0.99, beta2=0.999, eps=1e-8, weight_decay=0.1),
}

_MUON_BY_SCALE = {
    # Jordan's MuonWithAuxAdam example: matrices lr 0.02 / wd 0.01; the AdamW part uses the
    # AdamW baseline's LR so that only the matrix rule differs from the baseline.
    "original": dict(lr=0.02, weight_decay=0.01, adam_lr=DEFAULTS["adamw"]["lr"]),
    # Moonshot: the RMS-matched update reuses AdamW's LR and weight decay for everything.
    "match_rms": dict(
        lr=DEFAULTS["adamw"]["lr"],
        weight_decay=DEFAULTS["adamw"]["weight_decay"],
        adam_lr=None,  # = lr
    ),
}


def resolve_config(cfg: OptimConfig) -> OptimConfig:
    """`cfg` with every `None` field the optimizer reads replaced by its default, and the fields
    it fixes (`FIXED_OPTIM_FIELDS`) at their values: what the run's config.json records."""
    defaults = {**DEFAULTS[cfg.name], **FIXED_OPTIM_FIELDS.get(cfg.name, {})}
    if cfg.name == "muon":
        defaults.update(_MUON_BY_SCALE[cfg.muon_scale or defaults["muon_scale"]])
    out = dataclasses.replace(cfg, **{f: v for f, v in defaults.items() if getattr(cfg, f) is None})
    if out.name == "muon" and out.adam_lr is None:
        out = dataclasses.replace(out, adam_lr=out.lr)
    return out


def _named_group(params: list[tuple[str, nn.Parameter]], kind: str, **hyper: Any) -> dict:
    return {"params": params, "kind": kind, **hyper}


def _decay(kind: str, weight_decay: float) -> float:
    """1-D parameters (norm gains, biases) are never weight-decayed."""
    return 0.0 if kind == "vector" else weight_decay


def _decay_groups(cfg: OptimConfig, split: ParamSplit) -> list[dict]:
    return [
        _named_group(ps, kind, weight_decay=_decay(kind, cfg.weight_decay))
        for kind, ps in split.kinds()
    ]


def _aux_adamw_group(cfg: OptimConfig, ps: list, kind: str) -> dict:
    """A group of the AdamW part of Muon and MARS: fixed betas and eps, `cfg.adam_lr`."""
    return _named_group(
        ps,
        kind,
        algo="adamw",
        lr=cfg.adam_lr,
        betas=AUX_ADAMW_BETAS,
        eps=AUX_ADAMW_EPS,
        weight_decay=_decay(kind, cfg.weight_decay),
    )


def _composite_groups(
    cfg: OptimConfig, split: ParamSplit, algo: str, **matrix_hyper: Any
) -> list[dict]:
    """Hidden matrices run `algo` with `matrix_hyper`; embeddings, head and 1-D parameters run
    the AdamW part."""
    return [
        _named_group(ps, kind, algo=algo, **matrix_hyper)
        if kind == "matrix"
        else _aux_adamw_group(cfg, ps, kind)
        for kind, ps in split.kinds()
    ]


def _build_adamw(cfg: OptimConfig, split: ParamSplit) -> torch.optim.Optimizer:
    groups = _decay_groups(cfg, split)
    # torch's fused kernel: one pass over each tensor, about twice as fast as the foreach path
    # on CPU (benchmarks/optimizer_step.py) and faster on GPU. Both engines build their AdamW
    # here, so they stay bitwise equal to each other.
    fused = all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda")
        for g in groups
        for _, p in g["params"]
    )
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None
    )


def _build_muon(cfg: OptimConfig, split: ParamSplit) -> torch.optim.Optimizer:
    return Muon(
        _composite_groups(
            cfg,
            split,
            "muon",
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            momentum=cfg.beta1,
            nesterov=cfg.nesterov,
            ns_steps=cfg.ns_steps,
            scale=cfg.muon_scale,
        )
    )


def _build_mars(cfg: OptimConfig, split: ParamSplit) -> torch.optim.Optimizer:
    return MARS(
        _composite_groups(
            cfg,
            split,
            "mars",
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            gamma=cfg.gamma,
        )
    )


def _build_soap(cfg: OptimConfig, split: ParamSplit) -> torch.optim.Optimizer:
    return SOAP(
        _decay_groups(cfg, split),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        precond_freq=cfg.precond_freq,
        max_precond_dim=SOAP_MAX_PRECOND_DIM,
    )


def _build_adan(cfg: OptimConfig, split: ParamSplit) -> torch.optim.Optimizer:
    return Adan(
        _decay_groups(cfg, split),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2, cfg.beta3),
        eps=cfg.eps,
    )


def _build_lion(cfg: OptimConfig, split: ParamSplit) -> torch.optim.Optimizer:
    return Lion(_decay_groups(cfg, split), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def _build_nadamw(cfg: OptimConfig, split: ParamSplit) -> torch.optim.Optimizer:
    return NAdamW(_decay_groups(cfg, split), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


Builder = Callable[[OptimConfig, ParamSplit], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Builder] = {
    "adamw": _build_adamw,
    "muon": _build_muon,
    "soap": _build_soap,
    "adan": _build_adan,
    "lion": _build_lion,
    "mars": _build_mars,
    "nadamw": _build_nadamw,
}


def build_optimizer(
    cfg: OptimConfig, named_params: Iterable[tuple[str, nn.Parameter]]
) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` (defaults filled by `resolve_config`) over `named_params`.

    Parameters are grouped by kind (`groups.split_params`): each param group carries `kind`
    ('matrix' | 'embed' | 'vector'), the parameter names (`param_names`) and `peak_lr` for the LR
    schedules. 1-D parameters get no weight decay. A tied weight listed twice is updated once.
    Deterministic: the same config and parameter list always give the same groups and updates.
    """
    cfg = resolve_config(cfg)
    split = split_params(named_params)
    if not split.kinds():
        raise ConfigError("build_optimizer got no trainable parameters")
    opt = OPTIMIZERS[cfg.name](cfg, split)
    lr_schedule.set_peak_lr(opt)
    return opt
