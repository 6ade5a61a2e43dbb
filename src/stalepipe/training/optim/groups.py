"""Split named parameters into the three kinds every optimizer treats differently.

- `matrix`: hidden weight matrices (ndim >= 2, not the embedding or the output head). Muon and
  MARS use their own rule here; every optimizer applies weight decay.
- `embed`: the token embedding and the output head (`tok_emb.*`, `lm_head.*`). Matrix-shaped, but
  a lookup table / classifier rather than a hidden linear map, so Muon and MARS give them AdamW.
- `vector`: everything 1-D (RMSNorm gains, biases): never weight-decayed.

The split works from global parameter names and shapes, not from a model object, because the
pipeline runtime builds one optimizer per stage from a subset of the parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

EMBED_PREFIXES = ("tok_emb.", "lm_head.")


@dataclass
class ParamSplit:
    """Named parameters by kind; each list keeps the order of the input."""

    matrix: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    embed: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    vector: list[tuple[str, nn.Parameter]] = field(default_factory=list)

    def kinds(self) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
        """(kind, params) for the non-empty kinds, in a fixed order."""
        out = [("matrix", self.matrix), ("embed", self.embed), ("vector", self.vector)]
        return [(k, ps) for k, ps in out if ps]


def param_kind(name: str, p: nn.Parameter) -> str:
    """'matrix', 'embed' or 'vector' for one parameter (see the module docstring)."""
    if p.ndim < 2:
        return "vector"
    if name.startswith(EMBED_PREFIXES):
        return "embed"
    return "matrix"


def split_params(named_params: Iterable[tuple[str, nn.Parameter]]) -> ParamSplit:
    """Group `named_params` by kind, skipping frozen ones and deduplicating tied weights.

    A tied tensor (the embedding shared with the head) must be updated once per step, so only its
    first occurrence is kept, under its first name.
    """
    split = ParamSplit()
    seen: set[int] = set()
    for name, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        getattr(split, param_kind(name, p)).append((name, p))
    return split
