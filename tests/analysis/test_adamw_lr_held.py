"""The analysis registered for study `ladder-adamw-lr2` (docs/RESULTS.md, "AdamW's ladder with its
LR held apart"; benchmarks/studies/adamw_lr_held.py), on synthetic gaps whose a, c and k are
known, on synthetic run records, and on the committed records."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stalepipe.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "studies" / "adamw_lr_held.py"
_spec = importlib.util.spec_from_file_location("adamw_lr_held", SCRIPT)
held = importlib.util.module_from_spec(_spec)
sys.modules["adamw_lr_held"] = held  # dataclasses look their module up
_spec.loader.exec_module(held)

LABELS = (held.LABEL_SHRINKS, held.LABEL_GROWS, held.LABEL_NONE)


def _gap(n: int, lr: float, a: float, c: float, k: float) -> float:
    return math.exp(a - c * math.log(n) + k * math.log(lr))


def _a_for(c: float, k: float, gap_at_96: float = 0.15) -> float:
    """The intercept that puts width 96's gap at its best LR near `gap_at_96`."""
    return math.log(gap_at_96) + c * math.log(406_368) - k * math.log(0.006)


def _cells(c: float, k: float, noise: float, seed: int = 0) -> dict:
    """Every registered (width, LR, seed) gap from `ln g = a - c ln N + k ln LR`, each seed's
    gap times exp(N(0, noise))."""
    rng = np.random.default_rng(seed)
    a = _a_for(c, k)
    return {
        (w, lr): {
            s: _gap(held.WIDTHS[w], lr, a, c, k) * math.exp(rng.normal(0, noise))
            for s in held.SEEDS
        }
        for w, lr, _ in held.CELLS
    }


def _means(cells: dict) -> list:
    return [(held.WIDTHS[w], lr, float(np.mean(list(g.values())))) for (w, lr), g in cells.items()]


def test_the_fit_recovers_a_c_and_k_of_synthetic_gaps():
    c, k = 0.8, 0.6
    fit = held.fit_held_lr(_means(_cells(c, k, noise=0.01)))
    assert fit.n == 10 and fit.df == 7 and fit.left_out == ()
    assert fit.c == pytest.approx(c, abs=0.03) and fit.k == pytest.approx(k, abs=0.03)
    assert fit.a == pytest.approx(_a_for(c, k), abs=0.5)
    assert fit.c_ci[0] < c < fit.c_ci[1] and fit.k_ci[0] < k < fit.k_ci[1]
    exact = held.fit_held_lr(_means(_cells(c, k, noise=0.0)))  # no noise: the truth itself
    assert (exact.a, exact.c, exact.k) == pytest.approx((_a_for(c, k), c, k), abs=1e-9)


def test_the_ols_is_numpy_s_least_squares():
    rng = np.random.default_rng(3)
    x = np.column_stack([np.ones(10), rng.normal(12, 1, 10), rng.normal(-6, 0.7, 10)])
    y = x @ np.array([7.0, -0.5, 0.6]) + rng.normal(0, 0.2, 10)
    beta, cov, df = held.ols(x, y)
    ref, rss, rank, _ = np.linalg.lstsq(x, y, rcond=None)
    assert rank == 3 and df == 7
    np.testing.assert_allclose(beta, ref, rtol=1e-10, atol=1e-12)
    s2 = float(rss[0]) / df
    np.testing.assert_allclose(cov, s2 * np.linalg.inv(x.T @ x), rtol=1e-10)
    # and the fit is that OLS on (1, ln N, ln LR) -> ln g, c the negated size slope
    points = _means(_cells(0.5, 0.6, noise=0.05, seed=4))
    fit = held.fit_held_lr(points)
    design = np.array([[1.0, math.log(n), math.log(lr)] for n, lr, _ in points])
    ref, rss, _, _ = np.linalg.lstsq(design, np.log([g for *_, g in points]), rcond=None)
    assert (fit.a, -fit.c, fit.k) == pytest.approx(tuple(ref), rel=1e-10)
    se_c = math.sqrt(float(rss[0]) / 7 * np.linalg.inv(design.T @ design)[1, 1])
    half = 2.364624251592785 * se_c  # t(0.975, 7)
    assert fit.c_ci == pytest.approx((fit.c - half, fit.c + half), rel=1e-9)


@pytest.mark.parametrize(
    ("c", "noise", "label"),
    [(0.8, 0.02, held.LABEL_SHRINKS), (-0.8, 0.02, held.LABEL_GROWS), (0.0, 0.4, held.LABEL_NONE)],
)
def test_each_label_is_reached_by_a_data_set_built_for_it(c, noise, label):
    fit = held.fit_held_lr(_means(_cells(c, 0.6, noise=noise, seed=1)))
    assert held.label_c(fit.c_ci) == label, fit.c_ci
    lines, complete = held.report(_cells(c, 0.6, noise=noise, seed=1))
    assert complete
    said = [line for line in lines if line.startswith("  c 95 % [")]
    lo, hi = fit.c_ci
    assert said == [f"  c 95 % [{lo:.3f}, {hi:.3f}]: {label}"]  # the interval the label used


