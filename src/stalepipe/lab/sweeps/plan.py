"""Planning a sweep: what a study costs (CPU core-hours or GPU-hours), the table of studies
`stalepipe sweep --help` shows, and `stalepipe sweep`'s entry point with its dry run. The
studies themselves are one module each in `studies/` (`studies/registry.py`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalepipe.config import ExperimentConfig, apply_overrides
from stalepipe.config.shapes import flops_per_token
from stalepipe.errors import UserError
from stalepipe.lab.studies.registry import STUDIES, get_study
from stalepipe.lab.studies.scales import CPU_SCALES, base_config
from stalepipe.lab.sweeps.executors import EXECUTORS, SlurmOptions, check_slurm, sbatch_script
from stalepipe.lab.sweeps.grid import (
    RunSpec,
    check_overrides,
    dedupe,
    expand,
    extend_delayed,
    parse_grid_arg,
    select_runs,
)

if TYPE_CHECKING:
    from stalepipe.lab.sweeps.sweep import Trainer

# Core-seconds per step of each CPU scale's base config (spawn, evals and checkpoints included),
# measured on a 2-core machine shared with other jobs. `cpu`: over the paper-mini sweep, 0.09 s
# at a load of ~3, 0.18 s at ~8. `cpu-regime`: benchmarks/speed/regime_throughput.py at a load of
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
    # here, not at the top: `sweep --help` imports this module and never estimates GPU time
    from stalepipe.hardware import get_device

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
    lines, elsewhere = [], []
    for s in STUDIES.values():
        if scale not in s.scales:  # named all the same, with the scales it runs at
            where = f"(--scale {', '.join(s.scales)} only)"
            elsewhere.append(f"  {s.name:<19} {where:<27} {s.about}")
            continue
        try:
            specs = s.specs(scale, seeds)
        except UserError as e:  # a phase that waits for an earlier one (ladder: ladder-lr)
            lines.append(f"  {s.name:<12}    - runs  (not yet: {str(e).split(':')[0]})")
            continue
        if scale in CPU_SCALES:
            cost = f"~{estimate_cpu_seconds(specs, s.base(scale), scale) / 3600:4.1f} CPU core-h"
        else:
            cost = f"~{estimate_gpu_seconds(specs, s.base(scale)) / 3600:6.0f} GPU-h"
        lines.append(f"  {s.name:<12} {len(specs):>4} runs  {cost}   {s.about}")
    if scale == "cpu":
        lines.append(
            "  toy          (seconds) delayed Muon +- EF on matrix least squares: theory check"
        )
    return "\n".join([*lines, *elsewhere])


def sweep_main(
    study: str | None,
    trainer: Trainer,
    *,
    scale: str = "cpu",
    seeds: int = 3,
    workers: int | None = 1,
    out: str | None = None,
    grids: list[str] = (),  # type: ignore[assignment]
    fixed: dict[str, str] | None = None,
    only: Sequence[str] = (),
    retry_failed: bool = False,
    dry_run: bool = False,
    log: Callable[[str], None] | None = None,
    executor: str = "local",
    slurm: SlurmOptions | None = None,
    extend: Sequence[float] = (),
    lengths: Sequence[float] = (),
) -> int:
    """`stalepipe sweep`: run a named study or an ad-hoc grid (`--grid KEY=V1,V2` axes); returns
    the number of failed runs; `trainer` trains each run (`sweep.Trainer`). `fixed` overrides apply to every run (e.g. train.num_steps);
    `only` (`--only KEY=V1,V2`) keeps the runs that match (`grid.select_runs`); `executor`
    and `slurm` say where the runs execute (`sweeps/executors.py`)."""
    # here, not at the top: the sweep (its workers, multiprocessing, the results reader) is
    # ~45 ms that `sweep --help` would pay for nothing
    from stalepipe.lab.sweeps.sweep import main_progress_stream, run_sweep

    log = log or main_progress_stream()
    if workers is None:
        workers = _default_workers(fixed or {}, study, scale)
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
    longer = [*extend_delayed(specs, base, extend), *extend_delayed(specs, base, lengths, True)]
    specs = dedupe([*specs, *longer])  # complete runs planned longer, toward sync's final loss
    out_dir = out or f"runs/{study or 'grid'}"
    slurm = _executor_options(executor, slurm, specs, base, dry_run)
    if dry_run:
        todo = _dry_run(specs, base, out_dir, scale, workers, retry_failed, log)
        if executor == "slurm" and todo:
            log(f"sbatch script of the job array ({todo} tasks), exactly as it would be submitted:")
            print(sbatch_script(Path(out_dir), slurm or SlurmOptions(), todo), flush=True)
        return 0
    res = run_sweep(
        trainer,
        specs,
        base,
        out_dir,
        workers=workers,
        retry_failed=retry_failed,
        log=log,
        executor=executor,
        slurm=slurm,
    )
    log(f"next: stalepipe report {out_dir}")
    return len(res.failed)


def _executor_options(
    executor: str, slurm: Any, specs: Sequence[RunSpec], base: ExperimentConfig, dry_run: bool
) -> SlurmOptions | None:
    """`--executor` and `--slurm-*` checked before anything is made; the job array's options
    (`_slurm_for`) for `--executor slurm`, which off the cluster only a dry run passes
    (`executors.check_slurm`: no sweep directory left behind)."""
    if executor not in EXECUTORS:
        raise UserError(f"--executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    if slurm is not None and executor != "slurm":
        raise UserError("--slurm-* options configure --executor slurm; add it or drop them")
    if executor != "slurm":
        return slurm
    if not dry_run:
        check_slurm()
    return _slurm_for(specs, base, slurm)


def _slurm_for(specs: Sequence[RunSpec], base: ExperimentConfig, slurm: Any) -> SlurmOptions:
    """The array's options with what the runs need: a GPU each for CUDA runs, their CPUs."""
    cuda = any(
        str(s.overrides.get("train.device", base.train.device)).startswith("cuda") for s in specs
    )
    return (slurm or SlurmOptions()).for_runs(cuda, base.train.threads)


