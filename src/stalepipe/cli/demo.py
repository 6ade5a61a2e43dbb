"""`stalepipe demo`: the paper's headline on a laptop, in a few minutes.

AdamW and Muon each train the CPU preset on the built-in Shakespeare data under `sync`, `2bw`
(a one-step delay, PipeDream-2BW) and `2bw` + error feedback, with the same hyperparameters per
optimizer. Every run is an ordinary run directory under `out_dir` (config.json, metrics.jsonl,
checkpoint), trained by `train.loop.train`. The demo prints final validation losses, the gap
the delay opens over sync, and the share of that gap EF recovers, and writes
`out_dir/loss_curves.png` and `out_dir/demo.json`.

It ends with `stalepipe verdict` on its six runs (verdict/command.py): the token overhead of
each delayed run, measured from these runs' val curves, against throughputs simulated for the
cluster profile VERDICT (SmolLM-360M on H100s, hardware.py's `h100`, P = 8, m = 16),
net as a time-to-target ratio against the best synchronous schedule. One seed per run, so every
verdict reads "inconclusive" by the rule; the point estimates are what the demo shows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from stalepipe.config import ConfigError, DelayConfig, ExperimentConfig, OptimConfig, PipelineConfig
from stalepipe.errors import TrainingError
from stalepipe.fileio import write_atomic, write_text_atomic
from stalepipe.lab.sweeps.workers import Finished, run_spawned
from stalepipe.lab.verdict.command import VerdictReport, run_verdict
from stalepipe.lazy import require
from stalepipe.presets import cpu_tiny
from stalepipe.training.data import ensure_prepared
from stalepipe.training.train.loop import train

VARIANTS: dict[str, DelayConfig] = {
    "sync": DelayConfig(policy="sync"),
    "2bw": DelayConfig(policy="2bw"),
    "2bw+ef": DelayConfig(policy="2bw", ef=True),
}
# Tuned briefly on the cpu-tiny model: each trains well synchronously (400 steps: AdamW val
# ~2.06, Muon ~1.93); both are shared by all three variants of that optimizer.
DEMO_OPTIMIZERS: dict[str, OptimConfig] = {
    "adamw": OptimConfig(name="adamw", lr=3e-3),
    "muon": OptimConfig(name="muon", lr=0.02),
}
DEFAULT_STEPS = 400
# The cluster profile of the closing verdict: a GPU-scale model on H100s (hardware.py),
# the sizes the issue asks about (`stalepipe verdict --help` for the meaning of each).
VERDICT = {"model": "smollm-360m", "device": "h100", "stages": 8, "microbatches": 16}


@dataclass
class DemoRun:
    optimizer: str
    variant: str
    run_dir: str
    final_val_loss: float
    train_losses: list[float]
    wall_time_s: float


def demo_configs(out_dir: str | Path, steps: int = DEFAULT_STEPS) -> list[ExperimentConfig]:
    """The six runs: every optimizer under every variant, one run directory each."""
    base = cpu_tiny()
    train = dataclasses.replace(
        base.train,
        num_steps=steps,
        warmup_steps=max(1, steps // 10),
        lr_schedule="cosine",
        eval_every=max(1, steps // 16),  # 16 evals: the token overhead's resolution
        threads=1,
        progress=False,
    )
    return [
        dataclasses.replace(
            base,
            name=f"{opt}-{variant.replace('+', '-')}",
            out_dir=str(out_dir),
            optim=optim,
            delay=delay,
            pipeline=PipelineConfig(num_stages=2),
            train=train,
        )
        for opt, optim in DEMO_OPTIMIZERS.items()
        for variant, delay in VARIANTS.items()
    ]


def _run_one(cfg: ExperimentConfig) -> DemoRun:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    result = train(cfg, overwrite=True, verbose=False)
    opt, variant = cfg.optim.name, _variant_of(cfg.delay)
    return DemoRun(
        opt,
        variant,
        str(result.run_dir),
        result.final_val_loss,
        result.train_losses,
        time.perf_counter() - t0,
    )


def _variant_of(delay: DelayConfig) -> str:
    return next(name for name, d in VARIANTS.items() if d == delay)


def run_demo(
    out_dir: str | Path = "runs/demo",
    steps: int = DEFAULT_STEPS,
    workers: int = 2,
    verbose: bool = True,
) -> dict:
    """Train the six runs (`workers` processes, one thread each), print the table, write the
    plot and `demo.json`; return the summary dict."""
    if steps < 1 or workers < 1:
        raise ConfigError("--steps and --workers must be >= 1")
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    configs = demo_configs(out, steps)
    ensure_prepared(configs[0].data)  # once, before the workers start
    if verbose:
        print(
            f"stalepipe demo: {len(configs)} runs of {steps} steps ({', '.join(DEMO_OPTIMIZERS)} x "
            f"{', '.join(VARIANTS)}) on {workers} worker(s) -> {out}/"
        )
    if workers > 1:
        runs = _run_parallel(configs, workers, verbose)
    else:
        runs = [_run_one(c) for c in configs]
    summary = summarize(runs)
    summary["wall_time_s"] = time.perf_counter() - t0
    summary["steps"] = steps
    plot_path = out / "loss_curves.png"
    plot_curves(runs, plot_path)
    verdict = run_verdict(out, **VERDICT)  # type: ignore[arg-type]
    summary["verdict"] = verdict_rows(verdict)
    write_text_atomic(out / "demo.json", json.dumps(summary, indent=2))
    if verbose:
        print()
        print(format_table(summary))
        print(f"\nloss curves: {plot_path}; wall time {summary['wall_time_s']:.0f} s")
        print(
            f"\nverdict on a {VERDICT['model']} cluster profile ({VERDICT['device']}, "
            f"P={VERDICT['stages']}, m={VERDICT['microbatches']}; stalepipe verdict {out} "
            f"--model {VERDICT['model']} for the per-schedule tables):"
        )
        print(verdict.summary())
        print(f"per-schedule tables and plot: {verdict.out_dir}/verdict.md, verdict.png")
    return summary


def verdict_rows(report: VerdictReport) -> list[dict]:
    """The verdict's summary as JSON-ready rows for demo.json."""
    return [
        {
            "configuration": v.label,
            "token_overhead": v.overhead.describe(),
            "best_sync": v.best_sync.name if v.best_sync else None,
            "throughput_ratio": v.speedup,
            "time_to_target": v.ratio.value,
            "verdict": v.verdict,
        }
        for v in report.verdicts
    ]


