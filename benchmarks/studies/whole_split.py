"""The headline numbers on the whole validation split (issue 41, item 2), beside the small
evaluation they were first read from (8 batches of 16 x 128 = 16,384 tokens, fixed windows).

    python benchmarks/studies/whole_split.py collect runs/lengths-regime   # score checkpoints
    python benchmarks/studies/whole_split.py                               # the comparison

`collect SWEEP` scores the final checkpoint of each finished run of SWEEP on every token of its
validation split once (non-overlapping windows, `stalepipe eval --full-split`), after checking
that the checkpoint gives the run's logged final loss on the small evaluation (so it holds the
run's final weights), and writes `{run: {step, tokens, loss}}` to
docs/results/whole-split/<sweep>.json (numbers only, no paths).

The comparison reads the committed records: the headline 1x runs of `optimizers-regime` (small
evaluation) and their reruns with `train.final_eval_full` in `headline-full` (the same command,
seeds and code: their small evaluation must equal the committed one, which is checked), and the
lengths study's longer runs scored by `collect`. It prints per arm both final losses, the gaps
paired by seed with their t-intervals, EF's share (the seeds' mean, t-interval, as the report
reads it) and the token overhead at sync's final loss (complete runs at 1-1.5x, geometric mean
and t-interval on the logs, as the verdict reads it), each on both evaluations.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from stalepipe.errors import UserError
from stalepipe.lab.analysis import stats
from stalepipe.lab.analysis.targets import TargetOverhead, final_target

RESULTS = Path("docs/results")
ARMS = [f"{o}_{a}" for o in ("adamw", "muon") for a in ("sync", "2bw", "2bw+ef")]
OVERHEAD_ARMS = ("muon_2bw+ef", "muon_2bw", "adamw_2bw+ef")  # the lengths study's complete arms


def _last_eval(run: Path) -> dict:
    """The run's last metrics record with a validation loss (its final evaluation)."""
    last = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "val_loss" in rec:
            last = rec
    return last


def collect(sweep: Path) -> Path:
    """Score every finished run of `sweep` with a checkpoint at its last step (module doc)."""
    from stalepipe.training.tools.evaluate import evaluate_run

    out = RESULTS / "whole-split" / f"{sweep.name}.json"
    scored = json.loads(out.read_text()) if out.exists() else {}
    runs = sorted(d for d in sweep.iterdir() if (d / "config.json").exists())
    for i, run in enumerate(runs):
        steps = json.loads((run / "config.json").read_text())["train"]["num_steps"]
        final = _last_eval(run)
        if run.name in scored or final.get("step") != steps - 1:
            continue  # done already, or not finished
        if not (run / f"ckpt_{steps:08d}").exists():
            continue  # its final weights are gone (a 1x run copied from the records)
        small = evaluate_run(run, tasks=())["val"]["loss"]
        if abs(small - final["val_loss"]) > 1e-5:
            raise UserError(f"{run}: its checkpoint gives {small:.6f}, the run logged "
                            f"{final['val_loss']:.6f}: not its final weights")  # fmt: skip
        val = evaluate_run(run, tasks=(), full_split=True)["val"]
        scored[run.name] = {"step": steps, "tokens": val["tokens"], "loss": val["loss"]}
        print(f"[{i + 1}/{len(runs)}] {run.name}: {val['loss']:.4f} on {val['tokens']:,} tokens")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(scored, indent=1, sort_keys=True) + "\n")  # after each run
    return out


def _finals(sweep: Path, key: str) -> dict[str, dict[int, float]]:
    """label -> seed -> the final `key` (val_loss or val_loss_full) of each finished 1x run."""
    out: dict[str, dict[int, float]] = {}
    for arm in ARMS:
        for run in sorted(sweep.glob(f"{arm}_s[0-9]*")):
            last = _last_eval(run)
            if key in last:
                out.setdefault(arm, {})[int(run.name.rsplit("_s", 1)[1])] = last[key]
    return out


def _ci(xs: list[float], places: int = 4) -> str:
    m, lo, hi = stats.t_interval(xs)
    return f"{m:+.{places}f} [{lo:+.{places}f}, {hi:+.{places}f}]"


def _overhead(sync: dict[int, float], runs: dict[int, list[tuple[float, float]]]) -> str:
    """The token overhead at sync's 1x final loss from each seed's complete runs."""
    seeds = [
        final_target(s, [(1.0, sync[s])], [[p] for p in runs[s]], 0.0)
        for s in sorted(sync.keys() & runs.keys())
    ]
    return TargetOverhead("final", tuple(seeds)).describe() + f" ({len(seeds)} seeds)"


def compare() -> None:
    small = _finals(RESULTS / "optimizers-regime", "val_loss")
    rerun = _finals(RESULTS / "headline-full", "val_loss")
    full = _finals(RESULTS / "headline-full", "val_loss_full")
    tokens = {_last_eval(r)["val_tokens_full"] for r in (RESULTS / "headline-full").glob("*_s*")}
    same = all(abs(rerun[a][s] - small[a][s]) < 1e-9 for a in rerun for s in rerun[a])
    print(f"whole split: {sorted(tokens)} tokens a run (small evaluation: 16,384); the reruns' "
          f"small evaluation {'equals' if same else 'DIFFERS FROM'} the committed runs'")  # fmt: skip
    _arms(small, full)
    _shares(small, full)
    _overheads(small, full)


