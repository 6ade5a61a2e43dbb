"""The study commands of `stalepipe`: demo, sweep, report, verdict and toy (the runs behind a
claim, and what is read from their records). `stalepipe.cli` registers them."""

from __future__ import annotations

import argparse

from stalepipe.cli.common import Subparsers, runs
from stalepipe.errors import UserError
from stalepipe.fileio import shown
from stalepipe.lab.studies.registry import STUDIES
from stalepipe.lab.studies.scales import SCALES
from stalepipe.lab.studies.toy import toy_main
from stalepipe.lab.sweeps.executors import SlurmOptions
from stalepipe.lab.sweeps.grid import parse_set_args
from stalepipe.lab.sweeps.plan import study_table, sweep_main


def _add_demo(sub: Subparsers) -> None:
    p = sub.add_parser(
        "demo",
        help="the paper's headline on CPU: AdamW and Muon under sync / 2bw / 2bw+EF",
        description="Train AdamW and Muon on Shakespeare under sync, 2bw (one-step delay) and "
        "2bw + error feedback; print final val losses, the delay gap and the share "
        "EF recovers; write loss_curves.png. About 5-10 minutes on 2 CPU cores.",
    )
    p.add_argument("--out-dir", default="runs/demo", help="parent of the six run directories")
    p.add_argument("--steps", type=int, default=400, help="steps per run")
    p.add_argument("--workers", type=int, default=2, help="parallel runs (1 thread each)")
    p.set_defaults(fn=runs("stalepipe.cli.demo:run_demo", prints=False))


def _add_sweep(sub: Subparsers) -> None:
    p = sub.add_parser(
        "sweep",
        help="run a study (a grid of runs, parallel, resumable)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a study or an ad-hoc grid: one run directory per (configuration, seed) "
        "under --out. Rerunning skips finished runs and resumes interrupted ones; failed runs "
        "(error.json in their directory) are rerun only with --retry-failed. Then: "
        "stalepipe report OUT.",
        epilog="studies (run counts at --scale cpu and --seeds 3; CPU core-hours on a lightly "
        "loaded machine, about twice that on a busy one; divide by --workers for wall time):\n"
        + study_table(seeds=3)
        + "\n\nexamples:\n  stalepipe sweep paper-mini --workers 2\n"
        "  stalepipe sweep --grid optim.name=adamw,muon --grid delay.policy=sync,2bw "
        "--set train.num_steps=100 --seeds 2 --out runs/mygrid",
    )
    add = p.add_argument
    add(
        "study",
        metavar="STUDY",
        nargs="?",
        choices=[*STUDIES, "toy"],
        help="study name (see below)",
    )
    add("--scale", default="cpu", choices=SCALES, help="model scale (studies/scales.py)")
    add("--seeds", type=int, default=3, help="seeds per configuration (default 3)")
    add(
        "--workers",
        type=int,
        default=None,
        help="runs in parallel, one process each "
        "(default: one per visible GPU when the runs use train.device cuda, else 1)",
    )
    add("--out", help="sweep directory (default runs/STUDY)")
    add("--grid", action="append", metavar="KEY=V1,V2", help="an ad-hoc axis (repeatable)")
    add("--set", action="append", metavar="KEY=VALUE", help="override for every run (repeatable)")
    add(
        "--only",
        action="append",
        metavar="KEY=V1,V2",
        help="run only the runs whose config has one of these values (repeatable)",
    )
    add("--retry-failed", action="store_true", help="rerun runs that failed before")
    add(
        "--extend",
        metavar="F1,F2",
        help="also run every delayed arm at these multiples of its "
        "steps (e.g. 1.25,1.5,2), the schedule stretched: the verdict's time to sync's final loss "
        "reads them (docs/verdict.md)",
    )
    add(
        "--lengths",
        metavar="F1,F2",
        help="also run every configuration, sync too, at these multiples of its steps (e.g. "
        "1.1,1.2,1.35,1.5), each a complete run with its schedule stretched: the token overhead "
        "at sync's final loss is read from their final losses (docs/verdict.md)",
    )
    add(
        "--dry-run",
        action="store_true",
        help="list the runs and their status, run none "
        "(with --executor slurm: and print the sbatch array script)",
    )
    _add_executor(p)
    p.set_defaults(fn=cmd_sweep)


