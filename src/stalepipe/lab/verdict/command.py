"""`stalepipe verdict SWEEP_DIR`: does the asynchronous schedule reach the target loss sooner
than the best synchronous one, net of its token overhead? (docs/design.md, 'What we report';
docs/verdict.md)

    time to target (async / best sync) = token overhead / (throughput_async / throughput_best_sync)

The token overhead is measured: the runs under SWEEP_DIR, each delayed configuration against its
synchronous baseline (`results.build_rows`, `overhead.py`), paired by seed, with its interval
over seeds. The throughputs are simulated (`throughput.simulated`: the timing simulator on a
model, device, P and m) or measured (`throughput.load_costs`: a small JSON or CSV file), and the
output says which. The ratio's interval is the overhead's over the seeds, divided by the
throughput edge at the ends of its range (the cluster model's assumptions; else a constant).

Writes `verdict.md`, `verdict.csv` and `verdict.png` into SWEEP_DIR/verdict (or `out`).
"""

from __future__ import annotations

import json as _json  # the name `json` is a flag of verdict_main
import math
from dataclasses import astuple, dataclass
from pathlib import Path

from stalepipe.config import ExperimentConfig, upgrade_record
from stalepipe.errors import UserError
from stalepipe.fileio import read_json_record, write_files
from stalepipe.lab.analysis import plots
from stalepipe.lab.analysis.markdown import md_fenced, md_text
from stalepipe.lab.analysis.results import Row, build_rows, load_runs, longer_runs
from stalepipe.lab.verdict import decision
from stalepipe.lab.verdict.rule import (
    RULE,
    Transfer,
    Verdict,
    at_size,
    call,
    default_transfer,
    model_params,
    model_size,
    overhead_source,
    size_text,
    time_to_target,
)
from stalepipe.lab.verdict.tables import (
    SUMMARY_HEADER,
    align,
    format_verdict,
    intervals_line,
    summary_rows,
    verdict_csv,
    verdict_json,
)
from stalepipe.lab.verdict.throughput import (
    ScheduleThroughput,
    Throughputs,
    arm_of,
    async_schedule,
    costed_as,
    load_costs,
    simulated,
)
from stalepipe.training.delay import DelaySchedule
from stalepipe.training.delay.policies import never_delays


def _label(row: Row) -> str:
    """The sweep's label, or `optimizer policy +mitigation` for plain run directories."""
    if all(r.group for r in row.runs):
        return row.label
    mit = " ".join(
        ("+" + k.split(".")[-1]) if v is True else f"+{k.split('.')[-1]}={v}"
        for k, v in row.mitigations.items()
    )
    return " ".join(filter(None, [str(row.config.get("optim.name", "")), row.policy, mit]))


def sync_window_share(row: Row) -> float:
    """Share of the run's steps with tau = 0 (delay.sync_start / sync_cooldown windows, the
    WSD-aligned cooldown included), from its first run's config.json."""
    run_dir = row.runs[0].path
    record = read_json_record(run_dir, run_dir / "config.json")  # no link out of the run
    cfg = ExperimentConfig.from_dict(upgrade_record(record), strict=False)
    steps = cfg.train.num_steps
    delay = DelaySchedule.build(cfg.delay, cfg.pipeline.num_stages, steps, train=cfg.train)
    return sum(delay.in_sync_window(k) for k in range(steps)) / steps


def judge(
    row: Row, tp: Throughputs, a: ScheduleThroughput, transfer: Transfer | None = None
) -> Verdict:
    """The verdict of one delayed row (with a token overhead) on the throughputs `tp`, its
    asynchronous schedule's rate read off row `a` of them; `transfer`: the overhead's move to
    the throughputs' model size (default: `rule.default_transfer` from the two sizes)."""
    assert row.token_overhead is not None and row.baseline is not None
    share = sync_window_share(row)
    rate = a.tokens_per_s
    if share:  # window steps run at the flushed rate: time per token adds up
        flushed = a.flushed_tokens_per_s
        flushed = flushed if math.isfinite(flushed) else tp.window_tokens_per_s
        rate = 1.0 / (share / flushed + (1.0 - share) / rate)
    best = tp.best_sync()
    label, base = _label(row), _label(row.baseline)
    v = Verdict(label, base, a.name, row.token_overhead, share, rate, best, async_row=a)
    v.target, v.measured_on = row.targets["final"], model_size(row.config)
    for s in tp.sync():
        v.ratios[s.name] = time_to_target(v.target, rate / s.tokens_per_s)
    # a delayed arm short of sync's final loss that also never reaches the band's bottom is a
    # quality floor: the band says so with its own margin
    floor = v.target.missed and row.token_overhead.status == "floor"
    v.edge_factors = tp.edge_factors  # a bound below must outweigh the edge at its highest
    v.model_error = tp.model_error
    v.throughputs = tp
    n = model_params(row.config)["non_embedding"]
    v.transfer = transfer or default_transfer(
        n, tp.target_params, size_text(n), size_text(tp.target_params)
    )
    edge = v.speedup * v.edge_factors[1] / v.transfer.low
    v.verdict = at_size(v, call(row.token_overhead if floor else v.target, v.ratio_all, edge))
    return v


