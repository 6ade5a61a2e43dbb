"""Report tables from fixture run directories (fake config.json / metrics.jsonl) against
hand-computed values; partial sweeps are reported with what is missing."""

import csv
import dataclasses
import json
import math
from pathlib import Path

import pytest

from stalepipe.config import ExperimentConfig, apply_overrides
from stalepipe.errors import UserError
from stalepipe.lab.analysis import stats
from stalepipe.lab.analysis.report import claims, write_report
from stalepipe.lab.analysis.results import best_row, build_rows, load_runs, missing_summary
from stalepipe.lab.studies.mitigations import study_mitigations
from stalepipe.lab.studies.registry import STUDIES, declared_claims
from stalepipe.lab.sweeps.sweep import SPEC_FILE, write_error
from stalepipe.training.optim import resolve_config

STEPS = 4


def make_run(root, name, overrides, seed, val, *, finished=True, group=None):
    """A run directory as `train` writes it: config.json, metrics.jsonl (+ sweep.json)."""
    cfg = apply_overrides(
        ExperimentConfig(),
        {
            "train.num_steps": str(STEPS),
            "train.seed": str(seed),
            "data.seed": str(seed),
            **overrides,
        },
    )
    cfg = dataclasses.replace(cfg, optim=resolve_config(cfg.optim))  # as train() writes it
    d = root / name
    d.mkdir(parents=True)
    d.joinpath("config.json").write_text(json.dumps(dict(cfg.to_dict(), name=name)))
    last = STEPS if finished else 2
    lines = [{"step": s, "loss": 3.0 - 0.1 * s} for s in range(last)]
    if finished:
        lines[-1]["val_loss"] = val
    d.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    spec = {"name": name, "group": group or name.rsplit("_s", 1)[0], "seed": seed,
            "overrides": overrides}  # fmt: skip
    d.joinpath(SPEC_FILE).write_text(json.dumps(spec))
    return d


SYNC = {"delay.policy": "sync"}
BW = {"delay.policy": "2bw"}
EF = {"delay.policy": "2bw", "delay.ef": "true"}


@pytest.fixture
def sweep_dir(tmp_path):
    root = tmp_path / "study"
    for s, v in enumerate([2.0, 2.1, 2.2]):
        make_run(root, f"adamw_sync_s{s}", SYNC, s, v)
    for s, v in enumerate([2.5, 2.6, 2.7]):
        make_run(root, f"adamw_2bw_s{s}", BW, s, v)
    for s, v in enumerate([2.2, 2.2, 2.3]):
        make_run(root, f"adamw_2bw+ef_s{s}", EF, s, v)
    return root


def rows_by_label(root):
    return {r.label: r for r in build_rows(load_runs(root))}


def test_tables_match_hand_computed(sweep_dir):
    rows = rows_by_label(sweep_dir)
    assert set(rows) == {"adamw_sync", "adamw_2bw", "adamw_2bw+ef"}
    sync, bw, ef = rows["adamw_sync"], rows["adamw_2bw"], rows["adamw_2bw+ef"]
    assert sync.is_sync and sync.mean == pytest.approx(2.1) and sync.std == pytest.approx(0.1)
    # gap: 2.6 - 2.1; Welch with equal variances 0.01 and n = 3: t = 0.5 / sqrt(2 * 0.01 / 3),
    # df = 4
    assert bw.baseline is sync and bw.gap_diff == pytest.approx(0.5)
    t = 0.5 / math.sqrt(0.02 / 3)
    assert bw.gap_welch.p == pytest.approx(stats.t_sf_two_sided(t, 4.0), rel=1e-9)
    # paired by seed: each seed's 2bw loss is its sync loss + 0.5, no spread, so p = 0
    assert bw.gap.paired and bw.gap.n == 3 and bw.gap.p == 0.0
    assert (bw.gap.low, bw.gap.high) == pytest.approx((0.5, 0.5))
    # EF: mean 6.7 / 3, gap 6.7/3 - 2.1 = 0.1333; recovered (0.5 - 0.1333) / 0.5 = 0.7333
    assert ef.unmitigated is bw and ef.baseline is sync
    assert ef.mean == pytest.approx(6.7 / 3)
    assert ef.std == pytest.approx(math.sqrt(((2.2 - 6.7 / 3) ** 2 * 2 + (2.3 - 6.7 / 3) ** 2) / 2))
    assert ef.gap_diff == pytest.approx(6.7 / 3 - 2.1)
    assert ef.recovered.share == pytest.approx((0.5 - (6.7 / 3 - 2.1)) / 0.5)
    # paired: ef - 2bw per seed, from the fixture's values (seed order)
    d = [e - b for e, b in zip(ef.values, bw.values)]
    t = stats.mean(d) / (stats.std(d) / math.sqrt(3))
    assert ef.recovered.p == pytest.approx(stats.t_sf_two_sided(t, 2.0), rel=1e-9)


