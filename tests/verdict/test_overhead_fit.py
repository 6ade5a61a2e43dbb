"""`stalepipe verdict --overhead-fit LADDER_DIR@SIZE` (issues 41 and 51, item 5): the overhead
ladder's registered fit of Muon+EF's token overhead (one token budget at every width), read
from complete runs at several lengths per width, predicted at the target size with its
interval, judged in the decision block ("inconclusive at the target size" where the interval
holds the flip point); the size ladder (budgets that grow with the width) and the bad forms
refused in one line. The size ladder's own fit (`scaling.overhead_at`) is checked too."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from stalepipe.cli import main
from stalepipe.config import ModelConfig
from stalepipe.config.shapes import count_params
from stalepipe.lab.analysis import overhead_ladder, scaling

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "docs/results/ladder-regime/muon_lr0.04_d32_sync_s0/config.json"
WIDTHS = {32: 96, 48: 128, 64: 192}  # model.dim -> model.ffn_dim (studies/ladder.py LADDER)
LENGTHS = (1.0, 1.1, 1.2, 1.35, 1.5)
SIM = ["--model", "smollm-135m", "--stages", "4", "--microbatches", "8"]


def true_excess(n: int, seed: int, spread: float = 0.04) -> float:
    """The overhead minus one the fixture builds in: 0.1 (N / N0)^-0.5, seeds `spread` apart."""
    return 0.1 * (n / scaling.N0) ** -0.5 * (1 + spread * (seed - 1))


def write_run(root: Path, name: str, dim: int, seed: int, steps: int, delay: dict, loss: float):
    cfg = json.loads(TEMPLATE.read_text())
    cfg["model"].update(dim=dim, ffn_dim=WIDTHS[dim])
    cfg["train"].update(seed=seed, num_steps=steps)
    cfg["delay"].update(delay)
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(cfg))
    row = {"step": steps - 1, "val_loss": loss, "val_loss_full": loss}
    (run / "metrics.jsonl").write_text(json.dumps(row) + "\n")


def params(dim: int) -> int:
    model = json.loads(TEMPLATE.read_text())["model"] | {"dim": dim, "ffn_dim": WIDTHS[dim]}
    return count_params(ModelConfig(**model))["non_embedding"]


def build_ladder(
    root: Path, widths=tuple(WIDTHS), seeds=(0, 1, 2), one_budget=True, spread=0.04
) -> None:
    """Sync at 1x and Muon+EF at every length, per width and seed; the delayed final loss is
    linear in log tokens and crosses sync's 1x loss exactly at 1 + true_excess. `one_budget`:
    every width's 1x is 2,800 steps (the overhead ladder); else 100 x width (the size ladder's
    budgets, which grow with the width)."""
    for dim in widths:
        for seed in seeds:
            base, sync = (2800 if one_budget else 100 * dim), 2.0 + 0.01 * seed
            write_run(root, f"sync_d{dim}_s{seed}", dim, seed, base, {"policy": "sync"}, sync)
            o = 1 + true_excess(params(dim), seed, spread)
            for x in LENGTHS:
                loss = sync - 0.2 * math.log(x / o)
                ef = {"policy": "2bw", "ef": True}
                write_run(root, f"ef_d{dim}_x{x}_s{seed}", dim, seed, round(base * x), ef, loss)


def test_the_overheads_are_read_where_the_final_losses_cross(tmp_path):
    root = tmp_path / "ladder"
    build_ladder(root, one_budget=False)
    runs = scaling.ladder_runs(root)
    points, notes = scaling.ladder_overheads(runs, "muon", "2bw+ef")
    assert not notes and len(points) == 3
    for n, by_seed in points.items():
        for seed, excess in by_seed.items():
            # interpolation in log tokens between whole steps: exact up to the step rounding
            assert excess == pytest.approx(true_excess(n, seed), abs=2e-3)
    x, lo, hi, what = scaling.overhead_at(root, scaling.SMOLLM_360M)
    assert lo < x < hi and "muon 2bw+ef" in what and "power law" in what
    t = scaling.trend(points)
    assert t.fit.shrink == pytest.approx(0.5, abs=0.05)  # the built-in c
    assert x - 1 == pytest.approx(scaling.predict(points, t, scaling.SMOLLM_360M)[0])


def test_verdict_judges_the_fitted_overhead(curve_sweep, tmp_path, capsys):
    root = tmp_path / "ladder"
    build_ladder(root)
    assert main(["verdict", str(curve_sweep), *SIM, "--overhead-fit", f"{root}@360M"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    i = next(k for k, x in enumerate(lines) if x.startswith("given overhead"))
    x, lo, hi, _ = overhead_ladder.overhead_at(root, scaling.SMOLLM_360M)
    assert f"{x:.3f}x [{lo:.3f}, {hi:.3f}] @ 315M (--overhead-fit)" in lines[i]
    edge = float(re.search(r"edge over it (\S+)x", out).group(1))
    ratio = float(re.search(r"time to target (\S+)x", lines[i]).group(1))
    assert ratio == pytest.approx(x / edge, abs=0.01)
    assert not lo <= edge <= hi and "inconclusive at the target size" not in out
    assert "that overhead: muon 2bw+ef, ln o on ln N over 9 seeds at N = " in out
    assert max(len(line) for line in lines) <= 120


def test_an_interval_that_holds_the_flip_point_is_inconclusive_at_the_target_size(
    curve_sweep, tmp_path, capsys
):
    """Seeds far apart: the 360M interval holds 2BW's edge, so the size decides, not a tie."""
    root = tmp_path / "ladder"
    build_ladder(root, spread=0.9)
    assert main(["verdict", str(curve_sweep), *SIM, "--overhead-fit", f"{root}@360M"]) == 0
    out = capsys.readouterr().out
    _, lo, hi, _ = overhead_ladder.overhead_at(root, scaling.SMOLLM_360M)
    edge = float(re.search(r"edge over it (\S+)x", out).group(1))
    assert lo <= edge <= hi, (lo, edge, hi)
    assert "inconclusive at the target size (the fit's interval holds the flip point)" in out


def test_bad_fits_are_refused_in_one_line(curve_sweep, tmp_path, capsys):
    short = tmp_path / "short"
    build_ladder(short, widths=(32, 48))
    sizes = tmp_path / "size-ladder"
    build_ladder(sizes, one_budget=False)
    cases = {
        f"{tmp_path / 'missing'}@360M": "LADDER_DIR@SIZE",
        str(short): "LADDER_DIR@SIZE",
        f"{short}@huge": "give 135M, 360M",
        f"{short}@360": "at least 10,000",
        f"{short}@360M": "at 2 width(s)",
        f"{sizes}@360M": "train different token budgets",
    }
    for arg, words in cases.items():
        assert main(["verdict", str(curve_sweep), *SIM, "--overhead-fit", arg]) == 2, arg
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err
    both = ["--overhead", "1.05,1.01,1.10", "--overhead-fit", f"{short}@360M"]
    assert main(["verdict", str(curve_sweep), *SIM, *both]) == 2
    assert "not both" in capsys.readouterr().err
