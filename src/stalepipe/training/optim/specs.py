"""The optimizers' specs: what each one reads from `OptimConfig`, its own settings, its
defaults, its builder.

Registered in `config.registry.OPTIMIZERS`, the one list of optimizers: the config validates
`optim.name` and the fields each optimizer reads against it, and holds the settings each one
declares (its own hyperparameters: `--optim.ns_steps`, ...); `optim.registry` resolves defaults
and builds from it. This module is torch-free (the package root imports it so that a config can
be validated without torch, config/registry.py says why): each builder imports its optimizer
class when called. Defaults and their sources are in docs/optimizers.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stalepipe.config.base import Setting
from stalepipe.config.registry import OptimizerSpec, register_optimizer

if TYPE_CHECKING:
    import torch

    from stalepipe.config import OptimConfig
    from stalepipe.training.optim.groups import ParamSplit

# Betas/eps of the AdamW part inside Muon and MARS (Jordan's MuonWithAuxAdam and MARS's
# `betas_1d` both use (0.9, 0.95)); not configurable (muon records its eps: `fixed`).
AUX_ADAMW_BETAS = (0.9, 0.95)
AUX_ADAMW_EPS = 1e-8
# SOAP: sides longer than this get no rotation (the reference's default; excludes vocab sizes).
SOAP_MAX_PRECOND_DIM = 10000


def _own(
    name: str, kind: type, help: str, ok: Callable[[Any], bool] | None = None, allowed: str = ""
) -> Setting:
    """An optimizer's own hyperparameter: `None` (the optimizer's default) unless set."""
    return Setting(name=name, type=kind | None, default=None, help=help, ok=ok, allowed=allowed)


NESTEROV = _own("nesterov", bool, "Nesterov momentum (muon)")
NS_STEPS = _own("ns_steps", int, "Newton-Schulz iterations (muon)", lambda v: v >= 1, ">= 1")
MUON_SCALE = _own(
    "muon_scale",
    str,
    "muon LR scaling: 'original' | 'match_rms'",
    lambda v: v in ("original", "match_rms"),
    "'original' or 'match_rms'",
)
# muon's and mars's: one setting, declared by both
ADAM_LR = _own(
    "adam_lr",
    float,
    "LR of the AdamW part of composite optimizers (muon, mars)",
    lambda v: v > 0,
    "> 0",
)
PRECOND_FREQ = _own(
    "precond_freq", int, "preconditioner update frequency (soap)", lambda v: v >= 1, ">= 1"
)
BETA3 = _own(
    "beta3",
    float,
    "third coefficient (adan: gradient-difference EMA)",
    lambda v: 0.0 <= v < 1.0,
    "in [0, 1)",
)
GAMMA = _own("gamma", float, "variance-reduction scale (mars)", lambda v: v >= 0, ">= 0")


def _named_group(params: list, kind: str, **hyper: Any) -> dict:
    return {"params": params, "kind": kind, **hyper}


def _decay(kind: str, weight_decay: float) -> float:
    """1-D parameters (norm gains, biases) are never weight-decayed."""
    return 0.0 if kind == "vector" else weight_decay


def decay_groups(cfg: OptimConfig, split: ParamSplit) -> list[dict]:
    """One param group per kind, each with `cfg.weight_decay` (0 for 1-D parameters)."""
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
    import torch  # here, not at the top: the package root imports this module torch-free

    groups = decay_groups(cfg, split)
    # torch's fused kernel: one pass over each tensor, about twice as fast as the foreach path
    # on CPU (benchmarks/speed/optimizer_step.py) and faster on GPU. Both engines build their AdamW
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
    from stalepipe.training.optim.muon import Muon  # here: torch (see _build_adamw)

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
    from stalepipe.training.optim.mars import MARS  # here: torch (see _build_adamw)

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
    from stalepipe.training.optim.soap import SOAP  # here: torch (see _build_adamw)

    return SOAP(
        decay_groups(cfg, split),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        precond_freq=cfg.precond_freq,
        max_precond_dim=SOAP_MAX_PRECOND_DIM,
    )


def _build_adan(cfg: OptimConfig, split: ParamSplit) -> torch.optim.Optimizer:
    from stalepipe.training.optim.adan import Adan  # here: torch (see _build_adamw)

    betas = (cfg.beta1, cfg.beta2, cfg.beta3)
    return Adan(decay_groups(cfg, split), lr=cfg.lr, betas=betas, eps=cfg.eps)


def _build_lion(cfg: OptimConfig, split: ParamSplit) -> torch.optim.Optimizer:
    from stalepipe.training.optim.lion import Lion  # here: torch (see _build_adamw)

    return Lion(decay_groups(cfg, split), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def _build_nadamw(cfg: OptimConfig, split: ParamSplit) -> torch.optim.Optimizer:
    from stalepipe.training.optim.nadamw import NAdamW  # here: torch (see _build_adamw)

    return NAdamW(decay_groups(cfg, split), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


ADAMW = register_optimizer(
    OptimizerSpec(
        name="adamw",
        reads=("lr", "beta1", "beta2", "eps", "weight_decay"),
        defaults=dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1),
        build=_build_adamw,
    )
)

_MUON_BY_SCALE = {
    # Jordan's MuonWithAuxAdam example: matrices lr 0.02 / wd 0.01; the AdamW part uses the
    # AdamW baseline's LR so that only the matrix rule differs from the baseline.
    "original": dict(lr=0.02, weight_decay=0.01, adam_lr=ADAMW.defaults["lr"]),
    # Moonshot: the RMS-matched update reuses AdamW's LR and weight decay for everything.
    "match_rms": dict(
        lr=ADAMW.defaults["lr"],
        weight_decay=ADAMW.defaults["weight_decay"],
        adam_lr=None,  # = lr
    ),
}


def _finish_muon(cfg: OptimConfig) -> OptimConfig:
    """Muon's lr / weight_decay / adam_lr depend on muon_scale; adam_lr None is lr."""
    by_scale = _MUON_BY_SCALE[cfg.muon_scale]
    out = dataclasses.replace(cfg, **{f: v for f, v in by_scale.items() if getattr(cfg, f) is None})
    return out if out.adam_lr is not None else dataclasses.replace(out, adam_lr=out.lr)


