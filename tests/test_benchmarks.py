"""The GPU check must run on CPU in its reduced mode (it is what a GPU session runs first)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    """benchmarks/`name` (`<group>/<script>`) with `args` from the project root, one thread; it
    must exit 0."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def _as_main(capsys, monkeypatch, script: Path, *args: str) -> tuple[int, str, str]:
    """`script` run as `__main__` in this process, for a script's further cases once a first
    run has shown it works as a process of its own: (the exit status the interpreter would
    give, stdout, stderr)."""
    import runpy

    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # what the script adds goes with it
    monkeypatch.chdir(ROOT)
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):  # the interpreter prints the message and exits 1
            print(e.code, file=sys.stderr)
            code = 1
        else:
            code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_pipeline_throughput_runs_every_contender():
    """A tiny run of the runtime-vs-torch benchmark: it must not rot between benchmark runs."""
    args = ["--microbatches", "2", "--steps", "4", "--warmup", "1", "--repeats", "1"]
    args += ["--dim", "32", "--layers", "4", "--seq", "16", "--mb", "2"]
    out = _script("speed/pipeline_throughput.py", *args)
    rows = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")}
    assert {"gpipe", "1f1b", "interleaved-1f1b", "zb-v", "2bw", "torch-gpipe"} <= rows
    assert {"torch-interleaved", "torch-zbv"} <= rows
    assert "2bw / 1f1b = " in out.stdout and "with both computing" in out.stdout
    # each ratio with its range over the rounds (one round here: the range is the ratio)
    median, lo, hi = re.search(r"2bw / 1f1b = (\S+) \[(\S+)-(\S+)\]", out.stdout).groups()
    assert median == lo == hi
    assert "2bw / the best of torch's schedules" in out.stdout and "load average" in out.stdout
    # the replay: every action at its measured time through the simulator, a bubble in [0, 1)
    header = next(line for line in out.stdout.splitlines() if "replayed" in line).split()
    row = next(line for line in out.stdout.splitlines() if line.startswith("  2bw ")).split()
    assert 0.0 <= float(row[header.index("replayed")]) < 1.0
    # Memory per rank: our executors hold exactly the stashes the schedule IR accounts for.
    assert "peak memory per rank" in out.stdout
    held = re.findall(r"executor held (\d+) stashes \(IR: (\d+)\)", out.stdout)
    assert len(held) == 5 and all(a == b for a, b in held), held
    assert "2bw / the best of our synchronous schedules" in out.stdout
    assert "interleaved-1f1b / torch-interleaved = " in out.stdout


