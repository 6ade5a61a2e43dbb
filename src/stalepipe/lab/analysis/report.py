"""`stalepipe report runs/STUDY`: tables, significance tests and plots from run directories.

Writes into `<runs>/report/` (or `--out`): `report.md` (plots as PNG files next to it),
`report.html` (one file, plots embedded as base64 PNG), `summary.csv` (one row per
configuration, with the token overhead's columns) and `runs.csv` (one row per run). Reads only the run directories (see
`results.py`); works on partial sweeps and lists what is missing.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

from stalepipe.errors import UserError
from stalepipe.fileio import csv_text, shown, write_files
from stalepipe.lab.analysis import lengths, plots
from stalepipe.lab.analysis.claims import RULE, Claim, label, regime_check
from stalepipe.lab.analysis.markdown import Block, md_code, to_html, to_markdown
from stalepipe.lab.analysis.overhead import DEFAULT_RULE, Overhead
from stalepipe.lab.analysis.results import Row, Run, build_rows, load_runs, missing_summary
from stalepipe.lab.analysis.stats import Difference, fmt, fmt_ci, fmt_p, fmt_share
from stalepipe.lab.analysis.targets import TARGET_NAMES
from stalepipe.lab.studies.registry import declared_claims


def summary_table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """Per configuration: seeds, final val loss mean +- std, gap to sync with its 95 % interval
    and p-value (paired by seed where seeds pair; Welch's beside it), the regime check, and for
    mitigations the share of the unmitigated gap recovered (with its p-value)."""
    header = [
        "configuration",
        "seeds",
        "val loss (mean ± std)",
        "gap to sync",
        "95% CI",
        "p (gap)",
        "p (Welch)",
        "regime",
        "recovered",
        "p (vs unmitigated)",
        "baseline",
    ]
    body = []
    for r in rows:
        body.append(
            [
                r.label,
                f"{r.seeds_done}/{len(r.runs)}",
                f"{fmt(r.mean)} ± {fmt(r.std)}" if r.values else "-",
                ("0 (baseline)" if r.values else "-") if r.is_sync else fmt(r.gap_diff),
                fmt_ci(r.gap) or "-",
                fmt_p(_p(r.gap)) + ("" if r.gap is None or r.gap.paired else " (Welch)"),
                fmt_p(_p(r.gap_welch)),
                "-" if r.is_sync or r.baseline is None else (regime_check(r) or "ok"),
                fmt_share(r.recovered.share if r.recovered else math.nan),
                fmt_p(r.recovered.p if r.recovered else math.nan),
                r.baseline.label if r.baseline else "-",
            ]
        )
    return header, body


def _p(d: Difference | None) -> float:
    """A difference's p-value, nan without one."""
    return d.p if d is not None else math.nan


def target_table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """Per delayed configuration with a baseline: the token overhead at sync's final loss and
    at shares of its drop (`analysis.targets`)."""
    header = [
        "configuration",
        "seeds",
        *(f"at {n}" if n != "final" else "at sync's final" for n in TARGET_NAMES),
    ]
    body = []
    for r in rows:
        if not r.targets or not r.targets["final"].seeds:
            continue
        final = r.targets["final"]
        body.append(
            [r.label, str(len(final.seeds)), *(r.targets[n].describe() for n in TARGET_NAMES)]
        )
    return header, body


def overhead_table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """Per delayed configuration with a baseline: the token overhead at the baseline's losses
    (geometric mean over seeds of each seed's median over the band, 95% t-interval), the
    per-seed medians, the band of targets and the quality floor."""
    header = [
        "configuration",
        "baseline",
        "seeds paired",
        "token overhead (95% CI)",
        "per seed",
        "band (val loss)",
        "quality floor",
    ]
    body = []
    for r in rows:
        o = r.token_overhead
        if o is None or r.baseline is None:
            continue
        per_seed = " ".join(
            "floor" if p.floor else fmt(p.median, 2) if p.has_band else "-" for p in o.pairs
        )
        top, bottom = _band(o)
        band = f"{fmt(top, 3)} → {fmt(bottom, 3)}" if math.isfinite(top) else "-"
        floor = (
            f"{o.num_floors}/{o.num_seeds} seeds, gap {o.floor_gap:+.4f}" if o.num_floors else "no"
        )
        body.append(
            [
                r.label,
                r.baseline.label,
                str(o.num_seeds),
                o.describe(),
                per_seed or "-",
                band,
                floor,
            ]
        )
    return header, body


def _band(o: Overhead) -> tuple[float, float]:
    """The band shown for a configuration: its seed-mean curves' (the seeds' bands differ a
    little), else the widest over seeds; (nan, nan) when there is none."""
    if o.mean_pair is not None and o.mean_pair.has_band:
        return o.mean_pair.band
    bands = [p.band for p in o.pairs if p.has_band]
    if not bands:
        return math.nan, math.nan
    return max(b[0] for b in bands), min(b[1] for b in bands)


TARGET_TEXT = (
    "The target a user means by 'matches sync': sync's final val loss (per seed), and 99 / 95 / "
    "90 % of sync's loss drop from its first eval. Multiplier: the fewest tokens at which the "
    "delayed arm reaches the target (in any of its runs of that seed, longer planned runs of "
    "the same configuration included) over sync's tokens to it; geometric mean over seeds with "
    "a 95% interval. '> x': some seed never reached it within x times sync's tokens (a bound, "
    "not a number: plan longer runs, `stalepipe sweep length`). 'in warmup': sync reaches it "
    "inside warmup, where every arm's multiplier is about 1, so it is not read."
)

OVERHEAD_TEXT = (
    "Token overhead: T_delayed(L) / T_sync(L), T(L) the tokens a run needs to first reach val "
    "loss L; per seed (runs paired by seed) the median over a band of targets, over seeds the "
    "geometric mean with a 95% Student-t interval on the logarithms. A quality floor: the "
    "delayed run never reaches the band's bottom, so it reports its final-loss gap, not a "
    "multiplier (at equal token budgets that also covers a tax too large for the budget). "
    "Definitions: " + DEFAULT_RULE.describe() + " (docs/verdict.md)."
)


def claims(rows: list[Row]) -> list[Claim]:
    """The paper's qualitative claims, checked on whatever rows exist: (claim, verdict,
    evidence). Every claim function some study declares runs once, in the order the studies
    declare them (`registry.declared_claims`); a claim whose configurations are absent is left
    out."""
    return label([f for check in declared_claims() for f in check(rows)])


def _table(heading: str, text: str, header: list[str], body: list[list[str]]) -> list[Block]:
    """A heading, its paragraph and its table; nothing when the table has no rows."""
    if not body:
        return []
    return [Block("h", heading), Block("p", text), Block("table", header=header, rows=body)]


def _relation_blocks(rows: list[Row]) -> list[Block]:
    """gap = sync slope x ln(overhead) (issue 51): the overhead the equal-token gap implies
    beside the one measured from complete runs, per configuration with lengths runs."""
    relations = lengths.slope_relations(rows)
    if not relations:
        return []
    text = (
        "If a delayed run's loss curve is sync's shifted along ln(tokens), its equal-token gap "
        "is sync's final slope s times ln(token overhead). s = (L_1x - L_fx) / ln f from sync's "
        "complete runs at 1x and its shortest longer length; the implied overhead exp(gap / s) "
        "(mean over seeds) beside the measured one (where the final losses cross sync's 1x "
        "final loss; mean and 95 % t-interval over the same seeds). It holds where the implied "
        "overhead lies inside the measured one's interval."
    )
    body = [
        [
            r.label,
            f"{r.implied:.3f}",
            f"{r.measured:.3f} [{r.lo:.3f}, {r.hi:.3f}]",
            str(r.seeds),
            "holds" if r.holds else "fails",
        ]
        for r in relations
    ]
    header = ["configuration", "implied overhead", "measured overhead [95 %]", "seeds", "relation"]
    return [
        Block("h", "Gap = sync slope x ln(token overhead)"),
        Block("p", text),
        Block("table", header=header, rows=body),
    ]


STALENESS_TEXT = (
    "Runs trained with `--log.staleness`: per pipeline stage, u = |W_k+1 - W_k| / |W_k+1| (the "
    "relative size of an update) and c = the cosine between consecutive gradients, each the "
    "median over every stage and log step in [warmup, 2 x warmup) (the window the ladders' "
    "probes use; shorter if the run is). docs/RESULTS.md, 'Staleness across the ladders', sets "
    "the ladders' u and c beside their gaps and overheads: place a run of yours there."
)


def staleness_table(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    """One line per run that logged `log.staleness` (STALENESS_TEXT); values that are not
    numbers are skipped (records are read, not trusted)."""
    body = []
    for run in runs:
        warmup = run.config.get("train.warmup_steps", 0)
        warmup = warmup if isinstance(warmup, int) and warmup > 0 else 0
        lines = [r for r in run.staleness if isinstance(r.get("step"), int)]
        window = [r for r in lines if warmup <= r["step"] < 2 * warmup] if warmup else lines
        u, c = _finite(window, "update_rel/"), _finite(window, "grad_cos/")
        if u:
            lo, hi = window[0]["step"], window[-1]["step"]
            med_c = f"{statistics.median(c):.3f}" if c else "-"
            body.append(
                [run.name, f"{lo}-{hi}", str(len(window)), f"{statistics.median(u):.3g}", med_c]
            )
    return ["run", "log steps", "lines", "median u", "median c"], body


def _finite(lines: list[dict], prefix: str) -> list[float]:
    return [
        float(v)
        for r in lines
        for k, v in r.items()
        if k.startswith(prefix) and isinstance(v, (int, float)) and math.isfinite(v)
    ]


def build_report(root: Path, title: str | None = None) -> tuple[list[Block], list[Row], list[Run]]:
    runs = load_runs(root)
    if not runs:
        raise UserError(
            f"{shown(root)} holds no run directories (none with a config.json); run "
            f"`stalepipe sweep STUDY --out {shown(root)}` first"
        )
    rows = build_rows(runs)
    n_fin = sum(r.status == "finished" for r in runs)
    blocks = [Block("h", title or f"Report: {root.name}")]
    blocks.append(
        Block(
            "p",
            f"{n_fin} of {len(runs)} runs finished, {len(rows)} configurations. "
            f"Generated {time.strftime('%Y-%m-%d %H:%M')} from the run directories in {md_code(root)}. "
            "Val loss: final validation loss (same held-out batches for every run); mean ± sample std "
            "over seeds. Gap: mean minus the mean of the synchronous baseline (same config with "
            "`delay.policy sync`, mitigations off), with its 95 % interval. p: two-sided t-test, "
            "paired by seed where the seeds pair (Welch's beside it). "
            "Recovered: per seed (gap without − gap with the mitigation) / gap without, then the mean "
            "over seeds (its interval in the claims is over the same per-seed shares).",
        )
    )
    missing = missing_summary(runs, rows)
    if missing:
        blocks += [Block("h", "Missing"), Block("ul", items=missing)]
    header, body = summary_table(rows)
    blocks += [
        Block("h", "Final validation loss by configuration"),
        Block("table", header=header, rows=body),
    ]
    blocks += _table("Token overhead at sync's final loss", TARGET_TEXT, *target_table(rows))
    blocks += _table(
        "Token overhead over a band of the baseline's losses", OVERHEAD_TEXT, *overhead_table(rows)
    )
    checked = claims(rows)
    if checked:
        blocks += [
            Block("h", "The paper's qualitative claims"),
            Block("p", RULE),
            Block(
                "table",
                header=["claim", "verdict", "evidence"],
                rows=[list(c[:3]) for c in checked],
            ),
        ]
    png = plots.loss_curves(rows)
    if png:
        blocks += [Block("h", "Loss curves"), Block("img", text="loss_curves.png", png=png)]
    png = plots.overhead_plot(rows)
    if png:
        blocks += [
            Block("h", "Val loss against tokens, with the token overhead"),
            Block("img", text="token_overhead.png", png=png),
        ]
    png = lengths.length_plot(rows)
    if png:
        blocks += [
            Block("h", "Final loss against planned length (complete runs)"),
            Block("img", text="final_loss_vs_length.png", png=png),
        ]
    blocks += _relation_blocks(rows)
    blocks += _table("Staleness (log.staleness)", STALENESS_TEXT, *staleness_table(runs))
    for kind in plots.AXES:
        png = plots.gap_plot(rows, kind)
        if png:
            blocks += [
                Block("h", f"Gap vs {plots.AXES[kind][0]}"),
                Block("img", text=f"gap_vs_{kind}.png", png=png),
            ]
    return blocks, rows, runs


OVERHEAD_COLUMNS = [
    "token_overhead_status",
    "token_overhead",
    "token_overhead_ci_low",
    "token_overhead_ci_high",
    "token_overhead_seeds",
    "token_overhead_per_seed",
    "floor_seeds",
    "floor_gap",
    "band_top",
    "band_bottom",
    "token_overhead_mean_curve",
]


def overhead_cells(r: Row) -> list[object]:
    """The OVERHEAD_COLUMNS of summary.csv for one row (empty for rows without an overhead).
    Per seed: the medians over the band, "floor" or "nan" (no band); mean curve: the median
    over the band of the seed-mean curves (nan for a floor), beside the per-seed estimate."""
    o = r.token_overhead
    if o is None:
        return [""] * len(OVERHEAD_COLUMNS)
    return [
        o.status,
        o.estimate,
        o.ci_low,
        o.ci_high,
        o.num_seeds,
        " ".join("floor" if p.floor else f"{p.median:.6f}" for p in o.pairs),
        o.num_floors,
        o.floor_gap,
        *_band(o),
        o.mean_pair.median if o.mean_pair else "",
    ]


def csv_files(rows: list[Row], runs: list[Run]) -> dict[str, str]:
    """summary.csv (one row per configuration) and runs.csv (one per run), as text."""
    summary = [
        [
            "configuration",
            "seeds_finished",
            "seeds_total",
            "val_loss_mean",
            "val_loss_std",
            "values",
            "gap",
            "gap_p",
            "baseline",
            "recovered",
            "recovered_p",
            "unmitigated",
            *OVERHEAD_COLUMNS,
        ]
    ]
    for r in rows:
        summary.append(
            [
                r.label,
                r.seeds_done,
                len(r.runs),
                r.mean,
                r.std,
                " ".join(f"{v:.6f}" for v in r.values),
                r.gap_diff,
                _p(r.gap),
                r.baseline.label if r.baseline else "",
                r.recovered.share if r.recovered else math.nan,
                r.recovered.p if r.recovered else math.nan,
                r.unmitigated.label if r.unmitigated else "",
                *overhead_cells(r),
            ]
        )
    per_run = [["run", "status", "seed", "steps_done", "final_val_loss", "group", "error"]]
    per_run += [
        [r.name, r.status, r.seed, r.steps_done, r.final_val, r.group, r.error] for r in runs
    ]
    return {"summary.csv": csv_text(summary), "runs.csv": csv_text(per_run)}


def write_report(root: str | Path, out: str | Path | None = None, title: str | None = None) -> Path:
    """Build and write the report of the run directories under `root`; returns its directory.
    Every file is rendered before the first is written, each is written atomically, and none
    through a symbolic link (`fileio.write_files`): a bad record or a planted link leaves the
    previous report as it was. The default directory, `root`/report, must not lead out of
    `root`."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(
            f"{shown(root)} is not a directory; pass the --out of a sweep (e.g. runs/paper-mini)"
        )
    blocks, rows, runs = build_report(root, title)
    files: dict[str, bytes | str] = {b.text: b.png for b in blocks if b.kind == "img" and b.png}
    files["report.md"] = to_markdown(blocks)
    files["report.html"] = to_html(blocks)
    files.update(csv_files(rows, runs))
    if out:
        return write_files(out, files)
    return write_files(root / "report", files, within=root)
