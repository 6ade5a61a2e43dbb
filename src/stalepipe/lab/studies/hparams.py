"""Study 3 (`hparams`): batch size, LR and weight decay, one at a time around study 1's
configuration, under sync and 2bw (AdamW; Muon beside it beyond cpu)."""

from __future__ import annotations

from dataclasses import replace

from stalepipe.lab.studies.scales import SYNC, TWO_BW, base_config, lr_axis, optimizer_axis
from stalepipe.lab.studies.study import Study
from stalepipe.lab.sweeps.grid import Bundle, axis


def study_hparams(scale: str) -> list[list[list[Bundle]]]:
    bs = base_config(scale).train.batch_size
    grids = []
    for name in ("adamw",) if scale == "cpu" else ("adamw", "muon"):
        opt = optimizer_axis(scale, (name,))
        grids += [
            [opt, axis("train.batch_size", [bs // 2, bs, bs * 2]), [SYNC, TWO_BW]],
            [opt, lr_axis(scale, name), [SYNC, TWO_BW]],
            [opt, _wd_axis(scale, name), [SYNC, TWO_BW]],
        ]
    return grids


def _wd_axis(scale: str, name: str) -> list[Bundle]:
    """No weight decay, the optimizer's default and three times it (AdamW 0.1, Muon 0.01)."""
    from stalepipe.training.optim import resolve_config  # here, not at the top: it imports torch

    wd = resolve_config(replace(base_config(scale).optim, name=name)).weight_decay
    return axis("optim.weight_decay", ["0", f"{wd:g}", f"{wd * 3:g}"])


STUDY = Study(
    name="hparams",
    grids=study_hparams,
    about="batch size, LR, weight decay (one at a time; AdamW, + Muon beyond cpu)",
    order=50,
)