def test_rows_are_immutable_and_built_with_every_comparison(sweep_dir):
    """`build_rows` builds each row once, frozen (issue 54): the mitigated arm, read first (its
    runs sort before 2bw's), still gets its unmitigated counterpart and its baseline. Every
    number by hand; Student's t with df = 2 in closed form, p = 1 - |t| / sqrt(t^2 + 2)."""
    rows = build_rows(load_runs(sweep_dir))
    assert [r.label for r in rows] == ["adamw_sync", "adamw_2bw", "adamw_2bw+ef"]
    sync, bw, ef = rows
    for row, name, value in ((bw, "gap", None), (sync, "mean", 0.0), (ef, "recovered", None)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(row, name, value)
    assert sync.values == (2.0, 2.1, 2.2) and sync.baseline is None and sync.gap is None
    assert (sync.gap_welch, sync.unmitigated, sync.recovered) == (None, None, None)
    assert sync.token_overhead is None and sync.targets == {}
    # 2bw - sync is 0.5 in every seed: paired, no spread; Welch's beside it, t = 0.5 / sqrt(
    # 2 * 0.01 / 3), df = 4
    assert bw.baseline is sync and bw.unmitigated is None and bw.recovered is None
    assert (bw.gap.diff, bw.gap.low, bw.gap.high, bw.gap.p) == pytest.approx((0.5, 0.5, 0.5, 0))
    assert bw.gap.paired and bw.gap.n == 3 and bw.gap_diff == bw.gap.diff
    t = 0.5 / math.sqrt(0.02 / 3)
    half = stats.t_quantile(0.975, 4.0) * math.sqrt(0.02 / 3)
    welch = (0.5, 0.5 - half, 0.5 + half, stats.t_sf_two_sided(t, 4.0))
    assert (bw.gap_welch.diff, bw.gap_welch.low, bw.gap_welch.high, bw.gap_welch.p) == (
        pytest.approx(welch, rel=1e-9)
    )
    assert not bw.gap_welch.paired and bw.token_overhead is not None and "final" in bw.targets
    # EF - sync per seed: 0.2, 0.1, 0.1: mean 0.1333, sd 0.0577, t = 4; 95 %: t_{0.975, 2} =
    # 4.302653 (tables) x sd / sqrt(3)
    assert ef.baseline is sync and ef.unmitigated is bw and ef.gap.paired
    half = 4.302653 * math.sqrt(1 / 300) / math.sqrt(3)
    assert (ef.gap.diff, ef.gap.low, ef.gap.high, ef.gap.p) == pytest.approx(
        (0.4 / 3, 0.4 / 3 - half, 0.4 / 3 + half, 1 - 4 / math.sqrt(18)), rel=1e-6
    )
    # recovered per seed (2bw - EF) / (2bw - sync): 0.3 / 0.5, 0.4 / 0.5, 0.4 / 0.5; its p:
    # EF - 2bw per seed -0.3, -0.4, -0.4, t = -11
    assert ef.recovered.share == pytest.approx(2.2 / 3)
    assert ef.recovered.p == pytest.approx(1 - 11 / math.sqrt(123), rel=1e-6)


def test_a_record_from_before_a_new_setting_joins_its_configuration(sweep_dir):
    """Seed 0 of each arm written before `pipeline.num_chunks` existed (no key), seeds 1-2
    after (the key at its default): one configuration of 3 seeds each, as before."""
    for d in sweep_dir.glob("*_s0"):
        cfg = json.loads((d / "config.json").read_text())
        del cfg["pipeline"]["num_chunks"]
        (d / "config.json").write_text(json.dumps(cfg))
    rows = rows_by_label(sweep_dir)
    assert set(rows) == {"adamw_sync", "adamw_2bw", "adamw_2bw+ef"}
    assert all(len(r.values) == 3 for r in rows.values())
    # a setting away from its default still tells two configurations apart
    make_run(sweep_dir, "adamw_sync_b2_s0", {**SYNC, "optim.beta2": "0.9"}, 0, 2.0)
    assert len(rows_by_label(sweep_dir)) == 4


def test_runs_of_different_numerics_settings_never_pair(sweep_dir):
    """train.compile changes a run's numbers (issue 55): a compiled 2bw arm finds no eager
    sync baseline, the report says why, and the eager arms still pair as before."""
    for s, v in enumerate([2.4, 2.5, 2.6]):
        make_run(sweep_dir, f"adamw_2bw_compiled_s{s}", {**BW, "train.compile": "true"}, s, v)
    runs = load_runs(sweep_dir)
    rows = {r.label: r for r in build_rows(runs)}
    compiled = rows["adamw_2bw_compiled"]
    assert compiled.baseline is None and compiled.gap is None and math.isnan(compiled.gap_diff)
    assert rows["adamw_2bw"].baseline is rows["adamw_sync"]
    lines = missing_summary(runs, list(rows.values()))
    why = "of its train.compile (adamw_sync ran with another: never paired)"
    assert f"adamw_2bw_compiled: no finished sync baseline {why}, so no gap" in lines
    assert not any(line.startswith("adamw_2bw:") for line in lines)


@pytest.mark.parametrize("scale", ["cpu", "cpu-regime"])
def test_every_mitigation_of_the_study_finds_its_baseline_and_unmitigated_arm(tmp_path, scale):
    """Each variant of the mitigations study (a corrector whose knob is not `delay.taylor`,
    e.g. DC-ASGD-EMA's curvature, included) is compared with sync and with its plain policy."""
    ((_, variants),) = study_mitigations(scale)
    for label, overrides in variants:
        val = 2.0 if label == "sync" else 2.2 if "+" in label else 2.5
        for s in range(2):
            deep = {**overrides, "model.num_layers": "4"}  # room for pipedream's P = 4
            make_run(tmp_path, f"adamw_{label}_s{s}", deep, s, val + 0.1 * s)
    rows = rows_by_label(tmp_path)
    for label, _ in variants:
        row = rows[f"adamw_{label}"]
        if label == "sync":
            assert row.is_sync
            continue
        assert row.baseline is rows["adamw_sync"], label
        if "+" in label:  # e.g. 2bw+ef against 2bw, pipedream_P4+adamom against pipedream_P4
            assert row.unmitigated is rows[f"adamw_{label.split('+')[0]}"], label
            assert math.isfinite(row.recovered.share), label


def test_report_files_and_claims(sweep_dir):
    out = write_report(sweep_dir)
    md = (out / "report.md").read_text()
    assert "| adamw_2bw | 3/3 | 2.6000 ± 0.1000 | 0.5000 |" in md
    assert "73%" in md  # EF's recovered share
    assert "Missing" not in md
    html = (out / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "data:image/png;base64," in html
    assert (out / "loss_curves.png").stat().st_size > 1000
    with open(out / "summary.csv") as f:
        summary = {r["configuration"]: r for r in csv.DictReader(f)}
    assert float(summary["adamw_2bw"]["gap"]) == pytest.approx(0.5)
    assert summary["adamw_2bw+ef"]["unmitigated"] == "adamw_2bw"
    with open(out / "runs.csv") as f:
        assert len(list(csv.DictReader(f))) == 9
    verdicts = {c[0]: c[1] for c in claims(build_rows(load_runs(sweep_dir)))}
    # three seeds: a headline claim wants five (claims.HEADLINE_SEEDS)
    assert verdicts == {
        "Error feedback recovers most of the gap (adamw_2bw)": "inconclusive (3 seeds < 5)"
    }


def test_partial_sweep_says_what_is_missing(sweep_dir):
    make_run(sweep_dir, "muon_sync_s0", {"optim.name": "muon", **SYNC}, 0, 2.0)
    make_run(sweep_dir, "muon_sync_s1", {"optim.name": "muon", **SYNC}, 1, 0, finished=False)
    d = make_run(sweep_dir, "muon_2bw_s0", {"optim.name": "muon", **BW}, 0, 0, finished=False)
    write_error(d, "TrainingError: non-finite loss")
    planned = sweep_dir / "muon_2bw_s1"  # planned by the sweep, never started
    planned.mkdir()
    planned.joinpath(SPEC_FILE).write_text(
        json.dumps({"name": "muon_2bw_s1", "group": "muon_2bw", "seed": 1})
    )
    make_run(sweep_dir, "muon_2bw+ef_s0", {"optim.name": "muon", **EF}, 0, 2.1)

    rows = rows_by_label(sweep_dir)
    assert rows["muon_sync"].values == (2.0,) and math.isnan(rows["muon_sync"].std)
    assert rows["muon_2bw+ef"].gap_diff == pytest.approx(0.1)
    assert math.isnan(rows["muon_2bw+ef"].gap.p)  # one seed each: no test
    assert rows["muon_2bw+ef"].unmitigated is None  # its 2bw run failed
    md = (write_report(sweep_dir) / "report.md").read_text()
    assert "## Missing" in md
    assert "1 planned run(s) not started: muon_2bw_s1" in md
    assert "1 run(s) unfinished: muon_sync_s1 (step 2)" in md
    assert "failed: muon_2bw_s0: TrainingError: non-finite loss" in md
    assert "muon_2bw+ef: no finished unmitigated counterpart" in md
    assert "| muon_sync | 1/2 | 2.0000 ± - |" in md
    # the adamw rows are unchanged by the muon runs
    assert rows["adamw_2bw"].gap_diff == pytest.approx(0.5)


def test_labels_without_sweep_json_and_depth_matching(tmp_path):
    """Plain `stalepipe train` run directories: labels come from the keys that vary; a
    pipedream run at P stages is compared with the sync run (sync does not depend on P)."""
    root = tmp_path / "adhoc"
    for s in range(2):
        make_run(root, f"a{s}", SYNC, s, 2.0 + 0.1 * s)
        make_run(
            root,
            f"b{s}",
            {"delay.policy": "pipedream", "pipeline.num_stages": "2"},
            s,
            2.3 + 0.1 * s,
        )
        make_run(
            root,
            f"c{s}",
            {"delay.policy": "pipedream", "pipeline.num_stages": "3"},
            s,
            2.6 + 0.1 * s,
        )
    for p in root.glob("*/" + SPEC_FILE):
        p.unlink()
    rows = rows_by_label(root)
    assert set(rows) == {"sync num_stages=1", "pipedream num_stages=2", "pipedream num_stages=3"}
    assert rows["pipedream num_stages=3"].baseline is rows["sync num_stages=1"]
    assert rows["pipedream num_stages=3"].gap_diff == pytest.approx(0.6)
    verdict = claims(list(rows.values()))
    assert verdict[0][1] == "inconclusive (2 seeds < 3)" and "P=3: 0.6000" in verdict[0][2]


def _depth_runs(root, gaps: dict[int, float], seeds: int, noise: float) -> None:
    """sync, then pipedream at each P with the given mean gap (+- noise between seeds)."""
    for s in range(seeds):
        make_run(root, f"sync_s{s}", SYNC, s, 2.0)
        for p, gap in gaps.items():
            o = {"delay.policy": "pipedream", "pipeline.num_stages": str(p)}
            make_run(root, f"pd{p}_s{s}", o, s, 2.0 + gap + noise * (s - (seeds - 1) / 2))


@pytest.mark.parametrize(
    ("gaps", "seeds", "noise", "verdict"),
    [
        ({2: 0.1, 3: 0.5}, 3, 0.01, "reproduced"),
        (
            {2: 0.5, 3: 0.1},
            3,
            0.01,
            "not reproduced (measured at 0.33M parameters and 4.1k tokens)",
        ),
        ({3: 0.5}, 3, 0.01, "inconclusive (2 depths)"),  # P = 1 and 3: two points rank +-1
        ({2: 0.1, 3: 0.5}, 2, 0.01, "inconclusive (2 seeds < 3)"),
        ({2: 0.1, 3: 0.2}, 3, 0.5, "inconclusive (Holm p 0.560)"),  # within the seed noise
    ],
)
def test_depth_claim_needs_three_depths_and_a_real_deepest_gap(
    tmp_path, gaps, seeds, noise, verdict
):
    _depth_runs(tmp_path / "d", gaps, seeds, noise)
    (checked,) = claims(build_rows(load_runs(tmp_path / "d")))
    assert checked[1] == verdict


def test_report_errors(tmp_path):
    with pytest.raises(UserError, match="not a directory"):
        write_report(tmp_path / "nope")
    with pytest.raises(UserError, match="no run directories"):
        write_report(tmp_path)


def test_claims_optimizer_ratio_and_momentum(tmp_path):
    """AdamW-vs-Muon ratio at the default momentum (5 seeds: a headline claim); the momentum
    trend from beta1 rows."""
    root = tmp_path / "claims"
    for s in range(5):
        make_run(root, f"adamw_sync_s{s}", SYNC, s, 2.0 + 0.01 * s)
        make_run(root, f"adamw_2bw_s{s}", BW, s, 2.6 + 0.01 * s)
        make_run(root, f"muon_sync_s{s}", {"optim.name": "muon", **SYNC}, s, 2.0 + 0.01 * s)
        make_run(root, f"muon_2bw_s{s}", {"optim.name": "muon", **BW}, s, 2.1 + 0.01 * s)
        for b1, gap in [("0.8", 0.8), ("0.95", 0.3), ("0.98", 0.1)]:
            o = {"optim.beta1": b1}
            make_run(root, f"adamw_b1{b1}_sync_s{s}", {**o, **SYNC}, s, 2.0 + 0.01 * s)
            make_run(root, f"adamw_b1{b1}_2bw_s{s}", {**o, **BW}, s, 2.0 + gap + 0.01 * s)
        for bs in ("8", "32"):  # the batch-size grid: not the main rows
            o = {"train.batch_size": bs}
            make_run(root, f"adamw_bs{bs}_sync_s{s}", {**o, **SYNC}, s, 2.0 + 0.01 * s)
            make_run(root, f"adamw_bs{bs}_2bw_s{s}", {**o, **BW}, s, 2.9 + 0.01 * s)
    checked = {c[0]: c for c in claims(build_rows(load_runs(root)))}
    opt = checked["AdamW's gap (2bw) is much larger than Muon's"]
    assert opt[1] == "reproduced" and "ratio 6.0x" in opt[2]  # 0.6 / 0.1
    mom = checked["Higher momentum shrinks the gap (adamw 2bw)"]
    assert mom[1] == "reproduced" and "Spearman rho -1.00" in mom[2]
    assert "beta1 0.9: 0.6000" in mom[2]


def test_optimizer_ratio_needs_a_significant_difference(tmp_path):
    """A large ratio built on AdamW gaps the seeds do not support is inconclusive: per seed the
    AdamW gap minus Muon's is 0.6, -0.3, 0.8, -0.2, 1.1 (mean 0.4, paired t = 1.44, p 0.22)."""
    root = tmp_path / "noisy"
    adam_gaps = [0.7, -0.2, 0.9, -0.1, 1.2]  # mean 0.5: ratio 5.0x against Muon's 0.1
    for s, (sync, bw) in enumerate((2.0, 2.0 + g) for g in adam_gaps):
        make_run(root, f"adamw_sync_s{s}", SYNC, s, sync)
        make_run(root, f"adamw_2bw_s{s}", BW, s, bw)
        make_run(root, f"muon_sync_s{s}", {"optim.name": "muon", **SYNC}, s, 2.0 + 0.01 * s)
        make_run(root, f"muon_2bw_s{s}", {"optim.name": "muon", **BW}, s, 2.1 + 0.01 * s)
    checked = {c[0]: c for c in claims(build_rows(load_runs(root)))}
    verdict, evidence = checked["AdamW's gap (2bw) is much larger than Muon's"][1:3]
    assert verdict.startswith("inconclusive (Holm p 0.2") and "ratio 5.0x" in evidence


def test_momentum_verdict_sees_a_drifting_baseline(tmp_path):
    """Gaps that shrink because the synchronous baseline gets worse are only 'partly'."""
    root = tmp_path / "drift"
    for s in range(3):
        for b1, sync, gap in [("0.9", 2.0, 0.6), ("0.95", 2.5, 0.3), ("0.98", 3.0, 0.1)]:
            o = {"optim.beta1": b1}
            make_run(root, f"adamw_b1{b1}_sync_s{s}", {**o, **SYNC}, s, sync + 0.01 * s)
            make_run(root, f"adamw_b1{b1}_2bw_s{s}", {**o, **BW}, s, sync + gap + 0.01 * s)
    checked = {c[0]: c for c in claims(build_rows(load_runs(root)))}
    verdict, evidence = checked["Higher momentum shrinks the gap (adamw 2bw)"][1:3]
    assert verdict == "partly (sync moves more than the gap)" and "sync 2.0100-3.0100" in evidence


def test_momentum_reads_each_beta1_at_its_best_sync_lr(tmp_path):
    """With an LR axis, each beta1's gap is taken at the LR best on sync (over the seeds every
    LR finished), not split into one series per LR; a beta1 whose best LR has no delayed run
    is left out rather than read at a worse LR."""
    root = tmp_path / "tuned"
    # beta1 -> {lr: sync loss}; the 2bw gap is 0.1 at the best LR and 0.9 elsewhere
    grid = {"0.8": {"0.001": 2.3, "0.003": 2.0}, "0.9": {"0.001": 2.1, "0.003": 2.2},
            "0.95": {"0.001": 2.05, "0.003": 2.4}, "0.98": {"0.001": 2.5, "0.003": 2.1}}  # fmt: skip
    best = {b: min(lrs, key=lrs.get) for b, lrs in grid.items()}
    gap = {"0.8": 0.5, "0.9": 0.3, "0.95": 0.1}
    for b1, lrs in grid.items():
        for lr, sync in lrs.items():
            o = {"optim.beta1": b1, "optim.lr": lr}
            seeds = range(3) if lr == best[b1] else range(1)  # the tuning LRs: seed 0 only
            for s in seeds:
                make_run(root, f"adamw_b1{b1}_lr{lr}_sync_s{s}", {**o, **SYNC}, s, sync + 0.01 * s)
                if b1 == "0.98" and lr == best[b1]:
                    continue  # its best LR's delayed arm is missing
                g = gap[b1] if lr == best[b1] else 0.9
                make_run(root, f"adamw_b1{b1}_lr{lr}_2bw_s{s}", {**o, **BW}, s, sync + g + 0.01 * s)
    rows = build_rows(load_runs(root))
    checked = {c[0]: c for c in claims(rows)}
    verdict, evidence = checked["Higher momentum shrinks the gap (adamw 2bw)"][1:3]
    assert "beta1 0.8 (lr 0.003): 0.5000" in evidence
    assert "beta1 0.9 (lr 0.001): 0.3000" in evidence
    assert "beta1 0.95 (lr 0.001): 0.1000" in evidence
    assert "0.98" not in evidence and "Spearman rho -1.00" in evidence
    assert len([c for c in checked if c.startswith("Higher momentum")]) == 1


def test_gap_plots_over_batch_size_weight_decay_and_lr(tmp_path):
    """The hparams study's one-at-a-time grids each give a gap series over their axis (the
    x1 point shared), and the report draws them."""
    from stalepipe.lab.analysis import plots

    root = tmp_path / "hparams"
    points = {"train.batch_size": ["2", "4", "8"], "optim.weight_decay": ["0", "0.3"],
              "optim.lr": ["0.003", "0.01"]}  # fmt: skip
    for s in range(2):
        make_run(root, f"base_sync_s{s}", {**SYNC}, s, 2.0 + 0.01 * s)
        make_run(root, f"base_2bw_s{s}", {**BW}, s, 2.3 + 0.01 * s)
        for key, values in points.items():
            for i, v in enumerate(values):
                o = {key: v}
                make_run(root, f"{key}{v}_sync_s{s}", {**o, **SYNC}, s, 2.0 + 0.01 * s)
                make_run(root, f"{key}{v}_2bw_s{s}", {**o, **BW}, s, 2.1 + 0.1 * i + 0.01 * s)
    rows = build_rows(load_runs(root))
    bs = plots.gap_series(rows, "batch_size")
    assert list(bs) == ["adamw 2bw"]
    assert [(x, round(r.gap_diff, 4)) for x, r in bs["adamw 2bw"]] == [
        (2.0, 0.1), (4.0, 0.2), (8.0, 0.3), (16.0, 0.3)]  # fmt: skip  # 16: the base config
    assert [x for x, _ in plots.gap_series(rows, "weight_decay")["adamw 2bw"]] == [0.0, 0.1, 0.3]
    out = write_report(root)
    names = {p.name for p in out.iterdir()}
    assert {"gap_vs_batch_size.png", "gap_vs_weight_decay.png", "gap_vs_lr.png"} <= names
    assert "## Gap vs sequences per step" in (out / "report.md").read_text()


def test_the_delay_series_reads_2bw_as_one_step(tmp_path):
    """fixed:N rows give the gap over the delay; 2bw (tau 1 on every stage) is its N = 1, and
    a fixed:1 run beside it stands for N = 1 once; PipeDream (tau by stage) is not a point."""
    from stalepipe.lab.analysis import plots

    root = tmp_path / "delay"
    for s in range(2):
        make_run(root, f"adamw_sync_s{s}", SYNC, s, 2.0 + 0.01 * s)
        make_run(root, f"adamw_2bw_s{s}", BW, s, 2.2 + 0.01 * s)
        for n in (2, 4):
            make_run(root, f"adamw_fixed{n}_s{s}", {"delay.policy": f"fixed:{n}"}, s,
                     2.0 + 0.1 * n + 0.01 * s)  # fmt: skip
        make_run(root, f"adamw_pd_s{s}", {"delay.policy": "pipedream",
                 "pipeline.num_stages": "2"}, s, 2.9)  # fmt: skip
    series = plots.gap_series(build_rows(load_runs(root)), "delay")
    assert list(series) == ["adamw"]
    assert [(x, r.policy, round(r.gap_diff, 4)) for x, r in series["adamw"]] == [
        (1.0, "2bw", 0.2), (2.0, "fixed:2", 0.2), (4.0, "fixed:4", 0.4)]  # fmt: skip
    for s in range(2):
        make_run(root, f"adamw_fixed1_s{s}", {"delay.policy": "fixed:1"}, s, 2.2 + 0.01 * s)
    series = plots.gap_series(build_rows(load_runs(root)), "delay")
    assert [(x, r.policy) for x, r in series["adamw"]] == [
        (1.0, "fixed:1"), (2.0, "fixed:2"), (4.0, "fixed:4")]  # fmt: skip
    assert "gap_vs_delay.png" in {p.name for p in write_report(root).iterdir()}


@pytest.mark.parametrize(
    ("gaps", "seeds", "verdict"),
    [
        ({"2bw": 0.1, "fixed:2": 0.3, "fixed:4": 0.6}, 3, "reproduced"),
        (
            {"2bw": 0.6, "fixed:2": 0.3, "fixed:4": 0.1},
            3,
            "not reproduced (measured at 0.33M parameters and 4.1k tokens)",
        ),
        ({"2bw": 0.1, "fixed:4": 0.6}, 3, "inconclusive (2 delays)"),
        ({"2bw": 0.1, "fixed:2": 0.3, "fixed:4": 0.6}, 2, "inconclusive (2 seeds < 3)"),
    ],
)
def test_delay_claim_reads_2bw_as_n_1_and_needs_three_delays(tmp_path, gaps, seeds, verdict):
    root = tmp_path / "delay"
    for s in range(seeds):
        make_run(root, f"sync_s{s}", SYNC, s, 2.0 + 0.01 * s)
        for policy, gap in gaps.items():
            name = policy.replace(":", "")
            make_run(root, f"{name}_s{s}", {"delay.policy": policy}, s, 2.0 + gap + 0.01 * s)
    (checked,) = [c for c in claims(build_rows(load_runs(root))) if "longer delay" in c[0]]
    assert checked[1] == verdict
    assert checked[2].startswith("N=1: ")  # 2bw is the series' N = 1


def test_best_row_compares_on_the_seeds_all_rows_share(tmp_path):
    """A row is not chosen for the luck of seeds the others lack."""
    root = tmp_path / "best"
    for s, v in enumerate([2.0, 1.0, 1.0]):  # seed 0 worse, seeds 1-2 lucky
        make_run(root, f"a_s{s}", {**SYNC, "optim.lr": "0.001"}, s, v)
    make_run(root, "b_s0", {**SYNC, "optim.lr": "0.003"}, 0, 1.5)
    rows = build_rows(load_runs(root))
    chosen = best_row(rows)
    assert chosen.config["optim.lr"] == 0.003


def test_report_checks_every_claim_a_study_declares_in_order(monkeypatch):
    """The claims table runs each claim some study declares once, in the order the studies,
    listed by `Study.order`, first declare them; each claim lives in the module of a study
    that declares it (the study that owns it; others import it)."""
    import sys

    from stalepipe.lab.analysis import report

    assert [s.order for s in STUDIES.values()] == sorted(s.order for s in STUDIES.values())
    first = [c for s in STUDIES.values() for c in s.claims]
    assert declared_claims() == sorted(set(first), key=first.index)
    for check in declared_claims():
        owner = sys.modules[check.__module__]
        owned = getattr(owner, "STUDY", ())
        owned = owned if isinstance(owned, tuple) else (owned,)
        assert any(check in s.claims for s in owned), f"{check.__name__} not in its module's study"
    calls = []
    checks = [lambda rows, n=n: calls.append(n) or [] for n in range(3)]
    monkeypatch.setattr(report, "declared_claims", lambda: checks)
    assert report.claims([]) == [] and calls == [0, 1, 2]


@pytest.mark.slow
def test_the_claims_table_keeps_the_order_of_a_committed_report():
    """The committed optimizers-regime report's claims, regenerated from its run records, come
    in the order the committed table lists them (~20 s: it reads every run)."""
    root = Path(__file__).parents[2] / "docs" / "results" / "optimizers-regime"
    table = (root / "report" / "report.md").read_text().split("qualitative claims", 1)[1]
    committed = [
        line.split(" | ")[0].removeprefix("| ")
        for line in table.split("\n\n## ", 1)[0].splitlines()
        if line.startswith("| ") and not line.startswith(("| claim |", "| ---"))
    ]
    assert [c.claim for c in claims(build_rows(load_runs(root)))] == committed


@pytest.mark.parametrize("check", declared_claims(), ids=lambda f: f.__name__)
def test_a_claim_without_its_configurations_is_left_out(check, sweep_dir):
    assert check([]) == []
    rows = build_rows(load_runs(sweep_dir))  # adamw only: no Muon, momentum or depth series
    expected = 1 if check.__name__ == "claim_ef_recovers_gap" else 0
    assert len(check(rows)) == expected


def test_a_claim_with_a_paper_size_labels_direction_and_size_apart():
    """EF's share: the direction (> half) and the paper's size (AdamW 85-90 %, Muon 50-70 %)
    are two answers. The size by the rule registered before the size ladder (issue 51): the
    paper's range inside the interval (or the interval inside it) is consistent, a miss is not
    reproduced with its scale, a part or an interval over SIZE_WIDTH_FACTOR x the range's width
    is inconclusive. The size is read even where the direction's test is not significant."""
    from stalepipe.lab.analysis.claims import SIZE_WIDTH_FACTOR, Finding, label, paper_size

    at = "measured at 0.43M parameters and 2.5M tokens"
    assert paper_size("adamw", 0.57, 0.69, at) == (
        f"not reproduced (interval misses the paper's 85%-90%; {at})"
    )
    assert paper_size("muon", 0.48, 0.75) == "consistent with the paper's 50%-70%"
    assert paper_size("muon", 0.55, 0.65) == "consistent with the paper's 50%-70%"
    assert paper_size("muon", 0.53, 0.76).startswith("inconclusive (interval holds only part")
    assert SIZE_WIDTH_FACTOR == 2  # [0.40, 0.80] is 2x the range: still read; 2.1x is not
    assert paper_size("muon", 0.40, 0.80) == "consistent with the paper's 50%-70%"
    assert paper_size("muon", 0.29, 0.71).startswith("inconclusive (interval 2.1x as wide")
    assert paper_size("muon", -0.60, 0.86).startswith("inconclusive (interval 7.3x as wide")
    assert paper_size("muon", math.nan, math.nan).startswith("inconclusive")
    assert paper_size("lion", 0.1, 0.2) == ""
    f = Finding("EF", True, 1e-4, "63%", 5, need=5, size=paper_size("adamw", 0.57, 0.69, at))
    (claim,) = label([f])
    assert claim.verdict.startswith("direction reproduced; size not reproduced")
    few = f._replace(seeds=3)
    assert label([few])[0].verdict == "inconclusive (3 seeds < 5)"  # no size without a verdict
    muon = Finding("EF", True, 0.067, "62%", 5, need=5, size=paper_size("muon", 0.48, 0.75))
    assert label([muon, muon._replace(p=0.1)])[0].verdict == (
        "direction inconclusive (Holm p 0.134); size consistent with the paper's 50%-70%"
    )


def test_a_confounded_miss_is_inconclusive_and_a_miss_states_its_scale():
    """Issue 51: a claim whose effect misses but whose design names a confound (momentum: the LR
    retuned per beta1) reads inconclusive, not "not reproduced"; a plain miss states the scale
    it was measured at; a confounded hit is at most partly."""
    from stalepipe.lab.analysis.claims import Finding, label

    at = "measured at 0.43M parameters and 2.5M tokens"
    miss = Finding("m", False, 1e-4, "e", 3, scale=at)
    assert label([miss])[0].verdict == f"not reproduced ({at})"
    confounded = miss._replace(confound="the LR moves with beta1")
    assert label([confounded])[0].verdict == (
        "inconclusive (misses the claim, confounded: the LR moves with beta1)"
    )
    hit = confounded._replace(holds=True, partly="(a) plateau exit at 30% > 10% for x")
    assert label([hit])[0].verdict == (
        "partly ((a) plateau exit at 30% > 10% for x; the LR moves with beta1)"
    )