def test_label_rules_at_their_edges():
    assert held.label_c((0.01, 2.0)) == held.LABEL_SHRINKS
    assert held.label_c((0.0, 2.0)) == held.LABEL_NONE  # an interval touching 0 holds it
    assert held.label_c((-2.0, -0.01)) == held.LABEL_GROWS
    assert held.label_c((-0.1, 0.1)) == held.LABEL_NONE
    assert held.label_c((math.nan, math.nan)) == held.LABEL_NONE  # unread: never a label
    assert held.k_consistent((0.1, 0.40)) == "consistent"  # overlap at the edge
    assert held.k_consistent((0.72, 1.5)) == "consistent"
    assert held.k_consistent((0.1, 0.39)) == "not consistent"
    assert held.k_consistent((0.73, 1.5)) == "not consistent"
    assert held.k_consistent((math.nan, math.nan)).startswith("unread")


def test_a_mean_gap_at_or_below_zero_is_left_out_and_said():
    cells = _cells(0.8, 0.6, noise=0.01)
    cells[32, 0.009] = {0: 0.02, 1: -0.05, 2: -0.03}  # mean -0.02
    fit = held.fit_held_lr(_means(cells))
    assert fit.n == 9 and fit.df == 6
    assert fit.left_out == ((49_440, 0.009, pytest.approx(-0.02)),)
    assert fit.c == pytest.approx(0.8, abs=0.05)  # the other nine still carry the truth
    lines, complete = held.report(cells)
    assert complete
    assert "  left out (mean gap <= 0): N 49,440 LR 0.009 gap -0.0200" in lines
    # the per-seed check leaves out the two seeds below 0 and keeps the one above
    assert "  left out (per-seed gap <= 0): N 49,440 LR 0.009 gap -0.0500; N 49,440 LR 0.009 gap -0.0300" in lines  # fmt: skip
    check = next(i for i, line in enumerate(lines) if line.startswith("check (not labelled)"))
    assert "(28 points, 25 residual df)" in lines[check + 2]
    assert not any(label in lines[check + 2] for label in LABELS)


def test_the_complete_report_prints_what_was_registered():
    cells = _cells(0.8, 0.6, noise=0.02, seed=2)
    lines, complete = held.report(cells)
    text = "\n".join(lines)
    assert complete and "incomplete" not in text
    assert "(10 points, 7 residual df)" in text
    assert re.search(r"beside the 0.43M slope 0.564 \[0.40, 0.72\]: consistent", text)
    ratio = next(line for line in lines if line.startswith("width 96 -> 136"))
    assert "LR ratio 1.42x; 5.66x at the best" in ratio
    m96, m136 = (float(np.mean(list(cells[w, lr].values()))) for w, lr in ((96, 0.003), (136, 0.00212)))  # fmt: skip
    assert f"= {m96 / m136:.2f}x [" in ratio
    fit = held.fit_held_lr(_means(cells))
    step = 0.003 / 0.00212
    want = f"k predicts {step**fit.k:.2f}x [{step ** fit.k_ci[0]:.2f}, {step ** fit.k_ci[1]:.2f}]"
    assert want in ratio
    assert lines[-1] == held.CAVEAT


def test_an_incomplete_set_prints_the_table_and_no_fit_or_label():
    cells = _cells(0.8, 0.6, noise=0.02)
    del cells[96, 0.003][1]
    del cells[136, 0.00212]
    lines, complete = held.report(cells)
    assert not complete
    assert lines[1] == (
        "incomplete: 26 of 30 paired gaps (missing: width 96 LR 0.003 seed 1, width 136 LR "
        "0.00212 seed 0, width 136 LR 0.00212 seed 1, width 136 LR 0.00212 seed 2)"
    )
    text = "\n".join(lines)
    for word in (*LABELS, "consistent", "primary", "check", "k predicts", "c 95 %"):
        assert word not in text.replace("incomplete", ""), word
    assert len(lines) == 2 + 1 + 10  # the head, the incomplete line, the table


def _write_run(root: Path, template: Path, width: int, lr: float, arm: str, seed: int, loss):
    """A finished run record under `root` from a committed config of the same width."""
    cfg = json.loads((template / "config.json").read_text())
    cfg["optim"]["lr"], cfg["train"]["seed"], cfg["data"]["seed"] = lr, seed, seed
    cfg["delay"]["policy"] = arm
    name = f"adamw_lr{lr:g}_d{width}_{arm}_s{seed}"
    cfg["name"] = name
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 0, "val_loss_full": loss}) + "\n")