def test_the_135m_claims_script_plans_its_18_runs_and_refuses_a_dir_without_shards(tmp_path):
    """`benchmarks/studies/claims_135m.sh`: the dry run on llm.c-format shards lists the study's 18
    runs with their GPU-hours; a directory without shards is one line and exit 2."""
    import numpy as np

    from stalepipe.training.data.shards import write_shard

    script = ROOT / "benchmarks" / "studies" / "claims_135m.sh"
    env = {**os.environ, "STALEPIPE": str(Path(sys.executable).parent / "stalepipe")}
    bad = subprocess.run([script, str(tmp_path)], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "no *train*.bin and *val*.bin" in bad.stderr
    tokens = np.arange(4096, dtype=np.uint16)
    write_shard(tmp_path / "fineweb_train_000001.bin", tokens, 1)
    write_shard(tmp_path / "fineweb_val_000000.bin", tokens, 1)
    out = subprocess.run(
        [script, str(tmp_path), str(tmp_path / "out"), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "18 runs, 18 to run" in out.stderr + out.stdout
    assert "GPU-hours on one H100" in out.stderr + out.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_split_backward_benchmark_runs():
    out = _script("speed/split_backward.py", "--dim", "32", "--repeats", "3")
    assert "split (BI + BW)" in out.stdout and "two calls (before)" in out.stdout


def test_study_walltime_groups_committed_records_by_command(tmp_path, capsys, monkeypatch):
    """`benchmarks/studies/study_walltime.py` on copies of two committed run records: one row per
    command, the span from the first start to the last run's start plus its training time,
    the load where the record has it; a directory without records is one line and exit 2."""
    import json
    import shutil

    src = ROOT / "docs" / "results" / "optimizers-regime"
    for name, started, load in [("adamw_sync_s0", "2026-12-03T06:00:00+0000", None),
                                ("muon_sync_s0", "2026-12-03T06:10:00+0000", [1.5, 1.0, 0.5]),
                                ("soap_sync_s0", "2026-12-04T06:00:00+0000", None)]:  # fmt: skip
        shutil.copytree(src / name, tmp_path / name)
        meta = json.loads((tmp_path / name / "meta.json").read_text())
        for record in [meta, *meta["invocations"]]:
            record.update(started=started, argv=["/x/bin/stalepipe", "sweep", "optimizers"])
            record.update(load_avg=load) if load else record.pop("load_avg", None)
        (tmp_path / name / "meta.json").write_text(json.dumps(meta))
    script = [sys.executable, str(ROOT / "benchmarks" / "studies" / "study_walltime.py")]
    out = subprocess.run([*script, str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    # the same command a day later is a second invocation, not a 24-hour span
    row, later = [line for line in out.stdout.splitlines() if line.startswith("| `")]
    assert later.split("|")[2:4] == [" 1 ", " 2026-12-04 06:00 "]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[:4] == ["`stalepipe sweep optimizers`", "2", "2026-12-03 06:00", "12-03 06:10"]
    assert 10 < int(cells[4].split()[0]) < 30 and cells[7] == "1.5-1.5"  # 10 min + one run
    code, by_study, _ = _as_main(capsys, monkeypatch, Path(script[1]), str(tmp_path), "--by-study")
    (row,) = [line for line in by_study.splitlines() if line.startswith("| `")]
    assert code == 0 and row.startswith(
        "| `stalepipe sweep optimizers` | 2 | 3 | 2026-12-03 06:00 |"
    )
    code, _, err = _as_main(capsys, monkeypatch, Path(script[1]), str(tmp_path / "adamw_sync_s0"))
    assert code == 2 and "no finished runs" in err


def test_per_arm_gap_compares_run_groups_across_directories(tmp_path, capsys, monkeypatch):
    """`benchmarks/studies/per_arm_gap.py` on copies of committed records: AdamW 2bw at 3e-3 against
    sync at 9e-3 (its 3-seed optimum), as RESULTS reads it; a bad pair is one line, exit 2."""
    import shutil

    src = ROOT / "docs" / "results" / "optimizers-regime"
    for group, where in [("adamw_2bw", "a"), ("adamw_lr0.009_sync", "b")]:
        for s in range(3):
            shutil.copytree(src / f"{group}_s{s}", tmp_path / where / f"{group}_s{s}")
    script = [sys.executable, str(ROOT / "benchmarks" / "studies" / "per_arm_gap.py")]
    pair = f"{tmp_path}/a/adamw_2bw={tmp_path}/b/adamw_lr0.009_sync"
    out = subprocess.run([*script, pair], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| adamw_2bw | 3 | 1.8199 ± 0.0082 | adamw_lr0.009_sync | 3 |" in out.stdout
    # Welch on the means, then the same seeds paired (the report's test)
    assert out.stdout.rstrip().endswith(
        "| +0.2258 | 4.8e-06 | +0.2258 [+0.1891, +0.2626] (3) | 1.4e-03 |"
    )
    code, _, err = _as_main(capsys, monkeypatch, Path(script[1]), "adamw_2bw")
    assert code == 2 and "is not ARM=SYNC" in err
    gone = f"{tmp_path}/a/nope={tmp_path}/b/adamw_lr0.009_sync"
    code, _, err = _as_main(capsys, monkeypatch, Path(script[1]), gone)
    assert code == 1 and "name a run group" in err


def test_committed_records_name_no_machine_paths(tmp_path):
    """Every meta.json and config.json under docs/results is portable (`portable_meta.py --check`),
    and the rewrite makes an old record's absolute paths relative to its run directory."""
    script = [sys.executable, str(ROOT / "benchmarks" / "records" / "portable_meta.py")]
    out = subprocess.run([*script, "docs/results", "--check"], capture_output=True, text=True,
                         cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:]
    run = tmp_path / "repo" / "docs" / "results" / "s" / "r"
    run.mkdir(parents=True)
    old = {"cwd": str(tmp_path / "repo"), "run_dir": str(run), "data_dir": str(tmp_path / "data"),
           "argv": [str(tmp_path / "repo/.venv/bin/stalepipe"), "sweep", "--out",
                    str(tmp_path / "repo/docs/results/s")]}  # fmt: skip
    (run / "meta.json").write_text(json.dumps({**old, "invocations": [old]}))
    config = {"name": "r", "out_dir": str(tmp_path / "repo/docs/results/s"), "seed": 0}
    (run / "config.json").write_text(json.dumps(config))
    bad = subprocess.run([*script, str(tmp_path), "--check"], capture_output=True, text=True)
    assert bad.returncode == 1 and "run_dir=" in bad.stdout and "out_dir=" in bad.stdout
    subprocess.run([*script, str(tmp_path)], check=True, capture_output=True)
    assert json.loads((run / "config.json").read_text()) == {**config, "out_dir": "docs/results/s"}
    new = json.loads((run / "meta.json").read_text())
    want = {"cwd": "../../../..", "data_dir": "../../../../../data",
            "argv": ["stalepipe", "sweep", "--out", "docs/results/s"]}  # fmt: skip
    assert {k: new["invocations"][0][k] for k in want} == want and "run_dir" not in new
    assert subprocess.run([*script, str(tmp_path), "--check"], capture_output=True).returncode == 0


def test_validate_step_time_prints_every_schedule():
    """A tiny run of the simulator-against-runtime step-time check (docs/verdict.md,
    'Validation'): a row per schedule with a measured and a predicted step time."""
    args = ["--microbatches", "2", "--steps", "4", "--warmup", "1", "--repeats", "1"]
    args += ["--dim", "32", "--layers", "2", "--seq", "16", "--mb", "2"]
    out = _script("validation/validate_step_time.py", *args)
    rows = {ln.split()[0]: ln.split() for ln in out.stdout.splitlines() if ln.strip()}
    for name in ("2bw", "1f1b", "zb-h1"):
        measured, predicted = float(rows[name][2]), float(rows[name][4])
        assert measured > 0 and predicted > 0, rows[name]
    assert "load average after" in out.stdout


def test_gap_table_reads_length_and_size_from_committed_records():
    """benchmarks/studies/gap_table.py finds the length and size runs by configuration: the 1x
    row is study 1's seed-0 triple (AdamW sync 1.5942, 2bw +0.2338), the size rows each their
    own LR, and an LR-grid run at the reference width never stands in for the reference's arm."""
    out = _script("studies/gap_table.py", "docs/results/optimizers-regime")
    rows = {line.split(" | ")[0].strip("| "): line for line in out.stdout.splitlines()}
    assert "| 1200 | 0.003 | 1.5942 | 0.2338 | 0.0882 |" in rows["1200"]
    assert "| 96 | 0.43M | 0.003 | 1.5942 | 0.2338 |" in rows["96"]
    assert "| 288 | 3.62M | 0.001 |" in rows["288"]


def test_momentum_table_reads_the_controlled_grid():
    """benchmarks/studies/momentum_table.py on the committed controlled-momentum records: one row
    per (optimizer, beta1); the fixed-LR cells are seed 0's (AdamW beta1 0.8: sync 1.5796, gap
    +0.4471); where the grid is complete, 2bw at its own best LR is never worse than at sync's."""
    out = _script("studies/momentum_table.py", "docs/results/momentum-controlled-regime")
    lines = [
        x for x in out.stdout.splitlines() if x.startswith("| adamw") or x.startswith("| muon")
    ]
    assert len(lines) == 10
    assert "| adamw | 0.8 | 1 | 1.5796 | +0.4471 |" in lines[0]
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 9
        if cells[6] != "-":  # the grid's three LRs have run for this beta1
            assert float(cells[8]) <= float(cells[6]) + 1e-9


def test_ladder_fit_reads_the_committed_ladder_records(ladder_fit):
    """The size ladder's table from its records (benchmarks/studies/ladder_fit.py, run once by
    the `ladder_fit` fixture): every width of both optimizers has a row, and the fit waits until
    every width has two seeds of each arm; the token overhead's fit says what it has or gives
    its prediction; `--plot` draws a PNG."""
    out, png = ladder_fit
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "the fit needs 3" in out or "token overhead of one run at 360M" in out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("adamw ", "muon "))]
    rows = [r for r in rows if r[1].isdigit() and int(r[2]) >= 49_440]  # the gap table's (N)
    assert len(rows) == 10 and {r[1] for r in rows} == {"32", "48", "64", "96", "136"}
    adamw32 = next(r for r in rows if r[:2] == ["adamw", "32"])
    assert int(adamw32[3]) >= 1 and 2.0 < float(adamw32[4]) < 3.0  # seeds, sync's mean loss
    assert "the fit waits" in out or "fit, shrink rate" in out
    ef = [ln for ln in out.splitlines() if ln.startswith("EF share, ")]  # as registered: apart
    assert ef and all("; recovers most: " in ln and "; size: " in ln for ln in ef), ef
    checks = [r for r in (ln.split() for ln in out.splitlines()) if len(r) == 13 and "/" in r]
    assert len(checks) == 10  # the regime checks' rows (issue 51): every width of both
    assert out.count("  label (issue 51): ") == 4  # each fit labelled by the project's rules


def test_results_quotes_the_ladder_s_table_and_fits_as_the_records_give_them(ladder_fit):
    """docs/RESULTS.md's size-ladder blocks are `ladder_fit.py`'s output on the committed records,
    line for line: a record added (width 136's third seed, say) without the docs rerun fails."""
    out = ladder_fit[0]
    results = (ROOT / "docs" / "RESULTS.md").read_text().splitlines()
    shown = [line for line in out.splitlines() if line.strip()]
    assert len(shown) > 30  # the table, the four fits, EF's labels and the overhead's fit
    missing = [line for line in shown if line not in results]
    assert not missing, f"RESULTS.md lacks {len(missing)} of ladder_fit.py's lines: {missing[:3]}"


def test_whole_split_reads_the_headline_on_both_evaluations():
    """The headline runs on the whole validation split (benchmarks/studies/whole_split.py, issue
    41 item 2): the reruns reproduce the committed runs' small evaluation exactly, every arm has
    its 5 seeds, and each token overhead is read on both evaluations from the same seeds."""
    out = _script("studies/whole_split.py").stdout
    assert "[162560] tokens a run" in out
    assert "the reruns' small evaluation equals the committed runs'" in out
    arms = [ln.split() for ln in out.splitlines() if re.match(r"(adamw|muon)_\S+ +\d+ ", ln)]
    assert len(arms) == 6 and all(a[1] == "5" for a in arms), arms
    overheads = [ln for ln in out.splitlines() if ln.startswith("token overhead of ")]
    assert len(overheads) == 6 and all(ln.endswith("(5 seeds)") for ln in overheads), overheads
    readme = " ".join((ROOT / "README.md").read_text().split())  # its sentence on the above
    short = [ln for ln in overheads if "seeds short" in ln]
    assert [ln.split(" at ")[0] for ln in short] == ["token overhead of adamw_2bw+ef"], short
    assert '"> 1.50x (1/5 seeds short)"' in readme and "(1/5 seeds short;" in short[0]
    assert "whole 162,560-token validation split" in readme


def _batched_seeds(monkeypatch):
    """benchmarks/speed/batched_seeds.py as a module (its classes, for in-process checks)."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module("benchmarks.speed.batched_seeds")


def test_batched_seeds_trains_each_seed_as_its_solo_run_bit_for_bit():
    """`batched_seeds.py --quick` (issue 55): S seeds as one batched model against each seed
    trained alone by today's engine, both optimizers, the three arms. The tolerance its runs
    established is none: every seed's losses at every step and its final weights equal the
    solo run's bit for bit (at the study shapes too: docs/benchmarks.md, 'Batched seeds')."""
    args = ["--quick", "--rounds", "1", "--warmup", "0", "--sizes", "3", "--check-steps", "4"]
    out = _script("speed/batched_seeds.py", *args).stdout
    rows = [ln.split() for ln in out.splitlines() if re.match(r"quick +(adamw|muon) ", ln)]
    assert {(r[1], r[2]) for r in rows} == {
        (o, a) for o in ("adamw", "muon") for a in ("sync", "2bw", "2bw+ef")
    }, out
    assert all(r[3] == "3" and r[-1] == "yes" for r in rows), out
    assert re.search(r"quick +all: S = 3: \d+\.\d\d \[", out)
    checks = [ln for ln in out.splitlines() if ln.startswith("check quick")]
    assert len(checks) == 6, out
    assert all(
        "4 steps: losses differ never, max |dloss| 0.000e+00, final weights equal" in ln
        for ln in checks
    ), checks


def test_batched_model_is_each_seed_s_transformer(monkeypatch):
    """The batched model computes our Transformer's function per seed: seed s's slices are
    `build_model(cfg, s)`'s initial weights, its loss on its own batch and its gradients are
    the solo model's bit for bit, and the seeds differ (the check is not vacuous)."""
    import torch

    from stalepipe.training.models import build_model

    bs = _batched_seeds(monkeypatch)
    cfg = bs.scale_cfg(None, "muon", "2bw", quick=True)
    solos = [build_model(cfg.model, s) for s in range(3)]
    batched = bs.BatchedTransformer([build_model(cfg.model, s) for s in range(3)])
    for s, solo in enumerate(solos):
        for name, p in solo.named_parameters():
            assert torch.equal(batched.param(name)[s], p), (s, name)
    xy = [bs.seed_batch(cfg, s, 0) for s in range(3)]
    x, y = (torch.stack(t) for t in zip(*xy, strict=True))
    losses = batched(x, y)
    losses.sum().backward()
    for s, solo in enumerate(solos):
        loss = solo(*xy[s])
        loss.backward()
        assert losses[s].item() == loss.item()
        for name, p in solo.named_parameters():
            assert torch.equal(batched.param(name).grad[s], p.grad), (s, name)
        other = solo(*xy[(s + 1) % 3]).item()  # another seed's data order: another loss
        assert other != loss.item()
    assert len({round(v, 6) for v in losses.tolist()}) == 3


def test_batched_seeds_check_reports_a_seed_that_strays(monkeypatch):
    """The script's comparison (`differences`) finds a seed whose batched weights stray from
    its solo run: equal after two steps, then one weight of seed 1 nudged, and the losses
    differ from the first step that reads the nudged weights (2bw: one step later)."""
    import torch

    bs = _batched_seeds(monkeypatch)
    cfg = bs.scale_cfg(None, "adamw", "2bw+ef", quick=True)
    solos, run = [bs.SoloRun(cfg, s) for s in range(2)], bs.BatchedRun(cfg, 2)

    def step() -> None:
        run.step()
        for solo in solos:
            solo.timed()

    for _ in range(2):
        step()
    assert bs.differences(run, solos) == (None, 0.0, True)
    with torch.no_grad():
        run.model.param("layers.0.attn.wq.weight")[1, 0, 0] += 1e-3  # W_2 of seed 1
    step()  # step 2 reads W_1: still equal
    assert bs.differences(run, solos)[:2] == (None, 0.0)
    step()  # step 3 reads W_2
    first, worst, same = bs.differences(run, solos)
    assert (first, same) == (3, False) and worst > 0.0
    assert run.losses[3][0] == solos[0].losses[3]  # seed 0 untouched