register_optimizer(
    OptimizerSpec(
        name="muon",
        reads=("lr", "beta1", "weight_decay"),
        settings=(NESTEROV, NS_STEPS, MUON_SCALE, ADAM_LR),
        # lr / weight_decay / adam_lr depend on muon_scale: _finish_muon
        defaults=dict(beta1=0.95, nesterov=True, ns_steps=5, muon_scale="original"),
        # config.json of every muon run so far has optim.eps 1e-8, its AdamW part's fixed eps
        fixed={"eps": AUX_ADAMW_EPS},
        finish=_finish_muon,
        composite=True,
        build=_build_muon,
    )
)
register_optimizer(
    OptimizerSpec(
        name="soap",
        reads=("lr", "beta1", "beta2", "eps", "weight_decay"),
        settings=(PRECOND_FREQ,),
        defaults=dict(
            lr=3e-3, beta1=0.95, beta2=0.95, eps=1e-8, weight_decay=0.01, precond_freq=10
        ),
        build=_build_soap,
    )
)
register_optimizer(
    OptimizerSpec(
        name="adan",
        reads=("lr", "beta1", "beta2", "beta3", "eps", "weight_decay"),
        settings=(BETA3,),
        defaults=dict(lr=3e-3, beta1=0.98, beta2=0.92, beta3=0.99, eps=1e-8, weight_decay=0.02),
        build=_build_adan,
    )
)
register_optimizer(
    OptimizerSpec(
        name="lion",
        reads=("lr", "beta1", "beta2", "weight_decay"),
        defaults=dict(lr=1e-4, beta1=0.95, beta2=0.98, weight_decay=1.0),
        build=_build_lion,
    )
)
register_optimizer(
    OptimizerSpec(
        name="mars",
        reads=("lr", "beta1", "beta2", "eps", "weight_decay"),
        settings=(GAMMA, ADAM_LR),
        defaults=dict(
            lr=3e-3, beta1=0.95, beta2=0.99, eps=1e-8, weight_decay=0.01, gamma=0.025, adam_lr=3e-3
        ),
        composite=True,
        build=_build_mars,
    )
)
register_optimizer(
    OptimizerSpec(
        name="nadamw",
        reads=("lr", "beta1", "beta2", "eps", "weight_decay"),
        # Ajanthan et al. (ICML 2025; AsyncPP's run.bash): lr 3e-4, momentum 0.99; beta2 and eps
        # Dozat's / torch NAdam's; weight decay the AdamW baseline's.
        defaults=dict(lr=3e-4, beta1=0.99, beta2=0.999, eps=1e-8, weight_decay=0.1),
        build=_build_nadamw,
    )
)