def judge_sweep(
    rows: list[Row],
    tp: Throughputs | dict,
    fit: decision.GivenOverhead | None = None,
) -> tuple[list[Verdict], list[str]]:
    """Verdicts of every delayed row with a baseline; and why other delayed rows have none.
    `tp`: the throughputs, or per arm (`throughput.arm_of`: the cluster model costs each
    arm's own optimizer) the arm's. `fit`: an `--overhead-fit`, whose prediction interval is
    then each row's transfer."""
    verdicts, skipped = [], []
    # a delayed arm's longer planned runs extend it toward sync's final loss (`targets`):
    # read with it, not configurations of their own
    longer = longer_runs(rows)
    extensions = {id(o) for r in rows if r.baseline for o in longer.get(id(r), [])}
    for row in rows:
        if row.is_sync or (row.baseline is None and id(row) in extensions):
            continue
        if row.baseline is None or row.token_overhead is None:
            skipped.append(f"{_label(row)}: no finished synchronous baseline with its config")
            continue
        sched = async_schedule(row.policy)
        if sched is None:
            skipped.append(
                f"{_label(row)}: no pipeline schedule realises delay.policy {row.policy}"
            )
            continue
        mine = tp[arm_of(row.config)] if isinstance(tp, dict) else tp
        a = mine.async_row(sched, row.policy, int(row.config.get("pipeline.num_stages", 1)))
        if isinstance(a, str):
            skipped.append(f"{_label(row)}: {a}")
            continue
        n = model_params(row.config)["non_embedding"]
        v = judge(row, mine, a, decision.fit_transfer(fit, n) if fit else None)
        v.at_length = id(row) in extensions
        verdicts.append(v)
    return verdicts, skipped


def _rows_of(sweep_dir: Path) -> list[Row]:
    if not sweep_dir.is_dir():
        raise UserError(f"{sweep_dir} is not a directory; pass a sweep's --out (e.g. runs/demo)")
    runs = load_runs(sweep_dir)
    if not runs:
        raise UserError(
            f"{sweep_dir} holds no run directories (none with a config.json); run "
            f"`stalepipe sweep STUDY --out {sweep_dir}` or `stalepipe demo` first"
        )
    rows = build_rows(runs)
    if not any(r.is_sync and r.values for r in rows):
        raise UserError(
            f"{sweep_dir} has no finished synchronous run (delay.policy sync, no "
            "mitigation): the token overhead is measured against one; add sync runs "
            "with the same configs"
        )
    if not any(not r.is_sync and r.values for r in rows):
        raise UserError(f"{sweep_dir} has no finished delayed run: nothing to judge")
    return rows


@dataclass
class VerdictReport:
    """What `run_verdict` found and wrote."""

    verdicts: list[Verdict]
    skipped: list[str]
    throughputs: Throughputs
    inputs: list[str]
    out_dir: Path

    def text(self) -> str:
        """The full text: inputs, summary, one table per configuration, the rule."""
        return format_verdict(self.verdicts, self.skipped, self.throughputs, self.inputs)

    def summary(self) -> str:
        """The short form: inputs, the summary table and the rule."""
        lines = ["inputs:", *(f"  {line}" for line in self.inputs), ""]
        lines += [align([SUMMARY_HEADER, *summary_rows(self.verdicts)]), RULE]
        return "\n".join(lines)


