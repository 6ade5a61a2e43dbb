"""The delay section: which policy gives each stage its staleness, and the mitigations and
correctors on top of it (docs/design.md, 'The delay contract'; `delay/` implements them).

The built-in mitigations and correctors are fields here and register their specs at the end
(`CORRECTORS`, config/registry.py), which the config's refusals, the sweeps and the reports
read; a corrector registered elsewhere declares its settings in its spec, and this section
holds them beside its fields (`declares_settings`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from stalepipe.config.base import check, declares_settings, option
from stalepipe.config.registry import CORRECTORS, DELAY_POLICIES, CorrectorSpec


@declares_settings("delay", CORRECTORS.settings)
@dataclass(frozen=True, kw_only=True)
class DelayConfig:
    """Gradient-delay policy and mitigations (docs/design.md, 'The delay contract'), and the
    settings of registered correctors (`declared`)."""

    policy: str = option("sync", lambda: f"delay policy: {DELAY_POLICIES.choices()} | fixed:N")
    ef: bool = option(False, "update-level error feedback W+ = W - 2U_k + U_{k-1}")
    taylor: float = option(0.0, "DC-ASGD Taylor compensation lambda (0 = off)")
    taylor_adaptive: bool = option(False, "adaptive lambda: taylor / sqrt(EMA of g^2)")
    taylor_ema: float = option(0.95, "EMA coefficient of g^2 for adaptive Taylor")
    taylor_eps: float = option(1e-8, "adaptive Taylor: added to sqrt(EMA of g^2)")
    taylor_curvature: str = option(
        "g2", "Taylor's curvature: g2 (g*g, DC-ASGD) | ema (EMA of g*g, DC-ASGD-EMA)"
    )
    weight_pred: bool = option(
        False, "weight prediction: gradient at W_v + c tau (W_v - W_{v-1}) (SpecTrain/PipeMare)"
    )
    weight_pred_scale: float = option(1.0, "weight prediction scale c (needs weight_pred)")
    lr_correction_steps: int = option(
        0, "PipeMare LR lr * tau_s^-(1 - min(k/K, 1)) over K steps (0 = off)"
    )
    adaptive_momentum: bool = option(
        False, "per-stage momentum mu + tau_s (0.99 - mu) / P (Ajanthan et al. 2025)"
    )
    sync_start: int = option(0, "first K steps run without delay")
    sync_cooldown: float = option(0.0, "last K steps without delay: K if >= 1, else a fraction")
    sync_cooldown_wsd: bool = option(
        False, "cooldown = WSD's LR decay phase (then sync_cooldown must stay 0)"
    )
    mode: str = option(
        "fast", "emulator mode: fast (whole model) | exact (per stage, per microbatch)"
    )
    # the registered correctors' settings off their defaults (config/base.py, declares_settings)
    declared: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        policy = self.policy
        if policy.startswith("fixed:"):
            n = policy.split(":", 1)[1]
            check(n.isdigit(), f"delay.policy fixed:N needs an integer N >= 0, got {policy!r}")
        else:
            check(
                policy in DELAY_POLICIES,
                f"delay.policy must be {DELAY_POLICIES.choices(', ')} or fixed:N (N >= 0 steps); "
                f"got {policy!r}",
            )
        check(self.taylor >= 0, f"delay.taylor must be >= 0, got {self.taylor}")
        check(
            0.0 <= self.taylor_ema < 1.0,
            f"delay.taylor_ema must be in [0, 1), got {self.taylor_ema}",
        )
        check(self.sync_start >= 0, f"delay.sync_start must be >= 0, got {self.sync_start}")
        check(
            self.sync_cooldown >= 0,
            f"delay.sync_cooldown must be >= 0 (steps, or a fraction < 1), got "
            f"{self.sync_cooldown}",
        )
        check(
            self.sync_cooldown < 1 or float(self.sync_cooldown).is_integer(),
            f"delay.sync_cooldown >= 1 is a step count and must be a whole number, got "
            f"{self.sync_cooldown}",
        )
        check(self.taylor_eps > 0, f"delay.taylor_eps must be > 0, got {self.taylor_eps}")
        self._check_correctors()
        check(
            self.mode in ("fast", "exact"),
            f"delay.mode must be 'fast' or 'exact', got {self.mode!r}",
        )

    def _check_correctors(self) -> None:
        """The correctors beyond the paper (docs/delay.md): ranges, and no setting that does
        nothing without another."""
        check(
            self.taylor_curvature in ("g2", "ema"),
            f"delay.taylor_curvature must be g2 or ema, got {self.taylor_curvature!r}",
        )
        check(
            self.taylor_curvature == "g2" or self.taylor > 0,
            "delay.taylor_curvature ema is the curvature of Taylor compensation, which is off "
            "(delay.taylor 0); set delay.taylor > 0 (e.g. 0.1) or delay.taylor_curvature g2",
        )
        check(
            self.weight_pred_scale > 0,
            f"delay.weight_pred_scale must be > 0, got {self.weight_pred_scale}",
        )
        check(
            self.weight_pred or self.weight_pred_scale == 1.0,
            f"delay.weight_pred_scale {self.weight_pred_scale:g} scales weight prediction, which "
            f"is off; set delay.weight_pred true or delay.weight_pred_scale 1",
        )
        check(
            self.lr_correction_steps >= 0,
            f"delay.lr_correction_steps must be >= 0 (0 = off), got {self.lr_correction_steps}",
        )


def _builtin(name: str, *fields: str, **kw: Any) -> None:
    """Register a built-in mitigation whose settings are the `fields` above, off at their
    defaults; `DelayedOptimizer` runs it in its own phases."""
    off = {f.name: f.default for f in dataclasses.fields(DelayConfig) if f.name in fields}
    CORRECTORS.register(CorrectorSpec(name=name, fields={f: off[f] for f in fields}, **kw))


_builtin("ef", "ef", needs_delay=False)
_builtin(
    "taylor", "taylor", "taylor_adaptive", "taylor_curvature", tuning=("taylor_ema", "taylor_eps")
)
_builtin("sync_start", "sync_start")
_builtin("sync_cooldown", "sync_cooldown")
_builtin("sync_cooldown_wsd", "sync_cooldown_wsd")
_builtin("weight_pred", "weight_pred", "weight_pred_scale")
_builtin("lr_correction", "lr_correction_steps")
_builtin("adaptive_momentum", "adaptive_momentum")
