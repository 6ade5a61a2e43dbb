"""`stalepipe verdict`: the time-to-target arithmetic and its rule, end to end on a fixture
sweep with known token taxes and on a tiny trained sweep, measured costs, and bad input."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re

import pytest

from stalepipe.cli import main
from stalepipe.lab.analysis import overhead as oh
from stalepipe.lab.analysis.results import build_rows, load_runs
from stalepipe.lab.verdict.command import call, judge_sweep, time_to_target
from stalepipe.lab.verdict.rule import Ratio
from stalepipe.lab.verdict.throughput import load_costs, simulated

SIM = ["--model", "smollm-135m", "--stages", "4", "--microbatches", "8"]


def tax(*medians: float) -> oh.Overhead:
    pairs = [oh.PairOverhead(s, (3.0, 2.0), (3.0, 2.0), (1.0, 2.0), (m, 2 * m), (m, m), m,
                             False, 0.01, m) for s, m in enumerate(medians)]  # fmt: skip
    return oh.summarize_pairs(pairs)


def test_time_to_target_divides_the_overhead_and_its_interval():
    o = tax(1.2, 1.3, 1.4)
    r = time_to_target(o, 1.25)
    assert r.value == pytest.approx(o.estimate / 1.25)
    assert (r.low, r.high) == (pytest.approx(o.ci_low / 1.25), pytest.approx(o.ci_high / 1.25))
    floor = oh.summarize_pairs([dataclasses.replace(o.pairs[0], floor=True, median=math.nan)])
    assert math.isnan(time_to_target(floor, 1.25).value)


def test_call_follows_the_printed_rule():
    o3 = tax(1.2, 1.3, 1.4)
    assert call(o3, Ratio(0.8, 0.7, 0.9)) == "async sooner"
    assert call(o3, Ratio(1.2, 1.1, 1.3)) == "sync sooner"
    assert call(o3, Ratio(1.0, 0.9, 1.1)) == "too close to call (interval holds 1)"
    assert call(tax(1.1, 1.2), Ratio(0.5, 0.4, 0.6)) == "inconclusive (2 seeds < 3)"
    nan = Ratio(math.nan, math.nan, math.nan)
    floor = oh.summarize_pairs([dataclasses.replace(p, floor=True) for p in o3.pairs])
    assert call(floor, nan) == "sync sooner (quality floor)"
    one = oh.summarize_pairs([dataclasses.replace(o3.pairs[0], floor=True)])
    assert call(one, nan) == "inconclusive (1 seed < 3)"  # the seed rule comes first


def test_a_bound_speaks_for_the_arm_only_when_every_seed_is_short():
    """Four seeds reach sync's final loss at 1.05x, one is short at 2x: the arm's multiplier
    is at least 1.19x, not 2x, so no 'sync sooner' from the bound (speedup 1.3); with every
    seed short at 2x it is."""
    from stalepipe.lab.analysis.targets import SeedTarget, TargetOverhead

    def seed(s, reached):
        return SeedTarget(s, 2.0, 100.0, 105.0 if reached else math.nan, 2.0, False)

    some = TargetOverhead("final", tuple(seed(s, s < 4) for s in range(5)))
    nan = Ratio(math.nan, math.nan, math.nan)
    assert some.describe() == "> 2.00x (1/5 seeds short; 1.05x where reached)"
    assert call(some, nan, 1.3).startswith("inconclusive (> 2.00x (1/5 seeds short")
    every = TargetOverhead("final", tuple(seed(s, False) for s in range(5)))
    assert call(every, nan, 1.3) == "sync sooner (short of sync's final loss at 2.00x its tokens)"
    assert call(every, nan, 2.5).startswith("inconclusive (> 2.00x (5/5 seeds short)")


def test_verdict_end_to_end_on_known_taxes(curve_sweep, capsys):
    assert main(["verdict", str(curve_sweep), *SIM, "--verbose"]) == 0
    text = capsys.readouterr().out
    assert main(["report", str(curve_sweep)]) == 0  # the same overhead in the report's CSV
    tp = simulated("smollm-135m", "h100", 4, 8)
    best = tp.best_sync()
    speedup = tp.get("2bw").tokens_per_s / best.tokens_per_s
    assert speedup > 1  # no flush: 2bw is faster than every synchronous schedule
    out = curve_sweep / "verdict"
    with open(out / "verdict.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["best_sync"] == "True"]
    by = {r["configuration"]: r for r in rows}
    assert set(by) == {"adamw_2bw", "adamw_2bw+ef", "muon_2bw"}
    bw = by["adamw_2bw"]
    assert float(bw["token_overhead"]) == pytest.approx(1.3, rel=0.03)
    assert float(bw["time_to_target"]) == pytest.approx(float(bw["token_overhead"]) / speedup)
    assert float(bw["time_to_target_ci_low"]) < float(bw["time_to_target"])
    assert bw["sync_schedule"] == best.name and bw["throughput_source"] == "simulated"
    assert float(by["adamw_2bw+ef"]["token_overhead"]) == pytest.approx(1.1, rel=0.03)
    # Muon's delayed arm stalls above sync's final loss: short of it at sync's budget (a bound),
    # and a quality floor over the band, which is what the verdict calls
    assert by["muon_2bw"]["token_overhead_status"] == "short"
    assert float(by["muon_2bw"]["token_overhead"]) == pytest.approx(1.0)
    assert by["muon_2bw"]["band_token_overhead_status"] == "floor"
    assert by["muon_2bw"]["verdict"] == "sync sooner (quality floor)"
    with open(curve_sweep / "report" / "summary.csv") as f:
        summary = {r["configuration"]: r for r in csv.DictReader(f)}
    assert float(summary["adamw_2bw"]["token_overhead_mean_curve"]) == pytest.approx(1.3, rel=0.03)
    assert summary["muon_2bw"]["token_overhead_per_seed"] == "floor floor floor"
    assert (
        summary["muon_2bw"]["floor_seeds"] == "3" and summary["adamw_sync"]["token_overhead"] == ""
    )
    # the printed tables: inputs say what is measured and what simulated, the rule is printed
    assert "token overhead: measured" in text and "throughput and memory: simulated" in text
    assert f"{best.name} (best sync)" in text and "peak mem/rank GB" in text
    assert "floor (gap +0.2962; 1.00x where reached)" in text and text.count("rule: ") == 1
    assert (out / "verdict.png").stat().st_size > 1000 and (out / "verdict.md").is_file()


def test_sync_windows_run_at_the_flushed_rate(curve_sweep, curve_run):
    curve_run(curve_sweep, "adamw_2bw+cool_s0",
                    {"delay.policy": "2bw", "delay.sync_cooldown": "0.25"}, 0, stretch=1.2)  # fmt: skip
    tp = simulated("smollm-135m", "h100", 4, 8)
    verdicts, skipped = judge_sweep(build_rows(load_runs(curve_sweep)), tp)
    v = next(v for v in verdicts if v.label == "adamw_2bw+cool")
    assert v.sync_window_share == pytest.approx(0.25) and not skipped
    rate = 1 / (0.25 / tp.window_tokens_per_s + 0.75 / tp.get("2bw").tokens_per_s)
    assert v.async_tokens_per_s == pytest.approx(rate)
    assert tp.window_tokens_per_s < v.async_tokens_per_s < tp.get("2bw").tokens_per_s


def test_measured_costs_json_and_csv(curve_sweep, tmp_path, capsys):
    doc = {"source": "benchmark, P=2, m=8", "num_stages": 2, "schedules": [
        {"name": "1f1b", "tokens_per_s": 1000},
        {"name": "torch-zbv", "policy": "sync", "tokens_per_s": 1100, "peak_memory_gb": 1.5},
        {"name": "2bw", "tokens_per_s": 1210, "peak_memory_gb": [1.2, 1.0]},
    ]}  # fmt: skip
    (tmp_path / "c.json").write_text(json.dumps(doc))
    assert (
        main(["verdict", str(curve_sweep), "--costs", str(tmp_path / "c.json"), "--verbose"]) == 0
    )
    text = capsys.readouterr().out
    assert "throughput and memory: measured" in text and "torch-zbv (best sync)" in text
    with open(curve_sweep / "verdict" / "verdict.csv") as f:
        r = next(r for r in csv.DictReader(f) if r["configuration"] == "adamw_2bw"
                 and r["best_sync"] == "True")  # fmt: skip
    assert float(r["time_to_target"]) == pytest.approx(float(r["token_overhead"]) / 1.1)
    assert r["async_peak_memory_gb"] == "1.200 1.000" and r["throughput_source"] == "measured"
    (tmp_path / "c.csv").write_text("name,policy,tokens_per_s,peak_memory_gb\n1f1b,,1000,\n"
                                    "2bw,,1210,1.2 1.0\n")  # fmt: skip
    tp = load_costs(tmp_path / "c.csv")
    assert tp.best_sync().name == "1f1b" and tp.get("2bw").peak_memory == (1.2e9, 1.0e9)


@pytest.mark.parametrize(
    "args, message",
    [
        (["MISSING", *SIM], "is not a directory"),
        (["EMPTY", *SIM], "holds no run directories"),
        (["NOSYNC", *SIM], "no finished synchronous run"),
        (["SWEEP", "--model", "smollm-999m"], "unknown --model 'smollm-999m'"),
        (["SWEEP", *SIM, "--device", "h900"], "device"),
        (["SWEEP"], "give --cluster PRESET"),
        (["SWEEP", *SIM, "--costs", "c.json"], "one of the two"),
        (["SWEEP", "--costs", "NOFILE.json"], "no such file"),
        (["SWEEP", "--costs", "BAD"], "cannot read it"),
        (["SWEEP", "--costs", "ONLYSYNC"], "needs an asynchronous schedule"),
        (["SWEEP", "--costs", "UNKNOWN"], "give its policy"),
        (["SWEEP", *SIM[:2], "--stages", "0"], "must be >= 1"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    args, message, curve_sweep, curve_run, tmp_path, capsys
):
    (tmp_path / "EMPTY").mkdir()
    curve_run(tmp_path / "NOSYNC", "a_2bw_s0", {"delay.policy": "2bw"}, 0, stretch=1.2)
    (tmp_path / "BAD.json").write_text("{not json")
    (tmp_path / "ONLYSYNC.json").write_text(json.dumps({"schedules": [
        {"name": "1f1b", "tokens_per_s": 1}]}))  # fmt: skip
    (tmp_path / "UNKNOWN.csv").write_text("name,tokens_per_s\nmine,5\n2bw,6\n")
    files = {"SWEEP": curve_sweep, "BAD": tmp_path / "BAD.json",
             "ONLYSYNC": tmp_path / "ONLYSYNC.json", "UNKNOWN": tmp_path / "UNKNOWN.csv"}  # fmt: skip
    argv = [str(files.get(a, tmp_path / a if a.isupper() else a)) for a in args]
    assert main(["verdict", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stalepipe: error: ") and "\n" not in err and message in err, err
    assert not (curve_sweep / "verdict").exists() and not (tmp_path / "NOSYNC" / "verdict").exists()


def test_verdict_on_a_tiny_trained_sweep(tiny_config, tmp_path, capsys):
    """A real sweep: cpu-sized sync and 2bw runs of the tiny model, 2 seeds, through the CLI."""
    from stalepipe.lab.sweeps.grid import expand
    from stalepipe.lab.sweeps.sweep import run_sweep
    from stalepipe.training.launch import task as trainer

    base = dataclasses.replace(
        tiny_config, train=dataclasses.replace(tiny_config.train, num_steps=24, eval_every=3)
    )
    specs = expand([[("sync", {"delay.policy": "sync"}), ("2bw", {"delay.policy": "2bw"})]],
                   seeds=2)  # fmt: skip
    res = run_sweep(trainer, specs, base, tmp_path / "tiny", log=lambda m: None)
    assert len(res.ran) == 4 and not res.failed
    assert main(["verdict", str(tmp_path / "tiny"), *SIM, "--device", "a100", "--verbose"]) == 0
    text = capsys.readouterr().out
    assert "NVIDIA A100" in text and "4 finished runs" in text
    line = next(x for x in text.splitlines() if x.startswith("2bw "))
    assert "zb-h1" in line or "1f1b" in line or "gpipe" in line
    with open(tmp_path / "tiny" / "verdict" / "verdict.csv") as f:
        assert {r["seeds"] for r in csv.DictReader(f)} == {"2"}


def test_best_sync_is_the_fastest_that_fits():
    from stalepipe.lab.verdict.throughput import ScheduleThroughput as T
    from stalepipe.lab.verdict.throughput import Throughputs

    rows = [T("gpipe", "sync", 10.0, fits=True), T("zb-h1", "sync", 20.0, fits=False),
            T("1f1b", "sync", 15.0, fits=True), T("2bw", "2bw", 30.0, fits=True),
            T("zb-v", "sync", math.nan, refused="needs m >= P")]  # fmt: skip
    tp = Throughputs(rows, 10.0, 4, [], "")
    assert tp.best_sync().name == "1f1b"
    assert [s.name for s in tp.sync()] == ["gpipe", "zb-h1", "1f1b"]
    assert not tp.has("zb-v") and tp.why("zb-v") == "needs m >= P"
    # the simulator's profile has a capacity: every schedule of a 135M model fits an H100
    assert all(s.fits for s in simulated("smollm-135m", "h100", 4, 8).sync())


def test_policies_without_a_transferable_schedule_are_listed(curve_sweep, curve_run, capsys):
    """pipedream's delay grows with P: its P=2 runs say nothing about P=4; fixed:N has no
    pipeline schedule. Both are named under 'no verdict', the others still judged."""
    for s in range(2):
        curve_run(curve_sweep, f"adamw_pd_s{s}",
                  {"delay.policy": "pipedream", "pipeline.num_stages": "2"}, s, stretch=1.2)  # fmt: skip
        curve_run(curve_sweep, f"adamw_f2_s{s}", {"delay.policy": "fixed:2"}, s, stretch=1.2)
    assert main(["verdict", str(curve_sweep), *SIM, "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "no verdict: adamw_pd: pipedream's delay depends on P; its runs have P=2" in out
    assert "no verdict: adamw_f2: no pipeline schedule realises delay.policy fixed:2" in out
    assert "adamw_2bw+ef " in out


def test_the_band_says_sooner_where_sync_final_loss_says_later(tmp_path, curve_run):
    """A delayed arm that keeps pace over most of the band (a 1.05x tax) but stalls just above
    sync's final loss, and whose complete runs planned longer reach it at about 1.5x sync's
    tokens: the band's median reads a speed-up, the verdict (at sync's final loss, read from
    the runs' final losses) reads 'sync sooner'."""
    root = tmp_path / "stall"
    final = 2.0 + 3.0 * math.exp(-200 / 30.0)  # sync's final val loss (conftest.sync_loss)
    for s in range(3):
        curve_run(root, f"sync_s{s}", {"delay.policy": "sync"}, s)
        curve_run(root, f"2bw_s{s}", {"delay.policy": "2bw"}, s, stretch=1.05, floor=final + 1e-3)
        for f in (1.35, 1.5, 1.75):
            long = {"delay.policy": "2bw", "train.warmup_steps": str(round(20 * f))}
            curve_run(
                root, f"x{f:g}_2bw_s{s}", long, s, stretch=1.5 + 0.01 * s, steps=round(200 * f)
            )
    # the rule at sync's final loss apart from the overhead's size transfer (no target size)
    tp = dataclasses.replace(simulated("smollm-135m", "h100", 4, 8), target_params=0)
    (v,), skipped = judge_sweep(build_rows(load_runs(root)), tp)
    assert not skipped and v.overhead.status == "tax" and v.overhead.estimate < v.speedup
    assert time_to_target(v.overhead, v.speedup).high < 1  # the band alone: async sooner
    assert v.target.interval()[0] == pytest.approx(1.51, rel=0.02) and v.verdict == "sync sooner"