def _add_executor(p: argparse.ArgumentParser) -> None:
    """Where the runs execute: the local pool, or SLURM job arrays through submitit."""
    g = p.add_argument_group("executor (docs/cluster.md)")
    add = g.add_argument
    add(
        "--executor",
        default="local",
        choices=["local", "slurm", "submitit-local", "submitit-debug"],
        help="local: this machine, --workers at a time; slurm: one job array (submitit), "
        "one task per run; submitit-local/-debug: submitit's local executors (checks)",
    )
    add("--slurm-partition", metavar="NAME")
    add("--slurm-account", metavar="NAME")
    add("--slurm-qos", metavar="NAME")
    add("--slurm-time", type=int, metavar="MIN", help="time limit per run (default 240)")
    add(
        "--slurm-gpus-per-run",
        type=int,
        metavar="N",
        help="GPUs per run (default: 1 when the runs train on cuda, else 0)",
    )
    add(
        "--slurm-cpus-per-run",
        type=int,
        metavar="N",
        help="CPUs per run (default: 8 for cuda runs, else train.threads or 1)",
    )
    add("--slurm-mem", metavar="SIZE", help="memory per run (default: 64G cuda, else 8G)")
    add("--slurm-array-parallelism", type=int, metavar="N", help="runs at once (default 64)")
    add(
        "--slurm-sbatch",
        action="append",
        metavar="KEY=VALUE",
        help="an extra #SBATCH line, e.g. constraint=h100 (repeatable)",
    )
    add(
        "--slurm-setup",
        action="append",
        metavar="LINE",
        help="a shell line before each run, e.g. 'module load cuda' (repeatable)",
    )


def _factors(text: str | None) -> tuple[float, ...]:
    """--extend / --lengths F1,F2 as numbers; a one-line error naming the form."""
    if not text:
        return ()
    try:
        return tuple(float(f) for f in text.split(",") if f.strip())
    except ValueError:
        raise UserError(
            f"--extend / --lengths take numbers > 1, e.g. 1.2,1.5; got {text!r}"
        ) from None


def slurm_options(args: argparse.Namespace) -> object:
    """The --slurm-* flags as SlurmOptions (None when none is given)."""
    given = {
        "partition": args.slurm_partition,
        "account": args.slurm_account,
        "qos": args.slurm_qos,
        "time_min": args.slurm_time,
        "gpus_per_run": args.slurm_gpus_per_run,
        "cpus_per_run": args.slurm_cpus_per_run,
        "mem": args.slurm_mem,
        "array_parallelism": args.slurm_array_parallelism,
        "sbatch": tuple(args.slurm_sbatch or ()) or None,
        "setup": tuple(args.slurm_setup or ()) or None,
    }
    given = {k: v for k, v in given.items() if v is not None}
    return SlurmOptions(**given) if given else None


def cmd_sweep(args: argparse.Namespace, extra: list[str]) -> int:
    from stalepipe.training.launch import task  # here: see cli/__init__.py

    if args.study == "toy":
        return cmd_toy(args, extra)
    failed = sweep_main(
        args.study,
        task,  # the training wing trains each run; the lab's sweep only plans and counts
        scale=args.scale,
        seeds=args.seeds,
        workers=args.workers,
        out=args.out,
        grids=args.grid or [],
        fixed=parse_set_args(args.set or []),
        only=args.only or [],
        retry_failed=args.retry_failed,
        dry_run=args.dry_run,
        executor=args.executor,
        slurm=slurm_options(args),
        extend=_factors(args.extend),
        lengths=_factors(args.lengths),
    )
    return 1 if failed else 0


def _add_report(sub: Subparsers) -> None:
    p = sub.add_parser(
        "report",
        help="tables, t-tests and plots of a sweep (Markdown, HTML, CSV)",
        description="Read the run directories under RUNS (never retrains) and write report.md, "
        "a single-file report.html, summary.csv and runs.csv into RUNS/report (or --out): final "
        "val loss mean ± std over seeds, gap to sync with a Welch t-test, share of the gap each "
        "mitigation recovers, the paper's claims, loss curves and gap plots. Partial sweeps are "
        "fine; the report lists what is missing.",
    )
    p.add_argument("runs", metavar="RUNS", help="a sweep directory, e.g. runs/paper-mini")
    p.add_argument("--out", help="output directory (default RUNS/report)")
    p.add_argument("--title", help="report title")
    p.set_defaults(fn=cmd_report)


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    from stalepipe.lab.analysis.report import write_report  # here: see cli/__init__.py

    out = write_report(args.runs, args.out, title=args.title)
    print(f"report written to {shown(out)}/report.md, report.html, summary.csv, runs.csv")
    return 0