def run_verdict(
    sweep_dir: str | Path,
    *,
    cluster: str | None = None,
    gpus: int | None = None,
    global_batch: str | None = None,
    inter_node_gbps: float | None = None,
    model: str | None = None,
    costs: str | None = None,
    out: str | Path | None = None,
    stages: int | None = None,
    microbatches: int | None = None,
    device: str = "h100",
    mfu: float | None = None,
    seq_len: int | None = None,
    microbatch_size: int = 1,
    fit: decision.GivenOverhead | None = None,
    no_map: bool = False,
) -> VerdictReport:
    """The verdict of the runs under `sweep_dir` on throughputs simulated on a cluster
    (`cluster`, `gpus`, `global_batch`: every configuration, `verdict.cluster`), simulated for
    one pipeline (`model` on `device`, `stages` ranks, `microbatches` per step) or measured
    (`costs` file); writes verdict.md, verdict.csv and verdict.png (with a cluster: the
    crossover map, and verdict_map.csv) into `out` (default SWEEP_DIR/verdict). Bad input
    raises UserError before anything is written."""
    sweep_dir = Path(sweep_dir)
    per_arm: dict = {}
    described: list[str] = []
    # here, not at the top: the cluster model's modules (the simulator) are imports a verdict
    # on measured costs (--costs) does not need
    from stalepipe.lab.verdict.cluster import check_modes

    check_modes(model, costs, cluster, stages, microbatches, gpus, global_batch, inter_node_gbps)
    if no_map and cluster is None:
        raise UserError("--no-map skips the cluster model's map; it needs --cluster PRESET")
    rows = _rows_of(sweep_dir)
    where = None
    if cluster is not None:
        from stalepipe.lab.verdict import cluster as cv  # here: see above

        where = cv.setting(
            model,
            cluster,
            gpus,
            global_batch,
            mfu=mfu,
            seq_len=seq_len,
            inter_node_gbps=inter_node_gbps,
        )
        judged = [r for r in rows if not r.is_sync and r.token_overhead is not None]
        arms = list(dict.fromkeys(arm_of(r.config) for r in judged)) or [where.arm]
        per_arm = cv.arm_throughputs(where, arms)
        tp = next(iter(per_arm.values()))
        described = cv.arm_lines(per_arm)
    elif costs is not None:
        tp = load_costs(costs)
    else:
        assert model is not None
        P, m = 8 if stages is None else stages, 16 if microbatches is None else microbatches
        tp = simulated(
            model,
            device,
            P,
            m,
            mfu=0.4 if mfu is None else mfu,
            seq_len=seq_len,
            microbatch_size=microbatch_size,
        )
    verdicts, skipped = judge_sweep(rows, per_arm or tp, fit)
    if not verdicts:
        raise UserError(f"no verdict for any configuration in {sweep_dir}: " + "; ".join(skipped))
    described = described or tp.describe()
    inputs = [overhead_source(sweep_dir, rows), *described, intervals_line(verdicts)]
    others = sorted({costed_as(r.config) for r in rows if costed_as(r.config)})
    if per_arm and others:
        inputs.insert(-1, "optimizers: " + "; ".join(others))
    out_dir = Path(out) if out else sweep_dir / "verdict"
    report = VerdictReport(verdicts, skipped, tp, inputs, out_dir)
    _write(report, sweep_dir.name, None if no_map else where, None if out else sweep_dir)
    return report


def _write(r: VerdictReport, title: str, where: object, within: Path | None) -> None:
    """verdict.md, .csv, .png (with a cluster verdict_map.csv), all rendered first, none
    written through a link (`fileio.write_files`; `within`: the sweep, for the default out)."""
    files: dict[str, str | bytes] = {"verdict.csv": verdict_csv(r.verdicts, r.throughputs)}
    if where is not None:
        from stalepipe.lab.verdict import cluster as cv  # here: see run_verdict

        shown = cv.headline(r.verdicts)
        arms = list(dict.fromkeys(v.arm for v in shown if v.arm is not None)) or None
        cells = cv.crossover_map(where, arms=arms)  # type: ignore[arg-type]
        files["verdict_map.csv"] = cv.map_csv(cells, shown)
        files["verdict.png"] = cv.map_plot(cells, shown, r.throughputs.title())
        r.inputs.append(cv.map_summary(cells, shown))
    else:
        files["verdict.png"] = _bars(r)
    block = decision.decision_block(r.verdicts, r.throughputs.title())
    files["verdict.md"] = (
        f"# Verdict: {md_text(title)}\n\n{md_fenced(block)}\n\nIn full:\n\n{md_fenced(r.text())}\n"
    )
    write_files(r.out_dir, files, within=within)


def _bars(r: VerdictReport) -> bytes:
    used = {v.schedule for v in r.verdicts}
    return plots.verdict_plot(
        [
            (s.name, s.tokens_per_s, s.policy)
            for s in r.throughputs.rows
            if not s.refused and (never_delays(s.policy) or s.name in used)
        ],
        [(v.label, *astuple(v.ratio), v.status()) for v in r.verdicts],
        title=r.throughputs.title(),
    )


def verdict_main(
    sweep_dir: str | Path,
    *,
    json: bool = False,
    verbose: bool = False,
    overhead: str = "",
    overhead_fit: str = "",
    **kw,
) -> str:
    """`stalepipe verdict`: the decision block (`verbose`: the full text; `overhead`: with a
    given overhead judged too; `overhead_fit`: the size ladder's fitted overhead at a target
    size) and where the files went (`json`: the summary as JSON)."""
    given = decision.given(overhead, overhead_fit)  # refused before any work
    fit = given if given is not None and given.source == "--overhead-fit" else None
    r = run_verdict(sweep_dir, fit=fit, **kw)  # type: ignore[arg-type]
    if json:
        return _json.dumps(verdict_json(r.verdicts, r.inputs, r.skipped), indent=1)
    extra = ", verdict_map.csv" if (r.out_dir / "verdict_map.csv").exists() else ""
    text = (
        r.text() if verbose else decision.decision_block(r.verdicts, r.throughputs.title(), given)
    )
    return text + f"\ntables in {r.out_dir}:\n  verdict.md, verdict.csv{extra}, verdict.png"
