"""What one checkpoint costs: seconds, and as a share of a training step and of wall time.

Run: OMP_NUM_THREADS=1 python benchmarks/checkpoint_cost.py [--repeats 5] [--skip-smollm]

Each contender is the emulator engine a run trains with (`train.emulated.EmulatorEngine`, on
CPU, fp32): `cpu-small`, and `smollm-135m` (the preset's model shape, trained here on small
batches of the packaged excerpt, since a step of the preset's 256 x 1024 tokens takes most of an
hour on two cores). Each one trains a few steps, timed, then writes `--repeats` checkpoints
through the run's own path (`EmulatorEngine.checkpoint`: the state dict, `torch.save` to a
temporary file, fsync, rename, pruning to `train.keep_last`); the median is reported. The
delayed contender (2bw + EF) also stores a second weight version and the EF buffer, the
largest checkpoint a common run writes.

`at N s` is the share of wall time a time-based checkpoint every N seconds costs
(`train.ckpt_every_s`): ckpt / (N + ckpt).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from stalepipe.config import DataConfig, ExperimentConfig, apply_overrides
from stalepipe.data import prepare_corpus
from stalepipe.presets import get_preset
from stalepipe.rundir.checkpoint import latest_checkpoint
from stalepipe.train.distributed import SINGLE_PROCESS
from stalepipe.train.emulated import EmulatorEngine
from stalepipe.train.engine import StepPlan

POLICIES = {"sync": {"delay.policy": "sync"}, "2bw+ef": {"delay.policy": "2bw", "delay.ef": "true"}}


def contenders(args: argparse.Namespace) -> list[tuple[str, ExperimentConfig]]:
    """(label, config) per model and policy, each training `args.steps` steps on CPU."""
    models = [("cpu-small", {})]
    if not args.skip_smollm:
        smollm = {  # the preset's model; CPU, fp32, a batch that fits a two-core machine
            "train.device": "cpu",
            "train.dtype": "float32",
            "data.tokenizer": "byte",
            "data.seq_len": str(args.smollm_seq),
            "train.batch_size": str(args.smollm_batch),
            "train.num_microbatches": "1",
        }
        models.append(("smollm-135m", smollm))
    out = []
    for preset, model_overrides in models:
        for policy, delay in POLICIES.items():
            cfg = apply_overrides(
                get_preset(preset),
                {
                    **model_overrides,
                    **delay,
                    "train.num_steps": str(args.steps + 1),
                    "train.warmup_steps": "0",
                    "train.progress": "false",
                    "train.keep_last": "2",
                },
            )
            out.append((f"{preset} {policy}", cfg))
    return out


def measure(cfg: ExperimentConfig, data_dir: Path, run_dir: Path, repeats: int) -> dict:
    """Train cfg.train.num_steps steps (the first one untimed), then write `repeats` checkpoints."""
    run_dir.mkdir(parents=True)
    engine = EmulatorEngine(cfg, SINGLE_PROCESS, torch.device("cpu"), data_dir, run_dir, None)
    step_s = []
    t = time.perf_counter()
    for r in engine.steps(StepPlan(cfg.train)):
        now = time.perf_counter()
        if r.step > 0:  # step 0 allocates the optimizer state and the versions
            step_s.append(now - t)
        t = now
    ckpt_s = []
    for i in range(repeats):
        t = time.perf_counter()
        engine.checkpoint(cfg.train.num_steps + i)
        ckpt_s.append(time.perf_counter() - t)
    size = latest_checkpoint(run_dir).stat().st_size
    params = sum(p.numel() for p in engine.model.parameters())
    return {"params": params, "mb": size / 2**20, "step": step_s, "ckpt": ckpt_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="checkpoints written per contender")
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per contender")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smollm-batch", type=int, default=2, help="sequences per smollm step")
    ap.add_argument("--smollm-seq", type=int, default=256, help="tokens per smollm sequence")
    ap.add_argument("--skip-smollm", action="store_true", help="only cpu-small (fast)")
    ap.add_argument("--interval", type=float, default=300.0, help="train.ckpt_every_s to price")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        data_dir = prepare_corpus(
            DataConfig(corpus="excerpt", data_dir=f"{tmp}/data"), progress=False
        )
        N = args.interval
        print(
            f"{args.threads} thread(s), median of {args.repeats} checkpoints and of "
            f"{args.steps} steps each; 'at {N:g} s' = ckpt / ({N:g} s + ckpt)"
        )
        head = f"{'contender':<20}{'params':>12}{'ckpt MB':>9}{'ckpt s':>8}{'range s':>14}"
        head += f"{'tokens/step':>13}{'step s':>8}{'ckpt/step':>11}{f'at {N:g} s':>10}"
        print(head)
        for i, (label, cfg) in enumerate(contenders(args)):
            cfg = dataclasses.replace(cfg, name=f"c{i}", out_dir=tmp)
            m = measure(cfg, Path(data_dir), Path(tmp) / f"c{i}", args.repeats)
            ckpt, step = statistics.median(m["ckpt"]), statistics.median(m["step"])
            spread = f"{min(m['ckpt']):.2f}-{max(m['ckpt']):.2f}"
            tokens = cfg.train.batch_size * cfg.data.seq_len
            print(
                f"{label:<20}{m['params']:>12,}{m['mb']:>9.1f}{ckpt:>8.2f}{spread:>14}"
                f"{tokens:>13,}{step:>8.2f}{ckpt / step:>10.2f}x{ckpt / (N + ckpt):>10.2%}",
                flush=True,
            )
            for p in (Path(tmp) / f"c{i}").glob("ckpt_*.pt"):
                p.unlink()  # free the disk before the next contender


if __name__ == "__main__":
    main()
