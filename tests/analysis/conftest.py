"""Fixture run directories with whole validation curves (no training): a sweep whose token
overhead is known by construction."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from stalepipe.config import ExperimentConfig, apply_overrides
from stalepipe.lab.sweeps.sweep import SPEC_FILE
from stalepipe.training.optim import resolve_config

STEPS, EVAL_EVERY, BATCH, SEQ = 200, 10, 4, 32
LENGTHS = (1.1, 1.2, 1.35, 1.5)  # the delayed arms' longer complete runs (`sweep --lengths`)


def sync_loss(step: float) -> float:
    """A curve that flattens well before the end: 2 + 3 exp(-(step + 1) / 30)."""
    return 2.0 + 3.0 * math.exp(-(step + 1) / 30.0)


def write_curve_run(
    root: Path, name: str, overrides: dict[str, str], seed: int, stretch: float = 1.0,
    floor: float = 0.0, group: str | None = None, steps: int = STEPS,
) -> Path:  # fmt: skip
    """A finished run directory: config.json, metrics.jsonl with train loss every step and val
    loss every EVAL_EVERY steps, the sync curve stretched `stretch`x in tokens (a constant
    token tax) and held at or above `floor`; sweep.json unless `group` is ""."""
    cfg = apply_overrides(ExperimentConfig(), {
        "train.num_steps": str(steps), "train.eval_every": str(EVAL_EVERY),
        "train.batch_size": str(BATCH), "data.seq_len": str(SEQ),
        "train.seed": str(seed), "data.seed": str(seed), **overrides,
    })  # fmt: skip
    cfg = dataclasses.replace(cfg, optim=resolve_config(cfg.optim))
    d = root / name
    d.mkdir(parents=True)
    d.joinpath("config.json").write_text(json.dumps(dict(cfg.to_dict(), name=name)))
    lines = []
    for s in range(steps):
        y = max(sync_loss((s + 1) / stretch - 1), floor)
        rec = {"step": s, "loss": y + 0.01}
        if (s + 1) % EVAL_EVERY == 0 or s == steps - 1:
            rec["val_loss"] = y
        lines.append(rec)
    d.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if group != "":
        spec = {"name": name, "group": group or name.rsplit("_s", 1)[0], "seed": seed}
        d.joinpath(SPEC_FILE).write_text(json.dumps(spec))
    return d


@pytest.fixture
def curve_sweep(tmp_path) -> Path:
    """AdamW sync / 2bw (taxed 1.28x, 1.30x, 1.32x by seed) / 2bw+ef (1.09x, 1.10x, 1.11x) and
    Muon sync / 2bw (a floor at 2.3), 3 seeds each. A taxed run reaches sync's final loss only
    past sync's budget, so AdamW's delayed arms also have complete runs planned 1.1, 1.2, 1.35
    and 1.5x as long (the same configuration), whose final losses cross it near their tax."""
    root = tmp_path / "sweep"
    for s in range(3):
        write_curve_run(root, f"adamw_sync_s{s}", {"delay.policy": "sync"}, s)
        write_curve_run(
            root, f"adamw_2bw_s{s}", {"delay.policy": "2bw"}, s, stretch=1.28 + 0.02 * s
        )
        ef = {"delay.policy": "2bw", "delay.ef": "true"}
        write_curve_run(root, f"adamw_2bw+ef_s{s}", ef, s, stretch=1.09 + 0.01 * s)
        for name, o, tax in (("2bw", {"delay.policy": "2bw"}, 1.28), ("2bw+ef", ef, 1.09)):
            for f in LENGTHS:  # complete runs at several lengths, each its schedule stretched
                long = {**o, "train.warmup_steps": str(round(20 * f))}
                write_curve_run(root, f"adamw_x{f:g}_{name}_s{s}", long, s,
                                stretch=tax + (0.02 if tax > 1.2 else 0.01) * s,
                                steps=round(f * STEPS))  # fmt: skip
        muon = {"optim.name": "muon", "optim.lr": "0.02"}
        write_curve_run(root, f"muon_sync_s{s}", {**muon, "delay.policy": "sync"}, s)
        write_curve_run(root, f"muon_2bw_s{s}", {**muon, "delay.policy": "2bw"}, s, floor=2.3)
    return root


@pytest.fixture
def curve_run():
    """`write_curve_run`, for tests that add runs of their own."""
    return write_curve_run


@pytest.fixture(autouse=True)
def _synthetic_runs_leave_the_plateau_at_once(monkeypatch):
    """Hand-made run records name data they never trained on (a data_cache in the working
    directory must not feed their regime check (a)), and their curves are a few steps long:
    their rows are taken to leave the initial plateau at once, so check (a) is read and passes.
    A test that sets rows' exits itself (tests/analysis/test_regime.py, where an unread check
    caps a claim at inconclusive) patches `plateau_exit_of` over this."""
    from stalepipe.lab.analysis import regime

    monkeypatch.setattr(regime, "run_entropy", lambda run: math.nan)
    monkeypatch.setattr(regime, "plateau_exit_of", lambda r: 0.0)
