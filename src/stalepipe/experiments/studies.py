"""The paper's studies as Python presets over sweep axes (`stalepipe sweep STUDY`).

Each study is a function `(scale) -> list of grids`; a grid is a list of axes (see `grid.axis`),
and the study is the union of its grids' products times the seeds. The scales, their base
configs and each optimizer's LR at each are `experiments/scales.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from stalepipe.analysis.claims import (
    ClaimCheck,
    claim_adamw_gap_exceeds_muon,
    claim_ef_recovers_gap,
    claim_gap_grows_with_delay,
    claim_momentum_shrinks_gap,
    claim_pipedream_gap_grows_with_depth,
)
from stalepipe.config import (
    ExperimentConfig,
    unknown_choice,
)
from stalepipe.errors import UserError
from stalepipe.experiments.grid import Bundle, RunSpec, axis, dedupe, expand
from stalepipe.experiments.scales import (  # noqa: F401 - studies.X names stay importable
    ALL_OPTIMIZER_NAMES,
    CPU_SCALES,
    CPU_STEPS,
    LRS,
    OPTIMIZER_NAMES,
    REGIME_STEPS,
    SCALES,
    base_config,
    optimizer_axis,
    paper_mini_base,
    regime_base,
)

SYNC: Bundle = ("sync", {"delay.policy": "sync"})
TWO_BW: Bundle = ("2bw", {"delay.policy": "2bw"})
TWO_BW_EF: Bundle = ("2bw+ef", {"delay.policy": "2bw", "delay.ef": "true"})


def _max_depth(scale: str) -> int:
    return base_config(scale).model.num_layers


def study_optimizers(scale: str) -> list[list[list[Bundle]]]:
    return [[optimizer_axis(scale), [SYNC, TWO_BW, TWO_BW_EF]]]


MOMENTA = ("0.8", "0.9", "0.95", "0.98")


def _lr_axis(scale: str, name: str) -> list[Bundle]:
    """The optimizer's LR for the scale, a third of it and three times it."""
    lr = float(LRS[scale].get(name, "1e-3"))
    return axis("optim.lr", [f"{lr / 3:.3g}", f"{lr:.3g}", f"{lr * 3:.3g}"])


def study_momentum(scale: str) -> list[list[list[Bundle]]]:
    if scale == "cpu":  # the LR held at each optimizer's (docs/RESULTS.md, Claim 3)
        opt2 = optimizer_axis(scale, ("adamw", "muon"))
        return [[opt2, axis("optim.beta1", MOMENTA), [SYNC, TWO_BW]]]
    # each momentum at three LRs, so the gap is read at each momentum's own best LR
    return [
        [optimizer_axis(scale, (name,)), axis("optim.beta1", MOMENTA), _lr_axis(scale, name),
         [SYNC, TWO_BW]]
        for name in ("adamw", "muon")
    ]  # fmt: skip


