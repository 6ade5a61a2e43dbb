"""Staleness across the ladders (issue 51, item 4; the analysis registered in docs/RESULTS.md
'Staleness across the ladders' before any probe ran).

    python benchmarks/studies/staleness_probe.py run      # the probes (about 30 core-minutes)
    python benchmarks/studies/staleness_probe.py          # the table, the tests and the plot

`run` reruns seed 0 of each ladder's sync and 2bw arms at 1x from its committed config.json, with
`log.staleness` on, for its first 2 x warmup_steps steps (the run's exact prefix: the WSD schedule
is the full run's), checks every step's train loss against the committed record bit for bit and
writes what it logged to docs/results/staleness-probe/LADDER/RUN.json. A probe already written is
kept (delete it to redo it). The default prints the registered reading and writes the plot.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stalepipe.lab.analysis import overhead_ladder as ol
from stalepipe.lab.analysis import scaling, stats
from stalepipe.lab.analysis.plots import png_bytes, pyplot

LADDERS = {
    "ladder-regime": "docs/results/ladder-regime",
    "overhead-ladder": "docs/results/overhead-ladder",
}
OUT = Path("docs/results/staleness-probe")
PERMUTATIONS = 200_000  # the registered permutation test's draws (seed 0)


@dataclass(frozen=True)
class Point:
    """One ladder group: its sync and 2bw probes' medians and the 2bw quantity set beside them
    (the equal-token gap, or the token overhead)."""

    optimizer: str
    width: int
    u_sync: float  # median update_rel over stages and the window's log steps
    c_sync: float  # median grad_cos likewise
    u_2bw: float
    c_2bw: float
    y: float  # the 2bw gap (size ladder) or token overhead (overhead ladder)
    seeds: int  # how many seeds the y is the mean of


def arm_of(saved: dict) -> str:
    """ "sync", "2bw", "2bw+ef", ... from a config.json's delay section."""
    d = saved["delay"]
    return "sync" if d["policy"] == "sync" else d["policy"] + ("+ef" if d["ef"] else "")


def probe_sources(root: Path) -> list[Path]:
    """Seed 0's sync and 2bw runs at 1x of every group of `root` with a 2bw arm (the chosen LRs:
    the ladder's LR scan ran sync only), finished runs only."""
    runs = []
    for cfg_path in sorted(root.glob("*/config.json")):
        c = json.loads(cfg_path.read_text())
        t = c["train"]
        key = (c["optim"]["name"], c["model"]["dim"], float(c["optim"]["lr"]))
        runs.append((key, arm_of(c), int(t["seed"]), int(t["num_steps"]), cfg_path.parent))
    done = {
        (r.optimizer, r.width, r.lr, r.arm, r.seed, r.tokens) for r in scaling.ladder_runs(root)
    }
    base = {}
    for key, _arm, _seed, steps, _d in runs:
        base[key] = min(base.get(key, steps), steps)
    with_2bw = {key for key, arm, *_ in runs if arm == "2bw"}
    out = []
    for key, arm, seed, steps, d in runs:
        if key in with_2bw and arm in ("sync", "2bw") and seed == 0 and steps == base[key]:
            c = json.loads((d / "config.json").read_text())
            tokens = steps * int(c["train"]["batch_size"]) * int(c["data"]["seq_len"])
            if (*key, arm, seed, tokens) in done:
                out.append(d)
    return out


def medians(rec: dict) -> tuple[float, float]:
    """A probe's registered summary: the medians of update_rel and grad_cos over every stage
    and every log step in [warmup_steps, 2 x warmup_steps)."""
    w = rec["warmup_steps"]
    rows = [r for r in rec["log"] if w <= r["step"] < 2 * w]
    u = [v for r in rows for k, v in r.items() if k.startswith("update_rel/")]
    c = [v for r in rows for k, v in r.items() if k.startswith("grad_cos/") and math.isfinite(v)]
    return float(np.median(u)) if u else math.nan, float(np.median(c)) if c else math.nan


