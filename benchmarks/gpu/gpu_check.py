"""The first GPU run: does stalepipe's CUDA path work, and are its numbers true?

Runs from the source tree with the machine's own CUDA PyTorch (`benchmarks/gpu/gpu_check.sh` sets
PYTHONPATH=src; nothing is installed). On one H100/H200 it takes under 8 minutes:

- the emulator on smollm-135m in bf16: sync / 2bw / 2bw+EF, with AdamW and with Muon, eager and
  compiled (`train.compile`), through the training loop: tokens/s after the warm-up steps
  (`rundir.metrics.TIMING_WARMUP_STEPS`), MFU against this exact GPU's dense bf16 peak, peak
  memory, final loss;
- resume on the GPU: a run interrupted after a checkpoint and resumed ends with the weights of
  the uninterrupted run (deterministic algorithms on, for both);
- the pipeline runtime's CUDA path (NCCL, one process per GPU) at the largest stage count the
  GPUs allow, with 2bw and with ZB-V's two stages per process (on one GPU: both stages in one
  process, the hand-over and the tied embedding local, the split backward on CUDA).

Output: one table on stdout and a JSON file (`--json`). Exit 0 when every check passed, 1 when
one failed or was skipped, 2 when a package the check needs is missing (the line says which
wheels to bring). Without CUDA it stops with one line; `--cpu-smoke` runs the same checks
reduced to cpu-small on the CPU (eager only; gloo for the runtime), so the script itself is
tested everywhere (the test narrows the model further with `--set`, config overrides over the
check's own).

    benchmarks/gpu/gpu_check.sh [--steps 20] [--json gpu_check.json] [--budget-s 450] [--no-compile]
    benchmarks/gpu/gpu_check.sh --cpu-smoke [--set model.dim=64 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import parser
from benchmarks.gpu.gpu_machine import describe_machine, preflight, scratch

POLICIES = {
    "sync": {"delay.policy": "sync"},
    "2bw": {"delay.policy": "2bw", "pipeline.num_stages": "4"},
    "2bw+EF": {"delay.policy": "2bw", "delay.ef": "true", "pipeline.num_stages": "4"},
}
OPTIMIZERS = ("adamw", "muon")


@dataclass
class Row:
    """One line of the table (and of the JSON file)."""

    check: str
    engine: str
    policy: str
    optim: str
    compile: bool
    tokens_per_s: float = math.nan
    mfu: float = math.nan
    peak_gib: float = math.nan
    loss: float = math.nan
    timed_from_step: int | None = None
    status: str = "ok"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Setup:
    """What every run of the check shares."""

    cuda: bool
    steps: int
    work: Path
    overrides: dict[str, str]
    base: str  # preset name
    deadline: float
    num_gpus: int = 0


def setup(args: argparse.Namespace, work: Path) -> Setup:
    import torch

    from stalepipe.training.rundir.metrics import TIMING_WARMUP_STEPS

    cuda = not args.cpu_smoke
    timed = args.steps if args.steps is not None else 20 if cuda else 3
    steps = TIMING_WARMUP_STEPS + timed
    common = {
        "data.corpus": "excerpt",
        "train.num_steps": str(steps),
        "train.log_every": "1",
        "train.eval_every": "0",
        "train.num_eval_batches": "1",
        "train.warmup_steps": "2",
        "train.lr_schedule": "constant",
        "train.ckpt_every_s": "0",
        "train.keep_last": "3",
        "train.progress": "false",
    }
    if cuda:
        common |= {
            "data.tokenizer": "gpt2",
            "train.batch_size": "32",
            "train.num_microbatches": "4",
            "train.device": "cuda",
            "train.dtype": "bfloat16",
        }
    else:
        common |= {"train.batch_size": "8", "train.num_microbatches": "2", "train.threads": "1"}
    for kv in getattr(args, "set", None) or ():  # the user's, over the mode's
        key, sep, value = kv.partition("=")
        if not sep:
            raise SystemExit(f"gpu_check: --set expects KEY=VALUE, got {kv!r}")
        common[key] = value
    return Setup(
        cuda=cuda,
        steps=steps,
        work=work,
        overrides=common,
        base="smollm-135m" if cuda else "cpu-small",
        deadline=time.monotonic() + args.budget_s,
        num_gpus=torch.cuda.device_count() if cuda else 0,
    )


def config(s: Setup, name: str, **overrides: str):
    from stalepipe.config import apply_overrides
    from stalepipe.presets import get_preset

    over = {**s.overrides, **overrides, "name": name, "out_dir": str(s.work / "runs")}
    return apply_overrides(get_preset(s.base), over)


def last_record(run_dir: Path) -> dict[str, Any]:
    from stalepipe.training.rundir.metrics import read_metrics

    return [r for r in read_metrics(run_dir) if "tokens_per_s" in r][-1]


def fill(row: Row, run_dir: Path, loss: float) -> Row:
    rec = last_record(run_dir)
    row.tokens_per_s, row.loss = rec["tokens_per_s"], loss
    row.mfu = rec.get("mfu", math.nan)
    row.peak_gib = rec.get("peak_mem_gib", math.nan)
    row.timed_from_step = rec.get("timed_from_step")
    if not math.isfinite(loss):
        row.status, row.note = "FAIL", "non-finite loss"
    return row


def emulator_config(s: Setup, policy: str, optim: str, compiled: bool):
    name = f"emu-{policy.replace('+', '_')}-{optim}-{'compiled' if compiled else 'eager'}"
    over = {**POLICIES[policy], "optim.name": optim, "train.compile": str(compiled).lower()}
    return config(s, name, **over)


def emulator_row(s: Setup, policy: str, optim: str, compiled: bool) -> Row:
    import torch

    from stalepipe.training.train.loop import train

    row = Row("throughput", "emulator", policy, optim, compiled)
    if s.cuda:
        torch.cuda.reset_peak_memory_stats()
    if compiled:
        # A fresh start: past its cache's size limit dynamo would run eager without a word;
        # inductor's disk cache keeps the recompiles short.
        torch._dynamo.reset()
    result = train(emulator_config(s, policy, optim, compiled), verbose=False)
    fill(row, result.run_dir, result.final_train_loss)
    shutil.rmtree(result.run_dir)  # checkpoints of 135M-parameter runs add up
    return row


def resume_row(s: Setup) -> Row:
    """2bw+EF with AdamW: the whole run, and a copy resumed from its middle checkpoint. They
    must end bitwise equal, unless this GPU's kernels are not deterministic (a second whole run
    then differs from the first too, and the note gives both differences)."""
    import torch

    from stalepipe.training.rundir.checkpoint import (
        latest_checkpoint,
        load_checkpoint,
        remove_checkpoint,
    )
    from stalepipe.training.rundir.status import checkpoint_path
    from stalepipe.training.train.loop import train

    row = Row("resume", "emulator", "2bw+EF", "adamw", False)
    half = s.steps // 2
    total = 2 * half  # checkpoints at `half` and at the end
    over = {"train.ckpt_every": str(half), "train.num_steps": str(total)}
    cfg = config(s, "resume", **POLICIES["2bw+EF"], **over)

    def final(run_dir: Path) -> dict[str, torch.Tensor]:
        return load_checkpoint(latest_checkpoint(run_dir))["model"]

    if s.cuda:
        torch.cuda.reset_peak_memory_stats()
    torch.use_deterministic_algorithms(True, warn_only=True)  # every run alike
    try:
        full = train(cfg, verbose=False)
        crashed = s.work / "crashed"
        shutil.copytree(full.run_dir, crashed / cfg.name)
        remove_checkpoint(checkpoint_path(crashed / cfg.name, total))  # as if killed after `half`
        resumed = train(dataclasses.replace(cfg, out_dir=str(crashed)), resume=True, verbose=False)
        diff = max_abs_diff(final(full.run_dir), final(resumed.run_dir))
        noise = None
        if diff != 0.0:  # resume, or the kernels? a second whole run tells
            again = train(dataclasses.replace(cfg, name="resume-again"), verbose=False)
            noise = max_abs_diff(final(full.run_dir), final(again.run_dir))
            shutil.rmtree(again.run_dir)
    finally:
        torch.use_deterministic_algorithms(False)
    fill(row, full.run_dir, full.final_train_loss)
    same_losses = resumed.train_losses == full.train_losses[half:]
    row.extra = {
        "bitwise": diff == 0.0,
        "max_abs_diff": diff,
        "rerun_max_abs_diff": noise,
        "same_losses": same_losses,
    }
    row.note = f"resumed at step {half} of {total}: "
    if diff == 0.0:
        row.note += "bitwise equal"
    elif noise:
        row.note += f"max |diff| {diff:.3g}; two whole runs differ by {noise:.3g} (kernels)"
    else:
        row.status = "FAIL"
        row.note += f"max |diff| {diff:.3g}, while two whole runs are bitwise equal"
    shutil.rmtree(full.run_dir)
    shutil.rmtree(crashed)
    return row


def max_abs_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def runtime_stages(s: Setup) -> int:
    """The largest stage count this machine allows: one process per GPU (2 on the CPU)."""
    return min(s.num_gpus, 8) if s.cuda else 2


def runtime_config(s: Setup, P: int, v_shape: bool = False):
    """2bw on P processes (1f1b on one); or, with `v_shape`, ZB-V's two stages per process
    on P processes (one GPU runs both stages: the local hand-over, the tied embedding's two
    ends on one process, the split backward)."""
    schedule = "zb-v" if v_shape else "2bw" if P > 1 else "1f1b"
    m = max(4, 2 * P if v_shape else P)
    over = {
        "pipeline.engine": "distributed",
        "pipeline.schedule": schedule,
        "pipeline.num_stages": str(2 * P if v_shape else P),
        "pipeline.num_chunks": "2" if v_shape else "1",
        "delay.policy": "2bw" if schedule == "2bw" else "sync",
        "train.num_microbatches": str(m),
        "train.batch_size": str(8 * m if s.cuda else 2 * m),
    }
    return config(s, f"runtime-{schedule}-p{P}", **over)


def runtime_row(s: Setup, v_shape: bool = False) -> Row:
    """The runtime at the largest P this machine allows (`runtime_stages`)."""
    from stalepipe.training.launch.train import launch_train
    from stalepipe.training.rundir.metrics import read_metrics

    P = runtime_stages(s)
    cfg = runtime_config(s, P, v_shape)
    if s.cuda:  # what this process cached stays out of the workers' way
        import torch

        torch.cuda.empty_cache()
    row = Row(f"runtime P={P}", "runtime", cfg.pipeline.schedule, "adamw", False)
    code = launch_train(cfg, verbose=False)
    run_dir = Path(cfg.out_dir) / cfg.name
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    fill(row, run_dir, losses[-1] if losses else math.nan)
    if code != 0:
        row.status, row.note = "FAIL", f"exit status {code}"
    else:
        row.note = f"NCCL, {P} GPU(s), peak memory of rank 0" if s.cuda else "gloo, 2 processes"
    shutil.rmtree(run_dir)
    return row


def plan(s: Setup, compile_too: bool) -> list[tuple[Row, Any]]:
    """(the row shown if it fails or is skipped, the job) in the order they run: eager
    throughput, resume, the runtime, then compiled (slowest to start: a short budget drops
    them first)."""
    jobs: list[tuple[Row, Any]] = []
    for compiled in (False, True) if compile_too else (False,):
        for optim in OPTIMIZERS:
            for policy in POLICIES:
                stub = Row("throughput", "emulator", policy, optim, compiled)
                jobs.append((stub, lambda p=policy, o=optim, c=compiled: emulator_row(s, p, o, c)))
        if not compiled:
            jobs.append(
                (Row("resume", "emulator", "2bw+EF", "adamw", False), lambda: resume_row(s))
            )
            jobs.append((Row("runtime", "runtime", "", "adamw", False), lambda: runtime_row(s)))
            jobs.append(
                (Row("runtime", "runtime", "zb-v", "adamw", False), lambda: runtime_row(s, True))
            )
    return jobs


def run_all(s: Setup, compile_too: bool) -> list[Row]:
    rows: list[Row] = []
    for stub, job in plan(s, compile_too):
        if time.monotonic() > s.deadline:
            rows.append(dataclasses.replace(stub, status="SKIP", note="time budget spent"))
            continue
        what = "compiled" if stub.compile else "eager"
        print(f"gpu_check: {stub.check} {stub.policy} {stub.optim} {what} ...", file=sys.stderr)
        try:
            rows.append(job())
        except Exception as e:  # one broken check must not hide the others
            note = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(dataclasses.replace(stub, status="FAIL", note=note))
    return rows


def table(rows: list[Row]) -> str:
    sync = {
        (r.optim, r.compile): r.tokens_per_s
        for r in rows
        if r.policy == "sync" and r.check == "throughput"
    }
    head = (
        f"{'check':<12}{'policy':<8}{'optim':<7}{'compile':<9}{'tokens/s':>12}{'MFU':>7}"
        f"{'peak GiB':>10}{'vs sync':>9}{'loss':>9}  result"
    )
    lines = [head]
    for r in rows:
        base = sync.get((r.optim, r.compile), math.nan) if r.check == "throughput" else math.nan
        lines.append(
            f"{r.check:<12}{r.policy:<8}{r.optim:<7}{str(r.compile).lower():<9}"
            f"{r.tokens_per_s:>12,.0f}{r.mfu:>7.3f}{r.peak_gib:>10.2f}"
            f"{r.tokens_per_s / base:>9.3f}{r.loss:>9.4f}  {r.status}"
            + (f" ({r.note})" if r.note else "")
        )
    return "\n".join(lines)


def _finite(x: Any) -> Any:
    """`x` with NaN as null (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def main() -> int:
    ap = parser(__doc__, whole=True)
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per run, after the warm-up (20; 3 on CPU)",
    )
    ap.add_argument("--json", default="gpu_check.json", help="where the results go")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=450.0,
        help="start no run after this many seconds (the rest is marked skipped)",
    )
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled variants")
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="no GPU: the same checks reduced to cpu-small on the CPU (eager only)",
    )
    ap.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="a config override over the check's own (repeatable), e.g. a smaller model for "
        "a quicker --cpu-smoke (the tests' run)",
    )
    args = ap.parse_args()
    if (refused := preflight(args.cpu_smoke)) is not None:
        return refused
    from stalepipe.training.rundir.metrics import TIMING_WARMUP_STEPS

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stalepipe-gpu-check-", dir=scratch()) as tmp:
        s = setup(args, Path(tmp))
        rows = run_all(s, compile_too=s.cuda and not args.no_compile)
    machine = describe_machine(s.cuda)
    ok = all(r.status == "ok" for r in rows)
    mode = "GPU" if s.cuda else "reduced CPU mode (--cpu-smoke)"
    print(
        f"{s.base} on {machine['device']} ({mode}), torch {machine['torch']}, "
        f"{s.steps} steps per run (the first {TIMING_WARMUP_STEPS} not timed)"
    )
    print(table(rows))
    if s.cuda and machine["peak_bf16_flops"] is None:
        print(f"no MFU: {machine['device']!r} is not in stalepipe.hardware.PEAK_BF16_FLOPS")
    elapsed = time.monotonic() - t0
    print(
        f"{'all checks passed' if ok else 'SOME CHECKS FAILED OR WERE SKIPPED'} "
        f"in {elapsed:.0f} s; results in {args.json}"
    )
    out = {
        "machine": machine,
        "mode": mode,
        "steps": s.steps,
        "elapsed_s": elapsed,
        "ok": ok,
        "rows": [r.__dict__ for r in rows],
    }
    Path(args.json).write_text(json.dumps(_finite(out), indent=2, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