def _synthetic_records(tmp_path: Path, c: float, k: float) -> tuple[Path, Path]:
    """The 60 runs of the 30 gaps, sync at 2.0 + 0.01 seed, 2bw above it by the law's gap; the
    best LRs under best/, the second under second/, seed 0's sync at the second LR under both
    (phase 1's run, as committed)."""
    best, second = tmp_path / "best", tmp_path / "second"
    a = _a_for(c, k)
    for w, lr, which in held.CELLS:
        template = ROOT / "docs/results/ladder-regime" / f"adamw_lr{held.LADDER_LRS['adamw', w]}_d{w}_sync_s0"  # fmt: skip
        root = best if which == "best" else second
        for s in held.SEEDS:
            sync = 2.0 + 0.01 * s
            _write_run(root, template, w, lr, "sync", s, sync)
            gap = _gap(held.WIDTHS[w], lr, a, c, k) * (1 + 0.01 * (s - 1))
            _write_run(root, template, w, lr, "2bw", s, sync + gap)
            if which == "second" and s == 0:
                _write_run(best, template, w, lr, "sync", s, sync)
    return best, second


def test_the_script_reads_synthetic_records_end_to_end(tmp_path, capsys):
    best, second = _synthetic_records(tmp_path, c=0.8, k=0.6)
    code = held.main(["--best", str(best), "--second", str(second), "--require-complete"])
    out = capsys.readouterr().out
    assert code == 0 and "incomplete" not in out
    assert "c 95 % [" in out and f"]: {held.LABEL_SHRINKS}" in out
    fit = re.search(r"c = (\S+) \[.*k = (\S+) \[.*\(10 points, 7 residual df\)", out)
    assert float(fit.group(1)) == pytest.approx(0.8, abs=0.02)
    assert float(fit.group(2)) == pytest.approx(0.6, abs=0.02)
    # one run fewer: incomplete, no label, and --require-complete refuses
    for f in (second / "adamw_lr0.003_d96_2bw_s2").iterdir():
        f.unlink()
    (second / "adamw_lr0.003_d96_2bw_s2").rmdir()
    code = held.main(["--best", str(best), "--second", str(second), "--require-complete"])
    out = capsys.readouterr().out
    assert code == 1
    assert "incomplete: 29 of 30 paired gaps (missing: width 96 LR 0.003 seed 2)" in out
    assert not any(label in out.replace("incomplete:", "") for label in LABELS)


def test_a_run_read_twice_must_agree(tmp_path):
    best, second = _synthetic_records(tmp_path, c=0.8, k=0.6)
    template = ROOT / "docs/results/ladder-regime/adamw_lr0.0045_d32_sync_s0"
    _write_run(best, template, 32, 0.009, "sync", 0, 2.5)  # phase 1's copy now differs
    with pytest.raises(UserError, match="two records of width 32 LR 0.009 sync seed 0 disagree"):
        held.read_cells([best, second])


def _committed_gaps() -> int:
    """The registered gaps whose sync and 2bw records are committed and finished, counted from
    the run directories' names and last metrics rows (not through the script)."""
    have = 0
    for w, _lr, which in held.CELLS:
        text = held.LADDER_LRS["adamw", w] if which == "best" else held.LADDER_ADAMW_SECOND_LRS[w]
        for s in held.SEEDS:
            done = []
            for arm in held.ARMS:
                runs = [
                    ROOT / d / f"adamw_lr{text}_d{w}_{arm}_s{s}" / "metrics.jsonl"
                    for d in (held.BEST_ROOT, held.SECOND_ROOT)
                ]
                done.append(
                    any(
                        r.exists() and "val_loss_full" in r.read_text().splitlines()[-1]
                        for r in runs
                    )
                )
            have += all(done)
    return have


def test_on_the_committed_records_the_script_says_what_exists():
    """While the study runs: "incomplete: K of 30" with K counted independently, and no fit or
    label; once all 30 gaps are committed, the registered label and no "incomplete"."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True, text=True, cwd=ROOT, check=True, timeout=300,
    ).stdout  # fmt: skip
    have = _committed_gaps()
    assert have >= 18  # phase 2's 15 and the study's first three, committed with the script
    if have < held.REGISTERED_GAPS:
        assert f"incomplete: {have} of 30 paired gaps (missing: " in out
        rest = out.replace("incomplete", "")
        assert not any(label in rest for label in LABELS) and "c 95 %" not in rest
    else:
        assert "incomplete" not in out
        assert re.search(r"c 95 % \[\S+, \S+\]: (" + "|".join(LABELS) + r")\n", out)


def test_results_quotes_the_complete_reading_as_the_script_prints_it():
    """Once all 30 gaps are committed, docs/RESULTS.md's reading is the script's output line for
    line (a record changed without the docs rerun fails)."""
    if _committed_gaps() < held.REGISTERED_GAPS:
        pytest.skip("the study's gaps are not all committed yet")
    out = subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True, text=True, cwd=ROOT, check=True, timeout=300,
    ).stdout  # fmt: skip
    results = (ROOT / "docs" / "RESULTS.md").read_text().splitlines()
    missing = [line for line in out.splitlines() if line not in results]
    assert out.strip() and not missing, missing[:3]
