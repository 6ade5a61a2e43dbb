"""Type-checked, never run: the public API as a user's code sees it. `make lint` runs mypy on
this file with --warn-unused-ignores, so every `type: ignore` below must be needed: were a name
typed as Any (the lazy `__getattr__` alone), its ignore would be unused and the check fail."""

from __future__ import annotations

from typing import Any, assert_type

import torch

import stalepipe
from stalepipe.delay import (
    CORRECTORS,
    DELAY_POLICIES,
    DelayConfig,
    DelayedOptimizer,
    DelaySchedule,
    StageSplit,
    StaleWeightsError,
    split_stages,
)


def user_loop(model: torch.nn.Module, x: torch.Tensor) -> None:
    split = split_stages(model, 2, cost="blocks")
    assert_type(split, StageSplit)
    assert_type(split.params, list[dict[str, torch.nn.Parameter]])
    base = torch.optim.AdamW(model.parameters(), lr=3e-4)
    opt = DelayedOptimizer(base, split, DelayConfig(policy="2bw", ef=True), 100)
    torch.optim.lr_scheduler.StepLR(opt, step_size=10)  # an Optimizer to the checker too
    assert_type(opt.step_count, int)
    assert_type(opt.delay, DelaySchedule)
    assert_type(opt.param_groups, list[dict[str, Any]])
    with opt.stale_weights() as versions:
        assert_type(versions, list[int])
        model(x).sum().backward()
    opt.step()
    opt.stepp()  # type: ignore[attr-defined]
    split_stages(model, "2")  # type: ignore[arg-type]
    DelayConfig(policyy="2bw")  # type: ignore[call-arg]
    assert_type(CORRECTORS["ef"].name, str)
    assert "2bw" in DELAY_POLICIES
    assert issubclass(StaleWeightsError, RuntimeError)
    assert_type(stalepipe.__version__, str)
