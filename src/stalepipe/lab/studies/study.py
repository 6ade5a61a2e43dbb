"""What a study is: a named grid over the sweep axes, the scales it runs at and the claims its
runs test. Each study is one module of this package that declares its `Study` as `STUDY`
(`registry.py` finds it there); `stalepipe sweep NAME` runs it, `stalepipe report` checks its
claims.

A study's grid is a function `(scale) -> list of grids`; a grid is a list of axes (see
`grid.axis`), and the study is the union of its grids' products times the seeds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stalepipe.config import ExperimentConfig
from stalepipe.errors import UserError
from stalepipe.lab.analysis.claims import ClaimCheck
from stalepipe.lab.studies.scales import SCALES, base_config
from stalepipe.lab.sweeps.grid import Bundle, RunSpec, dedupe, expand


@dataclass(frozen=True, kw_only=True)
class Study:
    """A named study: its grids, what it answers, where it is listed, which scales it supports
    and the claim functions its runs test, which `stalepipe report` checks.

    `order`: its place in `STUDIES`, `sweep --help` and the report's claims table (ascending;
    a new study takes a number after the highest, so no listed order moves)."""

    name: str
    grids: Callable[[str], list[list[list[Bundle]]]]
    about: str
    order: int
    scales: tuple[str, ...] = SCALES
    claims: tuple[ClaimCheck, ...] = ()

    def specs(self, scale: str, seeds: int) -> list[RunSpec]:
        """Its runs at `scale`, `seeds` seeds each, seed-major."""
        if scale not in self.scales:
            raise UserError(
                f"study {self.name} runs at --scale {', '.join(self.scales)}, not {scale!r}"
            )
        specs = dedupe(s for g in self.grids(scale) for s in expand(g, seeds))
        # seed-major order: an interrupted sweep has every configuration at the first seeds
        return sorted(specs, key=lambda s: s.seed)

    def base(self, scale: str) -> ExperimentConfig:
        """The config every run of the study at `scale` starts from."""
        return base_config(scale)