def study_mitigations(scale: str) -> list[list[list[Bundle]]]:
    steps = base_config(scale).train.num_steps
    variants: list[Bundle] = [
        SYNC,
        TWO_BW,
        TWO_BW_EF,
        ("2bw+taylor", {"delay.policy": "2bw", "delay.taylor": "0.1", "delay.taylor_adaptive": "true"}),
        ("2bw+syncstart", {"delay.policy": "2bw", "delay.sync_start": str(max(steps // 10, 1))}),
        ("2bw+synccool", {"delay.policy": "2bw", "delay.sync_cooldown": "0.2"}),
        ("2bw+ef+synccool", {"delay.policy": "2bw", "delay.ef": "true", "delay.sync_cooldown": "0.2"}),
    ]  # fmt: skip
    if scale != "cpu":  # the correctors beyond the paper (docs/delay.md; untuned lambda 0.1)
        variants += [
            ("2bw+taylor-const", {"delay.policy": "2bw", "delay.taylor": "0.1"}),
            ("2bw+dcasgd-ema", {"delay.policy": "2bw", "delay.taylor": "0.1", "delay.taylor_curvature": "ema"}),
            ("2bw+wpred", {"delay.policy": "2bw", "delay.weight_pred": "true"}),
            ("2bw+adamom", {"delay.policy": "2bw", "delay.adaptive_momentum": "true"}),
            # adaptive momentum where it was designed: per-stage delays (tau 3, 2, 1, 0 at
            # P = 4); at P = 1 under 2bw (tau = P) it sets every momentum to the 0.99 cap
            ("pipedream_P4", {"delay.policy": "pipedream", "pipeline.num_stages": "4"}),
            ("pipedream_P4+adamom", {"delay.policy": "pipedream", "pipeline.num_stages": "4",
                                     "delay.adaptive_momentum": "true"}),
            # PipeMare's LR (identity at tau = 1, so not under 2bw): stage s starts at
            # lr / tau_s and reaches lr over the first tenth of the run (the LR warmup here)
            ("pipedream_P4+pipemare", {"delay.policy": "pipedream", "pipeline.num_stages": "4",
                                       "delay.lr_correction_steps": str(max(steps // 10, 1))}),
        ]  # fmt: skip
    return [[optimizer_axis(scale, ("adamw", "muon")), variants]]


def _depths(scale: str) -> list[int]:
    return [p for p in (2, 4, 8, 16) if p <= _max_depth(scale)]


def study_depth(scale: str) -> list[list[list[Bundle]]]:
    policies = [("pipedream", {"delay.policy": "pipedream"}), TWO_BW]
    opt = optimizer_axis(scale, ("adamw",) if scale == "cpu" else ("adamw", "muon"))
    return [[opt, [SYNC]], [opt, policies, axis("pipeline.num_stages", _depths(scale))]]


def study_hparams(scale: str) -> list[list[list[Bundle]]]:
    bs = base_config(scale).train.batch_size
    grids = []
    for name in ("adamw",) if scale == "cpu" else ("adamw", "muon"):
        opt = optimizer_axis(scale, (name,))
        grids += [
            [opt, axis("train.batch_size", [bs // 2, bs, bs * 2]), [SYNC, TWO_BW]],
            [opt, _lr_axis(scale, name), [SYNC, TWO_BW]],
            [opt, _wd_axis(scale, name), [SYNC, TWO_BW]],
        ]
    return grids


def _wd_axis(scale: str, name: str) -> list[Bundle]:
    """No weight decay, the optimizer's default and three times it (AdamW 0.1, Muon 0.01)."""
    from stalepipe.optim import resolve_config  # here, not at the top: it imports torch

    wd = resolve_config(replace(base_config(scale).optim, name=name)).weight_decay
    return axis("optim.weight_decay", ["0", f"{wd:g}", f"{wd * 3:g}"])


def study_delay(scale: str) -> list[list[list[Bundle]]]:
    # N = 1 is 2bw's run: fixed:1 is the same trajectory bit for bit (tests/delay), so the
    # study shares study 1's 2bw arm instead of training it again under another name
    delays = [(f"fixed{n}", {"delay.policy": f"fixed:{n}"}) for n in (2, 4, 8)]
    return [[optimizer_axis(scale, ("adamw", "muon")), [SYNC, TWO_BW, *delays]]]


def _length(n: int, evals: int = 4) -> Bundle:
    """A training length of n steps (warmup 10%, `evals` evaluations)."""
    return (f"steps{n}", {"train.num_steps": str(n), "train.warmup_steps": str(max(n // 10, 1)),
                          "train.eval_every": str(max(n // evals, 1))})  # fmt: skip


def study_tokens(scale: str) -> list[list[list[Bundle]]]:
    tc = base_config(scale).train
    steps, evals = tc.num_steps, tc.num_steps // (tc.eval_every or tc.num_steps)
    lengths = [steps // 4, steps // 2, steps, steps * 2]
    grid_steps = [_length(n, evals) for n in lengths]
    return [[optimizer_axis(scale, ("adamw", "muon")), grid_steps, [SYNC, TWO_BW]]]


def study_length(scale: str) -> list[list[list[Bundle]]]:
    """AdamW and Muon, sync / 2bw / 2bw+EF at 1x, 2x and 4x the scale's tokens (the schedule
    stretched: warmup a tenth, the same number of evaluations); 1x is study 1's run."""
    tc = base_config(scale).train
    steps, evals = tc.num_steps, tc.num_steps // (tc.eval_every or tc.num_steps)
    lengths = [_length(n, evals) for n in (steps, steps * 2, steps * 4)]
    return [[optimizer_axis(scale, ("adamw", "muon")), lengths, [SYNC, TWO_BW, TWO_BW_EF]]]


# Model sizes of the size study: (width, SwiGLU width, heads), 4 layers each; 0.43M, 1.67M and
# 3.62M parameters at the byte vocabulary. Every size trains on the scale's tokens (the same
# budget, so larger models are further from convergence); AdamW's LR scales as 1/width from the
# scale's tuned value (the muP rule for hidden matrices), Muon's is kept (its update is
# normalised per matrix).
SIZES = ((96, 256, 4), (192, 512, 4), (288, 768, 6))


def _size(width: int, ffn: int, heads: int) -> Bundle:
    return (f"d{width}", {"model.dim": str(width), "model.ffn_dim": str(ffn),
                          "model.num_heads": str(heads)})  # fmt: skip


def study_size(scale: str) -> list[list[list[Bundle]]]:
    base_width = base_config(scale).model.dim
    grids = []
    for name in ("adamw", "muon"):
        for width, ffn, heads in SIZES:
            lr = float(LRS[scale].get(name, "1e-3"))
            lr = lr * base_width / width if name == "adamw" else lr
            opt = [(name, {"optim.name": name, "optim.lr": f"{lr:.3g}"})]
            grids.append([opt, [_size(width, ffn, heads)], [SYNC, TWO_BW, TWO_BW_EF]])
    return grids


def study_paper_mini(scale: str) -> list[list[list[Bundle]]]:
    """The CPU subset that checks the paper's four qualitative claims (docs/RESULTS.md)."""
    opt2 = optimizer_axis(scale, ("adamw", "muon"))
    adamw = optimizer_axis(scale, ("adamw",))
    return [
        # AdamW's gap >> Muon's; EF recovers most of each gap
        [opt2, [SYNC, TWO_BW, TWO_BW_EF]],
        # higher momentum shrinks the gap (AdamW beta1; 0.9 is the default run above) ...
        [adamw, axis("optim.beta1", ["0.8", "0.95", "0.98"]), [SYNC, TWO_BW]],
        # ... with beta2 0.99 (beta1 0.95/0.98 with AdamW's default beta2 0.95 are unstable here)
        [adamw, axis("optim.beta2", ["0.99"]), axis("optim.beta1", ["0.8", "0.9", "0.95", "0.98"]),
         [SYNC, TWO_BW]],
        # ... and Muon's (0.95 is the default run above)
        [optimizer_axis(scale, ("muon",)), axis("optim.beta1", ["0.8", "0.9", "0.98"]),
         [SYNC, TWO_BW]],
        # (not a claim of the list: does the gap close as training gets longer?)
        [opt2, [_length(CPU_STEPS * 2), _length(CPU_STEPS * 4)], [SYNC, TWO_BW, TWO_BW_EF]],
        # (does EF recover more where the gap is smaller? AdamW at a third of its LR)
        [[("adamw", {"optim.name": "adamw"})], axis("optim.lr", ["1e-3"]), [SYNC, TWO_BW, TWO_BW_EF]],
        # pipedream's gap grows with depth, 2bw's stays flat
        [adamw, [("pipedream", {"delay.policy": "pipedream"})], axis("pipeline.num_stages", [2, 4])],
        # 2bw's staleness is 1 on every stage at any P: P = 4 next to adamw_2bw (P = 1) shows it
        [adamw, [TWO_BW], axis("pipeline.num_stages", [4])],
    ]  # fmt: skip


@dataclass(frozen=True)
class Study:
    """A named study: its grids, what it answers, which scales it supports, and the claim
    functions (`claims.py`) its runs test, which `stalepipe report` checks."""

    name: str
    grids: Callable[[str], list[list[list[Bundle]]]]
    about: str
    scales: tuple[str, ...] = SCALES
    claims: tuple[ClaimCheck, ...] = ()

    def specs(self, scale: str, seeds: int) -> list[RunSpec]:
        if scale not in self.scales:
            raise UserError(
                f"study {self.name} runs at --scale {', '.join(self.scales)}, not {scale!r}"
            )
        specs = dedupe(s for g in self.grids(scale) for s in expand(g, seeds))
        # seed-major order: an interrupted sweep has every configuration at the first seeds
        return sorted(specs, key=lambda s: s.seed)

    def base(self, scale: str) -> ExperimentConfig:
        return base_config(scale)


STUDIES: dict[str, Study] = {
    s.name: s
    for s in [
        Study("optimizers", study_optimizers, "6 optimizers (7 with NAdamW beyond cpu) x sync / 2bw / 2bw+EF",
              claims=(claim_adamw_gap_exceeds_muon, claim_ef_recovers_gap)),
        Study("momentum", study_momentum, "AdamW & Muon beta1 in 0.8-0.98 under sync and 2bw (x 3 LRs beyond cpu)",
              claims=(claim_momentum_shrinks_gap,)),
        Study("mitigations", study_mitigations, "EF, Taylor, sync start/cooldown, EF+cooldown; the correctors beyond cpu",
              claims=(claim_ef_recovers_gap,)),
        Study("depth", study_depth, "pipedream vs 2bw for P in 2-16 (AdamW, + Muon beyond cpu)",
              claims=(claim_pipedream_gap_grows_with_depth,)),
        Study("hparams", study_hparams, "batch size, LR, weight decay (one at a time; AdamW, + Muon beyond cpu)"),
        Study("delay", study_delay, "sync, 2bw (N = 1) and fixed:N for N in 2, 4, 8",
              claims=(claim_gap_grows_with_delay,)),
        Study("tokens", study_tokens, "the gap as the training length grows (x1/4 .. x2)"),
        Study("length", study_length, "AdamW & Muon sync / 2bw / 2bw+EF at 1x, 2x, 4x the tokens"),
        Study("size", study_size, "AdamW & Muon sync / 2bw / 2bw+EF at 0.43M, 1.7M, 3.6M params",
              scales=CPU_SCALES[1:]),
        Study("paper-mini", study_paper_mini, "CPU check of the paper's 4 qualitative claims",
              scales=("cpu",),
              claims=(claim_adamw_gap_exceeds_muon, claim_ef_recovers_gap,
                      claim_momentum_shrinks_gap, claim_pipedream_gap_grows_with_depth)),
    ]
}  # fmt: skip


def declared_claims() -> list[ClaimCheck]:
    """Every claim function some study declares, each once, in the order of first declaration
    (the report's claims table follows it)."""
    return list(dict.fromkeys(c for s in STUDIES.values() for c in s.claims))


def get_study(name: str) -> Study:
    """The study `name`; an unknown name raises ConfigError suggesting the closest one (`toy`
    is not a study here: `stalepipe sweep toy` runs the `stalepipe toy` command)."""
    if name not in STUDIES:
        raise unknown_choice("study", name, STUDIES)
    return STUDIES[name]


# Core-seconds per step of each CPU scale's base config (spawn, evals and checkpoints included),
# measured on a 2-core machine shared with other jobs. `cpu`: over the paper-mini sweep, 0.09 s
# at a load of ~3, 0.18 s at ~8. `cpu-regime`: benchmarks/regime_throughput.py at a load of
# ~5 (AdamW; 247 s per 1200-step run with its 20 evals; docs/RESULTS.md "Regime"). Used only
# for the estimates in `stalepipe sweep --help` / --dry-run.
CPU_SECONDS_PER_STEP = {"cpu": 0.1, "cpu-regime": 0.2}


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{max(seconds / 60, 1):.0f} min"


def estimate_cpu_seconds(specs: list[RunSpec], base: ExperimentConfig, scale: str = "cpu") -> float:
    """Core-seconds of a sweep at CPU scale `scale`: steps x the base's per-step cost, scaled
    by tokens per step (read from the overrides, so no config is built: `stalepipe --help`
    stays fast)."""
    total, base_tokens = 0.0, base.train.batch_size * base.data.seq_len
    for spec in specs:
        o = spec.overrides
        steps = int(o.get("train.num_steps", base.train.num_steps))
        batch = int(o.get("train.batch_size", base.train.batch_size))
        seq = int(o.get("data.seq_len", base.data.seq_len))
        total += steps * CPU_SECONDS_PER_STEP[scale] * batch * seq / base_tokens
    return total


# The GPU estimate's assumptions: one H100 SXM per run at 40% model FLOPs utilisation (what a
# tuned dense LLaMA-style run reaches in bf16; pipeline bubbles and evaluations not counted).
GPU_DEVICE, GPU_MFU = "h100", 0.4


def estimate_gpu_seconds(specs: list[RunSpec], base: ExperimentConfig) -> float:
    """GPU-seconds of a sweep on `GPU_DEVICE` at `GPU_MFU`: each run's training FLOPs (the
    model's per-token count, attention included, times its tokens) over the device's peak."""
    from stalepipe.models import flops_per_token
    from stalepipe.sim.devices import get_device

    rate = get_device(GPU_DEVICE).peak_flops * GPU_MFU
    total = 0.0
    for spec in specs:
        cfg = spec.config(base, ".")
        tokens = cfg.train.num_steps * cfg.train.batch_size * cfg.data.seq_len
        total += flops_per_token(cfg.model, cfg.data.seq_len)["total"] * tokens / rate
    return total


def study_table(seeds: int = 3, scale: str = "cpu") -> str:
    """One line per study: its runs at `scale` and the CPU core-hours (CPU scales) or the
    GPU-hours (`estimate_gpu_seconds`) they take."""
    lines = []
    for s in STUDIES.values():
        if scale not in s.scales:
            continue
        specs = s.specs(scale, seeds)
        if scale in CPU_SCALES:
            cost = f"~{estimate_cpu_seconds(specs, s.base(scale), scale) / 3600:4.1f} CPU core-h"
        else:
            cost = f"~{estimate_gpu_seconds(specs, s.base(scale)) / 3600:6.0f} GPU-h"
        lines.append(f"  {s.name:<12} {len(specs):>4} runs  {cost}   {s.about}")
    if scale == "cpu":
        lines.append(
            "  toy          (seconds) delayed Muon +- EF on matrix least squares: theory check"
        )
    return "\n".join(lines)


def sweep_main(
    study: str | None,
    *,
    scale: str = "cpu",
    seeds: int = 3,
    workers: int = 1,
    out: str | None = None,
    grids: list[str] = (),  # type: ignore[assignment]
    fixed: dict[str, str] | None = None,
    only: Sequence[str] = (),
    retry_failed: bool = False,
    dry_run: bool = False,
    log: Callable[[str], None] | None = None,
) -> int:
    """`stalepipe sweep`: run a named study or an ad-hoc grid (`--grid KEY=V1,V2` axes); returns
    the number of failed runs. `fixed` overrides apply to every run (e.g. train.num_steps);
    `only` (`--only KEY=V1,V2`) keeps the runs that match (`grid.select_runs`)."""
    from stalepipe.config import apply_overrides
    from stalepipe.experiments.grid import check_overrides, parse_grid_arg, select_runs
    from stalepipe.experiments.sweep import main_progress_stream, run_sweep

    log = log or main_progress_stream()
    if seeds < 1:
        raise UserError(f"--seeds must be >= 1, got {seeds}")
    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    if study is None and not grids:
        raise UserError("name a STUDY or give at least one --grid KEY=V1,V2 (see --help)")
    if study is not None and grids:
        raise UserError("--grid builds an ad-hoc sweep; drop the STUDY name to use it")
    if study is not None:
        st = get_study(study)
        specs = st.specs(scale, seeds)
        base = st.base(scale)
    else:
        specs = dedupe(expand([parse_grid_arg(g) for g in grids], seeds))
        base = base_config(scale)
    base = apply_overrides(base, fixed or {})
    check_overrides(specs, base)
    specs = select_runs(specs, base, only)
    out_dir = out or f"runs/{study or 'grid'}"
    if dry_run:
        _dry_run(specs, base, out_dir, scale, workers, retry_failed, log)
        return 0
    res = run_sweep(specs, base, out_dir, workers=workers, retry_failed=retry_failed, log=log)
    log(f"next: stalepipe report {out_dir}")
    return len(res.failed)


def _dry_run(
    specs: list[RunSpec],
    base: ExperimentConfig,
    out_dir: str,
    scale: str,
    workers: int,
    retry_failed: bool,
    log: Callable[[str], None],
) -> None:
    """`stalepipe sweep --dry-run`: each run's status and overrides, and the CPU time left."""
    from stalepipe.experiments.sweep import plan_status

    todo = []
    plan = plan_status(specs, base, Path(out_dir))
    for p in plan:
        shown = " ".join(f"--{k} {v}" for k, v in p.spec.overrides.items())
        if p.same:
            log(f"{'same':<9} {p.spec.name}: the same run as {p.same} (not repeated)")
            continue
        log(f"{p.status:<9} {p.spec.name}: {shown}")
        if p.status != "finished" and (p.status != "failed" or retry_failed):
            todo.append(p.spec)
    same = sum(bool(p.same) for p in plan)
    msg = f"{len(specs)} runs" + (f" ({same} the same as another)" if same else "")
    msg += f", {len(todo)} to run"
    if scale in CPU_SCALES and todo:
        cost = estimate_cpu_seconds(todo, base, scale)
        msg += (f": ~{_duration(cost)} of CPU core time (~{_duration(cost / workers)} with "
                f"{workers} worker(s) on a lightly loaded machine)")  # fmt: skip
    elif todo:
        cost = estimate_gpu_seconds(todo, base)
        msg += (f": ~{cost / 3600:.0f} GPU-hours on one {GPU_DEVICE.upper()} per run at "
                f"{GPU_MFU:.0%} MFU (bubbles and evaluations not counted)")  # fmt: skip
    log(msg)
