"""Which CPU scale puts the studies in a pretraining-like regime (issue 17)? Probe candidates.

Each candidate is a base config (model, tokenizer, tokens per step, steps, warmup). For each,
the probe trains a few arms (optimizer x delay policy x seed) as an ordinary sweep into
`OUT/<candidate>/` (resumable: a rerun trains only what is missing) and prints one table row
per candidate and arm with the issue's three criteria:

- (a) plateau exit (`analysis.regime.plateau_exit`, which the report's regime column also
  reads): the first step at which the train loss, smoothed by a trailing mean, is below the
  unigram entropy of the training tokens minus 0.3 nats, as a fraction of the run (the worst
  seed). Criterion: <= 10% for every arm.
- (b) seed std of the synchronous final val loss <= 1/5 of AdamW's 2bw gap (mean over seeds).
- (c) end slope: least-squares slope of the train loss over the last 20% of steps, in nats per
  10% of the run. Criterion: < 0 (still falling).

`train s` is each run's training time by its own clock (`tokens_per_s` in its metrics: evals
left out), for one worker of one thread on this machine under its load at the time; the load
moves it by 5x, so benchmarks/speed/regime_throughput.py measures speed side by side.

    python benchmarks/studies/regime_probe.py --candidates bpe2k-d96,byte-d96 \
        --arms adamw:sync,adamw:2bw
    python benchmarks/studies/regime_probe.py --seeds 3 --table-only  # the table of what has run
    python benchmarks/studies/regime_probe.py --candidates cpu-regime \
        --runs docs/results/momentum-regime --table-only --groups 'adamw_b1*'  # any study's groups
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import statistics
from pathlib import Path

from stalepipe.config import ExperimentConfig, apply_overrides
from stalepipe.lab.analysis.regime import end_slope, plateau_exit
from stalepipe.lab.studies.scales import LRS, SCALES, base_config, paper_mini_base
from stalepipe.lab.sweeps.grid import RunSpec
from stalepipe.lab.sweeps.sweep import run_status, run_sweep
from stalepipe.training.data import ensure_prepared
from stalepipe.training.data.manifest import unigram_entropy
from stalepipe.training.launch import task as trainer
from stalepipe.training.models import count_params
from stalepipe.training.rundir.metrics import read_metrics


def _shape(vocab: int, dim: int, ffn: int, layers: int = 4, seq: int = 64) -> dict[str, str]:
    return {"model.vocab_size": str(vocab), "model.dim": str(dim), "model.ffn_dim": str(ffn),
            "model.num_layers": str(layers), "model.max_seq_len": str(seq),
            "data.seq_len": str(seq)}  # fmt: skip


def _bpe(vocab: int) -> dict[str, str]:
    return {"data.tokenizer": "bpe", "data.bpe_vocab_size": str(vocab),
            "data.data_dir": f"data_cache/shakespeare-bpe{vocab}"}  # fmt: skip


def _schedule(steps: int, batch: int, warmup: float = 0.1) -> dict[str, str]:
    return {"train.num_steps": str(steps), "train.batch_size": str(batch),
            "train.warmup_steps": str(max(int(steps * warmup), 1)),
            "train.eval_every": str(steps // 4)}  # fmt: skip


# name -> overrides on `paper_mini_base` (4 blocks, 4 heads / 2 KV heads, tied embeddings).
CANDIDATES: dict[str, dict[str, str]] = {
    "byte-d96": _shape(256, 96, 256, seq=128) | _schedule(800, 16),
    "bpe1k-d96": _shape(1024, 96, 256) | _bpe(1024) | _schedule(800, 32),
    "bpe2k-d96": _shape(2048, 96, 256) | _bpe(2048) | _schedule(800, 32),
    "bpe4k-d96": _shape(4096, 96, 256) | _bpe(4096) | _schedule(800, 32),
    "bpe2k-d96-w25": _shape(2048, 96, 256) | _bpe(2048) | _schedule(800, 32, warmup=0.25),
    # byte-d96 at 1200 steps, with 20 evaluations of 8 batches: scales.regime_base
    "cpu-regime": {},
    "byte-d96-w25": _shape(256, 96, 256, seq=128) | _schedule(800, 16, warmup=0.25),
    "byte-d96-b8-s1600": _shape(256, 96, 256, seq=128) | _schedule(1600, 8),
}

POLICIES = {"sync": {"delay.policy": "sync"}, "2bw": {"delay.policy": "2bw"},
            "2bw+ef": {"delay.policy": "2bw", "delay.ef": "true"}}  # fmt: skip


def candidate_config(name: str) -> ExperimentConfig:
    """The base config of candidate `name` (every arm of it starts here)."""
    if name in SCALES:
        return base_config(name)
    return apply_overrides(paper_mini_base(), CANDIDATES[name])


def arm_specs(
    arms: list[str], seeds: int, lrs: dict[str, str], study_lrs: dict[str, str] | None = None
) -> list[RunSpec]:
    """`adamw:sync` -> RunSpecs named by `arm_group`, seed-major."""
    specs = []
    for seed in range(seeds):
        for arm in arms:
            opt, lr, policy = parse_arm(arm, lrs)
            o = {"optim.name": opt, "optim.lr": lr, **POLICIES[policy]}
            group = arm_group(arm, lrs, study_lrs)
            specs.append(RunSpec(name=f"{group}_s{seed}", group=group,
                                 seed=seed, overrides=o))  # fmt: skip
    return specs


def parse_arm(arm: str, lrs: dict[str, str]) -> tuple[str, str, str]:
    """`adamw:sync` (the LR from `lrs`) or `adamw@1e-2:sync` -> (optimizer, LR, policy)."""
    opt, policy = arm.split(":")
    opt, _, lr = opt.partition("@")
    if not (lr := lr or lrs.get(opt, "")):
        raise SystemExit(f"regime_probe.py: no LR for {opt} here; name it: {opt}@LR:{policy}")
    return opt, lr, policy


def arm_group(arm: str, lrs: dict[str, str], study_lrs: dict[str, str] | None = None) -> str:
    """`adamw:sync` -> `adamw_lr3e-3_sync` (the run name without its seed); an arm at the LR
    its study scale runs the optimizer at (`study_lrs`, that scale's `scales.LRS`) is named as
    in the studies (`adamw_sync`), so that its runs are the `optimizers` study's."""
    opt, lr, policy = parse_arm(arm, lrs)
    at_study_lr = study_lrs is not None and lr == study_lrs.get(opt)
    return f"{opt}_{policy}" if at_study_lr else f"{opt}_lr{lr}_{policy}"


def run_summary(run_dir: Path, entropy: float) -> dict[str, float] | None:
    """Final val loss, plateau-exit fraction, end slope and seconds of one finished run."""
    if run_status(run_dir) != "finished":
        return None
    rows = read_metrics(run_dir)
    losses = [r["loss"] for r in rows if "loss" in r]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    exit_step = plateau_exit(losses, entropy)
    return {
        "val": vals[-1],
        "exit": math.inf if exit_step is None else (exit_step + 1) / len(losses),
        "slope": end_slope(losses),
        "seconds": train_seconds(run_dir, rows),
    }


def train_seconds(run_dir: Path, rows: list[dict]) -> float:
    """The run's training time by the loop's own clock (its last `tokens_per_s`: evals and
    checkpoints left out), so that it reads the same from a committed copy of the record."""
    cfg = json.loads((run_dir / "config.json").read_text())
    tokens = cfg["train"]["num_steps"] * cfg["train"]["batch_size"] * cfg["data"]["seq_len"]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    return tokens / tps[-1] if tps else math.nan


def _fmt_exit(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:.0%}"


def table(
    dirs: dict[str, Path], arms: list[str], seeds: int, lrs: dict[str, str], study_names: bool
) -> str:
    """The probe table: one row per candidate and arm, then the criteria per candidate."""
    lines = [
        "| candidate | params | tokens/step | steps | unigram H | arm | seeds | val (mean ± std) "
        "| gap to sync | plateau exit (worst seed) | end slope /10% | train s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for name, run_root in dirs.items():
        cfg = candidate_config(name)
        entropy = unigram_entropy(str(Path(cfg.data.resolved_dir()).resolve()))
        params = count_params(cfg.model)["total"]
        vals: dict[str, list[float]] = {}
        worst_exit, slopes = 0.0, []
        for arm in arms:
            opt, lr, policy = parse_arm(arm, lrs)
            group = arm_group(arm, lrs, LRS[name] if study_names else None)
            runs = [run_summary(run_root / f"{group}_s{s}", entropy) for s in range(seeds)]
            runs = [r for r in runs if r]
            if not runs:
                continue
            v = vals[f"{opt}@{lr}:{policy}"] = [r["val"] for r in runs]
            sync = vals.get(f"{opt}@{lr}:sync")
            gap = (
                f"{statistics.mean(v) - statistics.mean(sync):+.4f}"
                if sync and policy != "sync"
                else ""
            )
            std = f" ± {statistics.stdev(v):.4f}" if len(v) > 1 else ""
            ex = max(r["exit"] for r in runs)
            worst_exit = max(worst_exit, ex)
            slopes += [r["slope"] for r in runs]
            lines.append(
                f"| {name} | {params / 1e6:.2f}M | {cfg.train.batch_size * cfg.data.seq_len} | "
                f"{cfg.train.num_steps} | {entropy:.3f} | {opt} {lr} {policy} | {len(runs)} | "
                f"{statistics.mean(v):.4f}{std} | {gap} | {_fmt_exit(ex)} | "
                f"{max(r['slope'] for r in runs):+.4f} | "
                f"{statistics.mean(r['seconds'] for r in runs):.0f} |"
            )
        verdicts.append(_criteria(name, vals, worst_exit, slopes, f"adamw@{lrs['adamw']}"))
    return "\n".join(lines + [""] + verdicts)


def group_table(run_root: Path, pattern: str, candidate: str) -> str:
    """One row per run group in `run_root` (a run's name without its `_s<seed>`) matching the
    glob `pattern`, for any study's names: the gap is to the group named with the last part
    (the arm: `2bw`, `2bw+ef`, ...) replaced by `sync`."""
    entropy = unigram_entropy(str(Path(candidate_config(candidate).data.resolved_dir()).resolve()))
    groups: dict[str, list[dict[str, float]]] = {}
    for d in sorted(p for p in run_root.iterdir() if p.is_dir()):
        group, _, seed = d.name.rpartition("_s")
        summary = run_summary(d, entropy) if seed.isdigit() else None
        if summary is not None:
            groups.setdefault(group, []).append(summary)
    lines = ["| run group | seeds | val (mean ± std) | gap to sync | plateau exit (worst seed) "
             "| end slope /10% |", "|---|---|---|---|---|---|"]  # fmt: skip
    for group, runs in groups.items():
        if not fnmatch.fnmatch(group, pattern):
            continue
        v = [r["val"] for r in runs]
        sync = groups.get(group.rpartition("_")[0] + "_sync")
        gap = "" if group.endswith("_sync") or not sync else (
            f"{statistics.mean(v) - statistics.mean(r['val'] for r in sync):+.4f}")  # fmt: skip
        std = f" ± {statistics.stdev(v):.4f}" if len(v) > 1 else ""
        lines.append(
            f"| {group} | {len(v)} | {statistics.mean(v):.4f}{std} | {gap} | "
            f"{_fmt_exit(max(r['exit'] for r in runs))} | {max(r['slope'] for r in runs):+.4f} |"
        )
    return "\n".join(lines)


def _criteria(
    name: str, vals: dict[str, list[float]], worst_exit: float, slopes: list[float], adamw: str
) -> str:
    """One line: (a), (b), (c) for a candidate, from what has run."""
    a = f"(a) worst plateau exit {_fmt_exit(worst_exit)} {'<=' if worst_exit <= 0.1 else '>'} 10%"
    sync_std = [statistics.stdev(v) for k, v in vals.items() if k.endswith(":sync") and len(v) > 1]
    if f"{adamw}:sync" in vals and f"{adamw}:2bw" in vals and sync_std:
        gap = statistics.mean(vals[f"{adamw}:2bw"]) - statistics.mean(vals[f"{adamw}:sync"])
        ok = max(sync_std) <= gap / 5
        b = f"(b) max sync std {max(sync_std):.4f} {'<=' if ok else '>'} AdamW gap/5 {gap / 5:.4f}"
    else:
        b = "(b) needs >= 2 seeds of a sync arm and AdamW sync + 2bw"
    c = (
        f"(c) worst end slope {max(slopes):+.4f} nats/10% ({'falling' if max(slopes) < 0 else 'NOT falling'})"
        if slopes
        else "(c) -"
    )
    return f"- {name}: {a}; {b}; {c}"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--candidates", default=",".join(CANDIDATES))
    p.add_argument("--arms", default="adamw:sync,adamw:2bw,muon:sync,muon:2bw")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lr", action="append", default=[], help="OPT=LR (default: scales.LRS)")
    p.add_argument("--out", default="runs/regime-probe", help="candidate N's runs: OUT/N")
    p.add_argument("--runs", help="the one candidate's runs are here instead of OUT/N")
    p.add_argument("--table-only", action="store_true", help="print the table, train nothing")
    p.add_argument("--study-names", action="store_true",
                   help="name an arm at its study LR (scales.LRS) as the optimizers study does, "
                   "for --runs in a study's sweep directory; otherwise every name holds its LR")  # fmt: skip
    p.add_argument("--groups", metavar="GLOB",
                   help="with --runs and --table-only: every run group whose name matches GLOB "
                   "(any study's names, e.g. 'adamw_b1*'), instead of --arms")  # fmt: skip
    args = p.parse_args()
    names = args.candidates.split(",")
    if args.groups:
        if not (args.runs and args.table_only and len(names) == 1):
            p.error("--groups reads one candidate's --runs with --table-only")
        print(group_table(Path(args.runs), args.groups, names[0]))
        return
    if args.runs and len(names) != 1:
        p.error("--runs takes one candidate")
    if args.study_names and not all(n in SCALES for n in names):
        p.error(f"--study-names needs study scales as candidates ({', '.join(SCALES)})")
    dirs = {n: Path(args.runs) if args.runs else Path(args.out) / n for n in names}
    arms = args.arms.split(",")
    lrs = LRS["cpu"] | LRS["cpu-regime"] | dict(kv.split("=") for kv in args.lr)
    if not args.table_only:
        for name, run_root in dirs.items():
            base = candidate_config(name)
            ensure_prepared(base.data)
            specs = arm_specs(arms, args.seeds, lrs, LRS[name] if args.study_names else None)
            run_sweep(trainer, specs, base, run_root, workers=args.workers)
    print(table(dirs, arms, args.seeds, lrs, args.study_names))


if __name__ == "__main__":
    main()