def read_probes(out: Path) -> dict[str, dict]:
    """source ("LADDER/RUN") -> probe record; a void probe (its prefix not bit-equal to the
    record) is printed and left out."""
    probes = {}
    for p in sorted(out.glob("*/*.json")):
        rec = json.loads(p.read_text())
        if not rec["exact"]:
            print(f"void: {rec['source']} (steps {rec['mismatched_steps']} differ from its record)")
            continue
        probes[rec["source"]] = rec
    return probes


def _pair(probes: dict[str, dict], ladder: str, opt: str, width: int) -> tuple | None:
    got = {r["arm"]: medians(r) for r in probes.values()
           if r["source"].startswith(ladder + "/") and (r["optimizer"], r["width"]) == (opt, width)}  # fmt: skip
    if "sync" not in got or "2bw" not in got:
        return None
    return (*got["sync"], *got["2bw"])


def size_ladder_points(probes: dict[str, dict], root: Path) -> list[Point]:
    """Per (optimizer, width) of the size ladder: the probes and 2bw's gap at 1x, the mean over
    its seeds of 2bw minus sync final val_loss_full (same seed, same LR, same tokens)."""
    runs = [r for r in scaling.ladder_runs(root)]
    out = []
    for opt, width in sorted({(r["optimizer"], r["width"]) for r in probes.values()}):
        pair = _pair(probes, "ladder-regime", opt, width)
        if pair is None:
            continue
        mine = [r for r in runs if (r.optimizer, r.width) == (opt, width)]
        lr = next(r.lr for r in mine if r.arm == "2bw")
        tokens = min(r.tokens for r in mine if r.lr == lr)
        sync = {r.seed: r.loss for r in mine if (r.arm, r.lr, r.tokens) == ("sync", lr, tokens)}
        gaps = [r.loss - sync[r.seed] for r in mine
                if (r.arm, r.lr, r.tokens) == ("2bw", lr, tokens) and r.seed in sync]  # fmt: skip
        if gaps:
            out.append(Point(opt, width, *pair, y=float(np.mean(gaps)), seeds=len(gaps)))
    return out


def overhead_points(probes: dict[str, dict], runs: list) -> list[Point]:
    """Per width of the overhead ladder (Muon): the probes and the mean of 2bw's per-seed token
    overheads (the registered reading; a bound counts at its value)."""
    per_n: dict[int, list[float]] = {}
    for p in ol.seed_overheads(runs, "2bw"):
        per_n.setdefault(p.n, []).append(p.overhead)
    width_of = {r.params: r.width for r in runs}
    out = []
    for n, overheads in sorted(per_n.items()):
        pair = _pair(probes, "overhead-ladder", "muon", width_of[n])
        if pair is not None:
            out.append(
                Point("muon", width_of[n], *pair, y=float(np.mean(overheads)), seeds=len(overheads))
            )
    return out


def permutation_spearman(xs: list[float], ys: list[float], seed: int = 0) -> tuple[float, float]:
    """Spearman's rho and its two-sided permutation p (`PERMUTATIONS` draws, +1 smoothing)."""
    rho = stats.spearman(xs, ys)
    rx = np.argsort(np.argsort(xs)).astype(float)
    ry = np.argsort(np.argsort(ys)).astype(float)
    rng = np.random.default_rng(seed)
    perm = rng.permuted(np.tile(ry, (PERMUTATIONS, 1)), axis=1)
    rx, perm = rx - rx.mean(), perm - perm.mean(axis=1, keepdims=True)
    null = perm @ rx / (np.linalg.norm(perm, axis=1) * np.linalg.norm(rx))
    p = (1 + int(np.sum(np.abs(null) >= abs(rho) - 1e-12))) / (PERMUTATIONS + 1)
    return rho, p