def _default_workers(fixed: dict[str, str], study: str | None, scale: str) -> int:
    """One worker per visible GPU when the runs train on `cuda`, else 1."""
    base = get_study(study).base(scale) if study else base_config(scale)
    if fixed.get("train.device", base.train.device) != "cuda":
        return 1
    import torch  # here: torch, and `sweep --help` imports this module

    return max(torch.cuda.device_count(), 1)


def _dry_run(
    specs: list[RunSpec],
    base: ExperimentConfig,
    out_dir: str,
    scale: str,
    workers: int,
    retry_failed: bool,
    log: Callable[[str], None],
) -> int:
    """`stalepipe sweep --dry-run`: each run's status and overrides, and the CPU time left;
    returns how many runs it would run."""
    # here: the sweep and the lease (socket, threading) stay off `sweep --help` (see sweep_main)
    from stalepipe.lab.sweeps.sweep import plan_status
    from stalepipe.training.rundir.lease import live_owner

    todo = []
    plan = plan_status(specs, base, Path(out_dir))
    for p in plan:
        shown = " ".join(f"--{k} {v}" for k, v in p.spec.overrides.items())
        if p.same:
            log(f"{'same':<9} {p.spec.name}: the same run as {p.same} (not repeated)")
            continue
        owner = live_owner(Path(out_dir) / p.spec.name) if p.status != "finished" else None
        if owner is not None:  # trained elsewhere now: the sweep will skip it
            log(f"{'leased':<9} {p.spec.name}: trained now by {owner.describe()}")
            continue
        log(f"{p.status:<9} {p.spec.name}: {shown}")
        if p.status != "finished" and (p.status != "failed" or retry_failed):
            todo.append(p.spec)
    same = sum(bool(p.same) for p in plan)
    msg = f"{len(specs)} runs" + (f" ({same} the same as another)" if same else "")
    msg += f", {len(todo)} to run"
    if scale in CPU_SCALES and todo:
        cost = estimate_cpu_seconds(todo, base, scale)
        msg += (
            f": ~{_duration(cost)} of CPU core time (~{_duration(cost / workers)} with "
            f"{workers} worker(s) on a lightly loaded machine)"
        )
    elif todo:
        cost = estimate_gpu_seconds(todo, base)
        msg += (
            f": ~{cost / 3600:.0f} GPU-hours on one {GPU_DEVICE.upper()} per run at "
            f"{GPU_MFU:.0%} MFU (bubbles and evaluations not counted)"
        )
    log(msg)
    return len(todo)
