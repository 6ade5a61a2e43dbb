"""The `size` study: three model widths at one token budget, sync / 2bw / 2bw+EF."""

from __future__ import annotations

from stalepipe.lab.studies.scales import (
    LRS,
    REGIME,
    SYNC,
    TWO_BW,
    TWO_BW_EF,
    base_config,
)
from stalepipe.lab.studies.study import Study
from stalepipe.lab.sweeps.grid import Bundle

# Model sizes of the size study: (width, SwiGLU width, heads), 4 layers each; 0.43M, 1.67M and
# 3.62M parameters at the byte vocabulary. Every size trains on the scale's tokens (the same
# budget, so larger models are further from convergence); AdamW's LR scales as 1/width from the
# scale's tuned value (the muP rule for hidden matrices), Muon's is kept (its update is
# normalised per matrix).
SIZES = ((96, 256, 4), (192, 512, 4), (288, 768, 6))


def _size(width: int, ffn: int, heads: int) -> Bundle:
    return (
        f"d{width}",
        {"model.dim": str(width), "model.ffn_dim": str(ffn), "model.num_heads": str(heads)},
    )


def study_size(scale: str) -> list[list[list[Bundle]]]:
    base_width = base_config(scale).model.dim
    grids = []
    for name in ("adamw", "muon"):
        for width, ffn, heads in SIZES:
            lr = float(LRS[scale].get(name, "1e-3"))
            lr = lr * base_width / width if name == "adamw" else lr
            opt = [(name, {"optim.name": name, "optim.lr": f"{lr:.3g}"})]
            grids.append([opt, [_size(width, ffn, heads)], [SYNC, TWO_BW, TWO_BW_EF]])
    return grids


STUDY = Study(
    name="size",
    grids=study_size,
    about="0.43M, 1.7M, 3.6M params x 3 arms",
    order=100,
    scales=REGIME,
)