def tests(points: list[Point]) -> list[str]:
    """The registered tests on the size ladder's points, worded."""
    if len(points) < 4:
        return [f"{len(points)} points: no test yet (the registration reads 10)"]
    gaps = [p.y for p in points]
    measures = {
        "u (sync)": [p.u_sync for p in points],
        "1 - c (sync)": [1 - p.c_sync for p in points],
    }
    results = {name: permutation_spearman(xs, gaps) for name, xs in measures.items()}
    lines = [f"Spearman across {len(points)} (width, optimizer) points, against the 2bw gap:"]
    for (name, (rho, p)), p_holm in zip(
        results.items(), stats.holm([p for _, p in results.values()])
    ):
        word = "tracks the gap" if rho > 0 and p_holm < 0.05 else "not shown"
        lines.append(f"  {name}: rho {rho:+.2f}, p {p:.4f}, Holm p {p_holm:.4f}: {word}")
    for opt in sorted({p.optimizer for p in points}):
        mine = [p for p in points if p.optimizer == opt]
        if len(mine) >= 3:
            rho, p = permutation_spearman([q.u_sync for q in mine], [q.y for q in mine])
            lines.append(
                f"  within {opt} ({len(mine)} widths), u (sync): rho {rho:+.2f}, p {p:.3f} (not labelled)"
            )
    lines += _placement(points)
    return lines


def _placement(points: list[Point]) -> list[str]:
    """The OLS of ln gap on ln u (sync) over the points with a positive gap, slope's 95 % t."""
    pts = [p for p in points if p.y > 0]
    if len(pts) < 3:
        return ["placement fit: fewer than 3 positive gaps"]
    x, y = np.log([p.u_sync for p in pts]), np.log([p.y for p in pts])
    b, a = np.polyfit(x, y, 1)
    resid = y - (a + b * x)
    df = len(pts) - 2
    se = (
        math.sqrt(float(resid @ resid) / df / float(((x - x.mean()) ** 2).sum()))
        if df
        else math.nan
    )
    t = stats.t_quantile(0.975, df)
    left = len(points) - len(pts)
    return [
        f"placement: ln gap = {a:.2f} + {b:.2f} ln u, slope 95 % [{b - t * se:.2f}, {b + t * se:.2f}] "
        f"({len(pts)} points{f', {left} with a gap <= 0 left out' if left else ''})",
        f"  assumption: holds for u inside [{min(p.u_sync for p in pts):.2e}, {max(p.u_sync for p in pts):.2e}] "
        "and 0.1-2M-parameter models at 128-token sequences; elsewhere an extrapolation",
    ]


def table(points: list[Point], title: str) -> str:
    lines = [
        title,
        f"{'optimizer':>9} {'width':>5} {'u sync':>9} {'c sync':>7} {'u 2bw':>9} {'c 2bw':>7} {'2bw':>8} seeds",
    ]
    for p in points:
        lines.append(
            f"{p.optimizer:>9} {p.width:>5} {p.u_sync:9.2e} {p.c_sync:7.3f} {p.u_2bw:9.2e} {p.c_2bw:7.3f} {p.y:8.4f} {p.seeds:>5}"
        )
    return "\n".join(lines)