def _run_parallel(configs: list[ExperimentConfig], workers: int, verbose: bool) -> list[DemoRun]:
    """The runs in spawned processes, `workers` at a time; the first failure stops the demo."""
    runs = []

    def done(f: Finished) -> None:
        if f.error is not None:
            raise f.error
        if f.exitcode != 0:
            raise TrainingError(
                f"demo run {f.key} died (exit status {f.exitcode}); rerun `stalepipe demo`"
            )
        run = f.result
        runs.append(run)
        if verbose:
            print(
                f"  {run.optimizer:>6} {run.variant:<7} val {run.final_val_loss:.4f} "
                f"({run.wall_time_s:.0f} s)"
            )

    run_spawned(_run_one, [(cfg.name, (cfg,)) for cfg in configs], workers, done)
    return runs


def summarize(runs: Sequence[DemoRun]) -> dict:
    """Per optimizer: val loss of each variant, delay gap to sync, share of it EF recovers."""
    by = {(r.optimizer, r.variant): r for r in runs}
    rows = {}
    for opt in DEMO_OPTIMIZERS:
        sync, delayed, ef = (by[(opt, v)].final_val_loss for v in VARIANTS)
        gap, gap_ef = delayed - sync, ef - sync
        rows[opt] = {
            "sync": sync,
            "2bw": delayed,
            "2bw+ef": ef,
            "gap_2bw": gap,
            "gap_2bw_ef": gap_ef,
            # share of the delay's gap EF closes; undefined when the delay costs nothing
            "ef_recovers": (gap - gap_ef) / gap if gap > 1e-3 else math.nan,
            "run_dirs": {v: by[(opt, v)].run_dir for v in VARIANTS},
        }
    return {"rows": rows}


def format_table(summary: dict) -> str:
    lines = [
        "final validation loss (lower is better)",
        f"{'optimizer':<10} {'sync':>7} {'2bw':>7} {'2bw+EF':>7} {'gap 2bw':>8} "
        f"{'gap +EF':>8} {'EF recovers':>11}",
    ]
    for opt, r in summary["rows"].items():
        rec = "n/a" if math.isnan(r["ef_recovers"]) else f"{100 * r['ef_recovers']:.0f}%"
        lines.append(
            f"{opt:<10} {r['sync']:>7.4f} {r['2bw']:>7.4f} {r['2bw+ef']:>7.4f} "
            f"{r['gap_2bw']:>+8.4f} {r['gap_2bw_ef']:>+8.4f} {rec:>11}"
        )
    return "\n".join(lines)


def plot_curves(runs: Sequence[DemoRun], path: Path) -> None:
    """Smoothed training-loss curves, one panel per optimizer."""
    require("matplotlib", "the demo's loss-curve plot").use("Agg")
    import matplotlib.pyplot as plt  # optional (the plots extra): required above

    fig, axes = plt.subplots(
        1, len(DEMO_OPTIMIZERS), figsize=(5 * len(DEMO_OPTIMIZERS), 3.6), sharey=True
    )
    styles = {"sync": ("-", "C0"), "2bw": ("--", "C3"), "2bw+ef": (":", "C2")}
    by = {(r.optimizer, r.variant): r for r in runs}
    for ax, opt in zip(axes, DEMO_OPTIMIZERS, strict=True):
        for variant, (line, color) in styles.items():  # same order and colour in every panel
            r = by.get((opt, variant))
            if r is None:
                continue
            ax.plot(
                _ema(r.train_losses),
                line,
                color=color,
                label=f"{variant} (val {r.final_val_loss:.3f})",
            )
        ax.set_title(opt)
        ax.set_xlabel("step")
        ax.legend()
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("train loss (EMA 0.9)")
    lo = min(min(_ema(r.train_losses)) for r in runs)
    axes[0].set_ylim(lo - 0.05, lo + 1.0)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120))  # never through a link
    plt.close(fig)


def _ema(xs: Sequence[float], beta: float = 0.9) -> list[float]:
    out, m = [], None
    for x in xs:
        m = x if m is None else beta * m + (1 - beta) * x
        out.append(m)
    return out
