"""`stalepipe verdict --cluster`: the best fitting 2bw against the best fitting synchronous
configuration of any kind, the crossover map's calls on a sweep whose token taxes are known,
--json, and bad input as one line."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from stalepipe.cli import main
from stalepipe.lab.analysis.results import build_rows, load_runs
from stalepipe.lab.verdict import cluster as cv
from stalepipe.lab.verdict.command import judge_sweep
from stalepipe.lab.verdict.rule import Transfer

CLUSTER = ["--cluster", "h100-ib", "--gpus", "16", "--global-batch", "64"]


def test_map_calls_follow_the_known_tax(curve_sweep):
    """adamw_2bw+ef needs 1.09-1.11x sync's tokens (the fixture's stretch, 3 seeds): a 1.5x
    throughput edge makes it sooner, none makes it later, 1.10x is inside its interval."""
    s = cv.setting("smollm-135m", "h100-ib", 16, 64)
    tp, options = cv.throughputs(s)
    assert {r.name for r in tp.rows} >= {"dp", "fsdp", "1f1b", "zb-h1", "2bw"}
    assert tp.best_sync().fits and tp.best_sync().policy == "sync"
    assert len(options) > 20 and all(
        o.fits for o in options if o.tokens_per_s == tp.best_sync().tokens_per_s
    )
    verdicts, _ = judge_sweep(build_rows(load_runs(curve_sweep)), tp)
    ef = next(v for v in verdicts if v.label == "adamw_2bw+ef")
    assert ef.transfer.low < 1 < ef.transfer.high  # the fixture's tiny model -> smollm-135m
    ef.transfer = Transfer()  # the map's rule apart from the size transfer
    low, high = ef.target.interval()[1:]
    assert 1.05 < low < high < 1.15

    def cell(edge: float, factors: tuple[float, float] = (1.0, 1.0)) -> cv.Cell:
        a, s = SimpleNamespace(tokens_per_s=edge), SimpleNamespace(tokens_per_s=1.0)
        return cv.Cell(8, 64, 400.0, a, s, factors)

    assert cv.cell_verdict(ef, cell(1.5)) == "async sooner"
    assert cv.cell_verdict(ef, cell(1.0)) == "sync sooner"
    assert cv.cell_verdict(ef, cell((low + high) / 2)) == "inconclusive"
    # a call holds only over the assumptions' whole range: an edge that reaches the overhead's
    # interval at one end of it is too close to call
    assert cv.cell_verdict(ef, cell(1.0, (0.9, low * 1.01))) == "inconclusive"
    assert cv.cell_verdict(ef, cell(1.5, (high / 1.5 * 0.99, 1.1))) == "inconclusive"
    assert cv.cell_verdict(ef, cell(1.0, (0.9, low * 0.99))) == "sync sooner"
    assert cv.headline(verdicts)[0].label == "adamw_2bw+ef"  # the lowest measured overhead first
    # Fewer seeds never push it off the map: one seed has no interval to carry (never drawn),
    # two seeds are drawn after every configuration with the 3 a verdict needs.
    faster = tuple(replace(t, tokens_delayed=t.tokens_delayed / 2) for t in ef.target.seeds)
    one = replace(ef, label="one", target=replace(ef.target, seeds=faster[:1]))
    two = replace(ef, label="two", target=replace(ef.target, seeds=faster[:2]))
    drawn = [v.label for v in cv.headline([one, two, *verdicts])]
    assert "one" not in drawn and drawn.index("two") > drawn.index("adamw_2bw+ef")


def test_cluster_verdict_end_to_end(curve_sweep, capsys):
    assert main(["verdict", str(curve_sweep), *CLUSTER, "--model", "smollm-135m", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["configuration"]: r for r in doc["verdicts"]}
    ef = rows["adamw_2bw+ef"]
    assert ef["async_config"].startswith("2bw P=") and "tok/s" in ef["best_sync"]
    assert ef["best_sync_tokens_per_s"] > 0 and len(ef["time_to_target_ci"]) == 3
    # the model the overhead was measured on, beside it (the fixture's tiny model)
    assert ef["seeds"] == "3" and ef["measured_on_params"].endswith("M")
    assert any("cluster model" in line for line in doc["inputs"])
    # each arm judged on throughputs costed with its own optimizer (issue 52): Muon's Newton-
    # Schulz in its synchronous configurations and its 2BW, EF's buffer in AdamW+EF's 2BW only
    lines = {
        line.split(": optimizer: ")[0]: line for line in doc["inputs"] if ": optimizer: " in line
    }
    assert set(lines) == {"AdamW", "AdamW+EF", "Muon"}
    assert "Newton-Schulz" in lines["Muon"] and "error feedback" in lines["AdamW+EF"]
    assert "Newton-Schulz" not in lines["AdamW"] and "error feedback" not in lines["AdamW"]
    assert [rows[k]["arm"] for k in ("adamw_2bw", "adamw_2bw+ef", "muon_2bw")] == [
        "AdamW",
        "AdamW+EF",
        "Muon",
    ]
    plain = rows["adamw_2bw"]["best_sync_tokens_per_s"]
    assert rows["muon_2bw"]["best_sync_tokens_per_s"] < plain  # NS slows the synchronous best
    assert rows["adamw_2bw+ef"]["best_sync_tokens_per_s"] == plain  # sync runs without EF
    out = curve_sweep / "verdict"
    assert (out / "verdict.png").stat().st_size > 10_000
    with open(out / "verdict_map.csv") as f:
        every = list(csv.DictReader(f))
    # one row per cell and drawn arm; a drawn configuration's call is on its own arm's rows
    cells = [c for c in every if c["arm"] == "AdamW+EF"]
    assert {c["arm"] for c in every} == {"AdamW+EF", "AdamW"} and len(every) == 2 * len(cells)
    assert all(c["adamw_2bw+ef"] == "" for c in every if c["arm"] != "AdamW+EF")
    assert len(cells) >= 50 and {"16", "32"} <= {c["gpus"] for c in cells}
    # every cell's call is the rule applied to its own edge over the assumptions' range: sooner
    # when even its lowest edge is above the overhead's interval, later when even its highest is
    # below, too close to call otherwise
    # ... and the overhead's size transfer (the fixture's tiny model -> smollm-135m, issue 52)
    low, high = ef["time_to_target_ci"][1:]
    t_low, t_high, source = ef["transfer"]
    assert t_low < 1 < t_high and source.startswith("default")
    # (an overhead is at least 1: the transfer never takes it lower, `rule.widen`)
    tax_low = max(low * t_low * ef_speedup(ef), 1.0)
    tax_high = high * t_high * ef_speedup(ef)
    seen = set()
    for c in cells:
        lo, hi = float(c["speedup_low"]), float(c["speedup_high"])
        assert lo <= float(c["speedup"]) <= hi
        want = (
            "async sooner" if lo > tax_high else "sync sooner" if hi < tax_low else "inconclusive"
        )
        if min(abs(e - t) for e in (lo, hi) for t in (tax_low, tax_high)) > 1e-3:
            assert c["adamw_2bw+ef"] == want, c
            seen.add(want)
    # every cell was checked against the rule; since issue 52 (pipelines at their own
    # microbatch size, the model's error widening the edge) this map can leave every cell
    # inconclusive for a 1.10x overhead; the rule's other branches are pinned by
    # test_map_calls_follow_the_known_tax
    assert seen


def test_pipedream_is_judged_at_its_runs_p(curve_sweep, curve_run):
    """PipeDream's delay grows with P: its P=2 runs are judged on PipeDream's best P=2
    configuration (not 2BW's, not another P), and the map (2BW's) does not draw them."""
    for s in range(3):
        pd = {"delay.policy": "pipedream", "pipeline.num_stages": "2"}
        curve_run(curve_sweep, f"adamw_pd_s{s}", pd, s, stretch=1.2 + 0.01 * s)
    tp, options = cv.throughputs(cv.setting("smollm-135m", "h100-ib", 16, 64))
    verdicts, skipped = judge_sweep(build_rows(load_runs(curve_sweep)), tp)
    pd = next(v for v in verdicts if v.label == "adamw_pd")
    want = max(
        (o for o in options if (o.schedule, o.stages) == ("pipedream", 2) and o.fits),
        key=lambda o: o.tokens_per_s,
    )
    assert pd.schedule == "pipedream" and pd.async_row.stages == 2
    assert pd.async_tokens_per_s == want.tokens_per_s
    assert pd.async_row.shown() == want.label() and not skipped
    assert "adamw_pd" not in [v.label for v in cv.headline(verdicts, most=10)]


def ef_speedup(row: dict) -> float:
    return row["async_tokens_per_s"] / row["best_sync_tokens_per_s"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cluster", "h100-ibb"], "did you mean 'h100-ib'"),
        (["--cluster", "h100-ib", "--gpus", "12"], "not a whole number of h100-ib nodes"),
        (
            ["--cluster", "h100-ib", "--gpus", "32", "--global-batch", "3"],
            "use --global-batch >= 4",
        ),
        (["--cluster", "h100-ib", "--global-batch", "lots"], "give sequences"),
        (["--cluster", "BAD.json"], "did you mean 'inter_node_gbps'"),
        (["--cluster", "h100-ib", "--stages", "4"], "drop --stages"),
        (["--model", "smollm-135m", "--gpus", "8"], "add --cluster"),
        (["--model", "smollm-135m", "--no-map"], "it needs --cluster PRESET"),
    ],
)
def test_bad_cluster_input_is_one_line(args, message, curve_sweep, tmp_path, capsys):
    (tmp_path / "BAD.json").write_text(json.dumps({"inter_node_gpbs": 25}))
    argv = [str(tmp_path / a) if a == "BAD.json" else a for a in args]
    assert main(["verdict", str(curve_sweep), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stalepipe: error: ") and "\n" not in err and message in err, err
    assert not (curve_sweep / "verdict").exists()


def test_a_tp_group_shares_its_sequences():
    """Issue 52: Llama 3 405B trained on 8,192 H100s at 2,048 sequences (TP 8): the setting
    takes a batch down to one sequence per TP group of a node, and names that floor below it."""
    s = cv.setting("llama3-405b", "h100-ib", 8192, 2048)
    assert (s.gpus, s.global_batch) == (8192, 2048)
    with pytest.raises(cv.UserError, match=r"use --global-batch >= 1024$"):
        cv.setting("llama3-405b", "h100-ib", 8192, 1023)