def plot(size: list[Point], over: list[Point]) -> bytes | None:
    """Gap against u and against 1 - c (size ladder, both optimizers); Muon's overhead against
    u (overhead ladder)."""
    if not size and not over:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for opt, marker in (("adamw", "o"), ("muon", "s")):
        mine = [p for p in size if p.optimizer == opt]
        for ax, xs in (
            (axes[0], [p.u_sync for p in mine]),
            (axes[1], [1 - p.c_sync for p in mine]),
        ):
            ax.scatter(xs, [p.y for p in mine], marker=marker, label=opt)
            for x, p in zip(xs, mine):
                ax.annotate(
                    f"d{p.width}", (x, p.y), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
    axes[0].set(
        xscale="log",
        xlabel="update_rel u (sync probe, median)",
        ylabel="2bw gap at 1x",
        title="size ladder",
    )
    axes[1].set(
        xlabel="1 - grad_cos (sync probe, median)", ylabel="2bw gap at 1x", title="size ladder"
    )
    axes[2].scatter(
        [p.u_sync for p in over], [p.y for p in over], marker="s", color="C1", label="muon"
    )
    for p in over:
        axes[2].annotate(
            f"d{p.width}", (p.u_sync, p.y), fontsize=7, xytext=(3, 3), textcoords="offset points"
        )
    axes[2].set(
        xlabel="update_rel u (sync probe, median)",
        ylabel="2bw token overhead",
        title="overhead ladder",
    )
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for ax in axes[:1]:  # plain tick labels (pyplot() reads no mathtext)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return png_bytes(fig)


def probe(src: Path, dest: Path, data_dir: Path) -> dict:
    """Rerun `src`'s committed config for its probe window and return what it logged."""
    import tempfile

    import torch

    from stalepipe.config import ExperimentConfig
    from stalepipe.training.schedules.plan import StepPlan
    from stalepipe.training.train.distributed import DistContext
    from stalepipe.training.train.emulated import EmulatorEngine

    saved = json.loads((src / "config.json").read_text())
    saved["log"]["staleness"] = True
    saved["train"]["log_every"] = 10
    cfg = ExperimentConfig.from_dict(saved, strict=False)
    recorded = [json.loads(line) for line in (src / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in recorded}
    steps = 2 * cfg.train.warmup_steps
    torch.set_num_threads(1)
    log, mismatch, t0 = [], [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        engine = EmulatorEngine(cfg, DistContext(), torch.device("cpu"), data_dir, Path(tmp))
        for r in engine.steps(StepPlan(cfg.train)):
            if r.loss != losses.get(r.step):
                mismatch.append(r.step)
            if r.staleness:
                log.append({"step": r.step, **r.staleness})
            if r.step + 1 >= steps:
                break
    return {
        "source": f"{src.parent.name}/{src.name}",
        "optimizer": cfg.optim.name,
        "width": cfg.model.dim,
        "arm": arm_of(saved),
        "warmup_steps": cfg.train.warmup_steps,
        "steps": steps,
        "exact": not mismatch,
        "mismatched_steps": mismatch[:10],
        "wall_s": round(time.perf_counter() - t0, 1),
        "log": log,
    }


def run(data_dir: Path) -> None:
    todo = [(name, src) for name, root in LADDERS.items() for src in probe_sources(Path(root))]
    print(f"{len(todo)} probes: seed 0, sync and 2bw at 1x of each ladder group")
    for i, (ladder, src) in enumerate(todo, 1):
        dest = OUT / ladder / f"{src.name}.json"
        if dest.exists():
            print(f"[{i}/{len(todo)}] {ladder}/{src.name}: kept")
            continue
        rec = probe(src, dest, data_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(rec, indent=1) + "\n")
        state = "exact" if rec["exact"] else f"VOID (steps {rec['mismatched_steps']} differ)"
        print(
            f"[{i}/{len(todo)}] {ladder}/{src.name}: {rec['steps']} steps, {state}, {rec['wall_s']} s",
            flush=True,
        )


def report(draw: bool = True) -> None:
    probes = read_probes(OUT)
    if not probes:
        sys.exit("stalepipe: no probes under docs/results/staleness-probe; run with `run` first")
    size = size_ladder_points(probes, Path(LADDERS["ladder-regime"]))
    print(table(size, "size ladder (2bw gap at 1x, mean of its seeds)"))
    for line in tests(size):
        print(line)
    runs = scaling.ladder_runs(Path(LADDERS["overhead-ladder"]))
    over = overhead_points(probes, runs)
    print(table(over, "overhead ladder (Muon 2bw token overhead, mean of its complete seeds)"))
    png = plot(size, over) if draw else None
    if png is not None:
        (OUT / "staleness.png").write_bytes(png)
        print(f"plot: {OUT / 'staleness.png'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", choices=["run", "report"], default="report")
    ap.add_argument("--data-dir", default="data_cache/shakespeare-byte-val0.08")
    ap.add_argument("--no-plot", action="store_true", help="print the reading, write no plot")
    args = ap.parse_args()
    run(Path(args.data_dir)) if args.mode == "run" else report(draw=not args.no_plot)


if __name__ == "__main__":
    main()