def _add_verdict(sub: Subparsers) -> None:
    p = sub.add_parser(
        "verdict",
        help="does 2bw reach the target loss sooner than the best sync schedule? (net of its "
        "token overhead)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time to target = token overhead / (throughput 2bw / throughput of the best "
        "synchronous schedule).\nThe token overhead is measured from the runs in SWEEP_DIR "
        "(each delayed configuration against\nits sync baseline, paired by seed, 95% interval "
        "over seeds); the throughputs are simulated\n(--model on --device at P = --stages, "
        "m = --microbatches) or measured (--costs FILE).\nWrites verdict.md, verdict.csv and "
        "verdict.png into SWEEP_DIR/verdict (or --out). docs/verdict.md.",
        epilog="examples:\n  stalepipe verdict runs/demo --cluster h100-ib --gpus 32 --global-batch 256\n"
        "  stalepipe verdict runs/demo --cluster h100-ib --inter-node-gbps 25\n"
        "  stalepipe verdict runs/demo --model smollm-360m --stages 8 "
        "--microbatches 16 --device h100\n  stalepipe verdict runs/paper-mini --costs "
        "costs.json   # measured tokens/s per schedule",
    )
    add = p.add_argument
    add("sweep_dir", metavar="SWEEP_DIR", help="a sweep's run directories (e.g. runs/demo)")
    add(
        "--cluster",
        metavar="PRESET|FILE",
        help="compare 2bw with every synchronous way to train (DP, FSDP, each pipeline "
        "schedule over P and m, hybrids) on a cluster: h100-ib | h100-eth100 | h100-eth25 | "
        "h100-pcie | a100-ib, or a .json/.toml file (docs/verdict.md); verdict.png is the map",
    )
    add("--gpus", type=int, help="with --cluster: GPUs (default 4 nodes)")
    add(
        "--global-batch",
        metavar="N|Ntok",
        help="with --cluster: sequences per step, or tokens ('1Mtok'), at least GPUs / GPUs a "
        "node (a TP group shares its sequences; default: the preset's)",
    )
    add(
        "--inter-node-gbps", type=float, help="with --cluster: override its inter-node Gb/s per GPU"
    )
    add(
        "--no-map",
        action="store_true",
        help="with --cluster: skip the crossover map (133 cells: minutes for a 70B+ model)",
    )
    add(
        "--model",
        help="preset or simulator shape (e.g. smollm-360m; --cluster: default smollm-360m)",
    )
    add("--stages", type=int, help="without --cluster: pipeline ranks P (default 8)")
    add("--microbatches", type=int, help="without --cluster: microbatches per step m (default 16)")
    add("--device", default="h100", help="without --cluster: h100 | h200 | a100 | cpu")
    add(
        "--mfu",
        type=float,
        default=None,
        help="model FLOPs utilisation assumed for every "
        "shape (default: --cluster, by matmul size, sim/efficiency.py; --model, 0.4)",
    )
    add("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    add("--microbatch-size", type=int, default=1, help="sequences per microbatch (default 1)")
    add(
        "--costs",
        metavar="FILE",
        help="measured tokens/s per schedule (.json / .csv) instead of --model",
    )
    add("--out", help="output directory (default SWEEP_DIR/verdict)")
    add(
        "--overhead",
        metavar="X,LOW,HIGH[@SIZE]",
        help="also judge a token overhead from elsewhere (e.g. the size ladder's fit at the target "
        "model: 1.05,1.01,1.10@360M) against the same best synchronous configuration",
    )
    add(
        "--overhead-fit",
        metavar="LADDER_DIR@SIZE",
        help="also judge the size ladder's fitted token overhead of Muon+EF (its registered fit "
        "over the ladder's lengths runs in LADDER_DIR) at SIZE: 135M, 360M or a number of "
        "non-embedding parameters, e.g. docs/results/ladder-regime@360M",
    )
    add("--json", action="store_true", help="print the summary as JSON")
    add("--verbose", action="store_true", help="print every table, not the decision block")
    p.set_defaults(fn=runs("stalepipe.lab.verdict.command:verdict_main"))


def _add_toy(sub: Subparsers) -> None:
    p = sub.add_parser(
        "toy",
        help="theory check: delayed Muon +- EF on matrix least squares (seconds)",
        description="Muon (polar-factor LMO) with a one-step delay, with and without error "
        "feedback, on matrix least squares with a known optimum: convergence and the delay "
        "penalty vs the step size. Writes toy.md, toy.csv, toy.png.",
    )
    p.add_argument("--out", default="runs/toy", help="output directory (default runs/toy)")
    p.add_argument("--steps", type=int, default=500, help="iterations (default 500)")
    p.add_argument("--seeds", type=int, default=3, help="random problems averaged (default 3)")
    p.set_defaults(fn=cmd_toy)


def cmd_toy(args: argparse.Namespace, extra: list[str]) -> int:
    out = getattr(args, "out", None) or "runs/toy"
    print(toy_main(out, steps=getattr(args, "steps", 500), seeds=getattr(args, "seeds", 3)))
    print(f"written to {out}/toy.md, toy.csv, toy.png")
    return 0