def test_the_default_output_is_a_decision_block(curve_sweep, capsys):
    """Issue 40: by default `stalepipe verdict` prints at most ~20 lines, none over 120
    characters: per configuration its verdict, time ratio with its interval, overhead and the
    model it was measured on; the best synchronous configuration; the flip point; the caveat."""
    assert main(["verdict", str(curve_sweep), *SIM]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 22 and max(len(ln) for ln in lines[:-2]) <= 120, lines
    assert lines[0].startswith("decision: ") and lines[1].startswith("best synchronous: ")
    ef = next(ln for ln in lines if ln.startswith("adamw_2bw+ef "))
    assert "x [" in ef and "@ " in ef and re.search(r"\b3  \d", ef)
    assert any("makes async sooner" in ln for ln in lines)
    # one label for the time-to-target interval: a bound over the seeds' CI and the overhead's
    # transfer from the fixture's tiny model to smollm-135m, named as such (issue 52, item 4)
    assert "time to target (bound)" in lines[2]
    assert any(
        ln.startswith("bound: worst case of the seeds' 95% CI, size transfer") for ln in lines
    )
    assert any(ln.startswith("size transfer of the overhead ") for ln in lines)
    assert lines[-2].startswith("tables in ") and "verdict.md" in lines[-1]


def test_a_long_block_lists_fewer_configurations_and_cuts_no_line(curve_sweep, capsys, monkeypatch):
    """Issue 52: where the wrapped block would pass MAX_LINES it lists fewer configurations (the
    rest counted), and never cuts what follows the table: the optimizers-regime block on h100-ib
    lost its 'bound:' line mid-sentence when the block was cut at 20 wrapped lines."""
    from stalepipe.lab.verdict import decision

    def block() -> list[str]:
        assert main(["verdict", str(curve_sweep), *SIM]) == 0
        return capsys.readouterr().out.splitlines()[:-2]  # less the 'tables in' lines

    full = block()
    rows = [ln for ln in full if re.match(r"(adamw|muon)_2bw\S* ", ln)]
    assert len(rows) == 3 and not any("more configuration" in ln for ln in full), full
    monkeypatch.setattr(decision, "MAX_LINES", len(full) - 1)
    short = block()
    assert [ln for ln in short if re.match(r"(adamw|muon)_2bw\S* ", ln)] == rows[:1], short
    assert "... 2 more configuration(s) (fewer seeds, or past the first 1)" in short
    assert len(short) == len(full) - 1 and short[-2:] == full[-2:], short
    assert short[-1].startswith("size transfer of the overhead "), short
    monkeypatch.setattr(decision, "MAX_LINES", len(full) - 2)  # one row cannot fit it: kept
    assert block() == short


def test_a_lengths_sweep_decides_on_its_headline_rows(curve_sweep, curve_run, capsys):
    """With sync run at the longer lengths too (`sweep --lengths`), each longer delayed run has
    a like-for-like baseline and a verdict of its own: those go to the tables, counted in one
    line; the decision block lists the configurations, read over all their lengths."""
    for s in range(3):
        curve_run(curve_sweep, f"adamw_x1.5_sync_s{s}",
                  {"delay.policy": "sync", "train.warmup_steps": "30"}, s, steps=300)  # fmt: skip
    out_dir = curve_sweep / "verdict"
    assert main(["verdict", str(curve_sweep), *SIM]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(ln.startswith("adamw_2bw+ef ") for ln in lines)
    assert not any(ln.startswith("adamw_x1.5") for ln in lines), lines
    counted = next(ln for ln in lines if "longer lengths" in ln)
    assert counted.startswith("2 longer lengths judged against sync at the same length (")
    calls = re.findall(r"(\d+) (sync sooner|async sooner|too close to call|inconclusive)", counted)
    assert sum(int(n) for n, _ in calls) == 2, counted
    table = (out_dir / "verdict.md").read_text()
    assert "adamw_x1.5_2bw+ef" in table and "adamw_x1.5_sync" in table
    # the cluster map draws the configurations too, not their longer lengths
    from stalepipe.lab.verdict.cluster import headline

    verdicts, _ = judge_sweep(
        build_rows(load_runs(curve_sweep)), simulated("smollm-135m", "h100", 4, 8)
    )
    assert sum(v.at_length for v in verdicts) == 2
    assert headline(verdicts) and not any(v.at_length for v in headline(verdicts))


def test_a_given_overhead_is_judged_against_the_same_best_sync(curve_sweep, capsys):
    """`--overhead X,LOW,HIGH@SIZE` (the size ladder's fit at the target model, say): its time
    ratio against the best synchronous configuration and the call; a malformed one is refused
    before any work, one line, exit 2."""
    assert main(["verdict", str(curve_sweep), *SIM, "--overhead", "1.05,1.01,1.10@360M"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("given overhead"))
    edge = float(re.search(r"edge over it (\S+)x", out).group(1))
    ratio = float(re.search(r"time to target (\S+)x", line).group(1))
    assert "1.050x [1.010, 1.100] @ 360M" in line and ratio == pytest.approx(1.05 / edge, abs=0.01)
    want = "async sooner" if 1.10 / edge < 1 else "sync sooner" if 1.01 / edge > 1 else "too close"
    assert line.endswith(want) or want in line
    for bad in ("1.2,1.3,1.1", "fast", "1.1,1.0"):
        assert main(["verdict", str(curve_sweep), *SIM, "--overhead", bad]) == 2
        err = capsys.readouterr().err
        assert "X,LOW,HIGH" in err and len(err.strip().splitlines()) == 1


def test_an_overhead_that_says_nothing_is_not_called_a_near_tie(curve_sweep, capsys):
    """An interval that holds 1 and leaves [x / 10, 10 x] (the size ladder's fit with one degree
    of freedom reaches 1e14) is 'inconclusive (too wide)', not 'too close to call'; the call goes
    on a line of its own where the numbers fill the first."""
    wide, near = ("1.05,1.0,1e15@360M", "inconclusive (too wide)"), ("1.05,1.0,1.5", "to call")
    for given, words in (wide, near):
        assert main(["verdict", str(curve_sweep), *SIM, "--overhead", given]) == 0
        lines = capsys.readouterr().out.splitlines()
        i = next(k for k, x in enumerate(lines) if x.startswith("given overhead"))
        said = lines[i] if lines[i].endswith(words) else lines[i + 1]
        assert said.endswith(words) and max(map(len, lines)) <= 120