def _gaps(losses: dict, arm: str, seeds) -> list[float]:
    """`arm`'s final loss minus its optimizer's sync at each of `seeds` (paired)."""
    base = arm.split("_")[0] + "_sync"
    return [losses[arm][s] - losses[base][s] for s in sorted(seeds)]


def _seeds(full: dict, *arms: str) -> set[int]:
    """The seeds whole-split finals exist for in every one of `arms` (and their sync)."""
    names = {*arms, *(a.split("_")[0] + "_sync" for a in arms)}
    return set.intersection(*(set(full.get(a, {})) for a in names))


def _arms(small: dict, full: dict) -> None:
    """Per arm both evaluations' mean final loss and its gap to sync, paired t-intervals."""
    print(f"\n{'arm':<13} {'seeds':>5} {'small eval':>10} {'whole split':>11}   gap to sync, small"
          f"                 gap to sync, whole split")  # fmt: skip
    for arm in ARMS:
        seeds = sorted(_seeds(full, arm))
        s_mean = sum(small[arm][s] for s in seeds) / max(len(seeds), 1)
        f_mean = sum(full[arm][s] for s in seeds) / max(len(seeds), 1)
        gaps = ""
        if not arm.endswith("sync") and len(seeds) >= 2:
            gaps = f"   {_ci(_gaps(small, arm, seeds))}   {_ci(_gaps(full, arm, seeds))}"
        print(f"{arm:<13} {len(seeds):>5} {s_mean:>10.4f} {f_mean:>11.4f}{gaps}")


def _shares(small: dict, full: dict) -> None:
    """AdamW's gap over Muon's, and EF's share of each gap (the seeds' mean, t-interval)."""
    for name, losses in (("small", small), ("whole split", full)):
        means = [stats.mean(_gaps(losses, a, _seeds(full, a))) for a in ("adamw_2bw", "muon_2bw")]
        print(f"AdamW's 2bw gap over Muon's, {name}: {means[0] / means[1]:.1f}x")
    for opt in ("adamw", "muon"):
        seeds = _seeds(full, f"{opt}_2bw", f"{opt}_2bw+ef")
        for name, losses in (("small", small), ("whole split", full)):
            pairs = zip(_gaps(losses, f"{opt}_2bw+ef", seeds), _gaps(losses, f"{opt}_2bw", seeds))
            shares = [stats.recovered_share(ef, plain) for ef, plain in pairs]
            m, lo, hi = stats.t_interval(shares) if len(shares) >= 2 else (math.nan,) * 3
            print(f"EF's share of {opt}'s gap, {name}: {m:.0%} [{lo:.0%}, {hi:.0%}]")


def _overheads(small: dict, full: dict) -> None:
    """The token overhead at sync's 1x final loss of each lengths arm, on both evaluations,
    from the same seeds (those with whole-split finals for the arm and its sync)."""
    scored = json.loads((RESULTS / "whole-split" / "lengths-regime.json").read_text())
    longer = {  # run -> (its arm, multiple, seed, {evaluation: final loss})
        run: (*_length_run(run), {"whole split": rec["loss"]}) for run, rec in scored.items()
    }
    for run, (*_, loss) in longer.items():
        loss["small"] = _last_eval(RESULTS / "lengths-regime" / run)["val_loss"]
    print()
    for arm in OVERHEAD_ARMS:
        base, seeds = arm.split("_")[0] + "_sync", _seeds(full, arm)
        for name, losses in (("small", small), ("whole split", full)):
            runs = {s: [(1.0, losses[arm][s])] for s in seeds}
            for label, mult, seed, loss in longer.values():
                if label == arm and seed in seeds:
                    runs[seed].append((mult, loss[name]))
            sync = {s: losses[base][s] for s in seeds}
            print(f"token overhead of {arm} at sync's final loss, {name}: {_overhead(sync, runs)}")


def _length_run(name: str) -> tuple[str, float, int]:
    """'muon_2bw+ef_x1.35_s2' -> ('muon_2bw+ef', 1.35, 2)."""
    label, rest = name.split("_x", 1)
    mult, seed = rest.split("_s")
    return label, float(mult), int(seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", choices=("compare", "collect"), default="compare")
    ap.add_argument("sweep", nargs="?", help="collect: the sweep directory with checkpoints")
    args = ap.parse_args()
    if args.what == "collect":
        if not args.sweep or not Path(args.sweep).is_dir():
            raise SystemExit("collect needs a sweep directory with its runs' checkpoints")
        try:
            print(f"wrote {collect(Path(args.sweep))}")
        except UserError as e:  # a checkpoint that is not its run's final weights: one line
            raise SystemExit(f"whole_split.py: {e}") from None
    else:
        compare()


if __name__ == "__main__":
    main()
