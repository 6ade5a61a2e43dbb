"""What one checkpoint costs, the old single file against DCP shards, side by side.

Run: OMP_NUM_THREADS=1 python benchmarks/speed/checkpoint_cost.py [--repeats 3] [--skip-smollm]

Each contender is the emulator engine a run trains with (`train.emulated.EmulatorEngine`, on
CPU, fp32) at `--stages` pipeline stages: `cpu-small`, and `smollm-135m` (the preset's model
shape, trained here on small batches of the packaged excerpt). After a few steps its state is
written `--repeats` times in each format:

- old: the single file `ckpt_<k>.pt` of older versions (`save_legacy_checkpoint`: the whole
  state, `torch.save` to a temporary file, fsync, rename), which every runtime rank read whole;
- new: one DCP shard per stage, as the runtime's processes write them (`flatten_part` of the
  stage's state, `rundir.sharded.save_part`; here one after the other in one process), then
  the commit (manifest, rename).

Loading is measured per rank, each load in a fresh spawned process (so its peak RSS is its
own): rank r re-splits the checkpoint for stage r (`checkpoint_parts.stage_state`), through
`open_checkpoint`. `read MB` is the bytes the process read from files (`rchar` of
/proc/self/io, page cache included), `peak MB` its peak RSS above its RSS before the load.
The median of the repeats is reported.

The new format is loaded three ways (issue 39, `rundir.verified`), side by side:
- `new`: as every load does, the metadata unpickled safely and every byte read checked
  against the SHA-256 the save recorded;
- `new-nover`: the same checkpoint with its digests removed from checkpoint.json (what a
  checkpoint of an older version loads as): the safe unpickler, no hashing;
- `new-torch`: torch's own `FileSystemReader` (plain `pickle.load` of `.metadata`, no
  checks): how loads read before issue 39, the cost floor.
`hash s` is the part of `save s` spent hashing the shards (`verified.shard_digests`, timed
again on the written files).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from stalepipe.config import DataConfig, ExperimentConfig, apply_overrides
from stalepipe.data import prepare_corpus
from stalepipe.presets import get_preset
from stalepipe.rundir import verified
from stalepipe.rundir.checkpoint import commit_checkpoint, open_checkpoint, save_legacy_checkpoint
from stalepipe.rundir.checkpoint_parts import flatten_part, saved_split, stage_state
from stalepipe.rundir.sharded import MANIFEST, ShardedCheckpoint, save_part
from stalepipe.schedules.plan import StepPlan
from stalepipe.train.distributed import SINGLE_PROCESS
from stalepipe.train.emulated import EmulatorEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import parser, pin_threads, proc_status_kb, timing_args

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
                    "pipeline.num_stages": str(args.stages),
                    "train.num_steps": str(args.steps + 1),
                    "train.warmup_steps": "0",
                    "train.progress": "false",
                },
            )
            out.append((f"{preset} {policy}", cfg))
    return out


def _status_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, in MiB; ru_maxrss would carry the
    spawning parent's peak across exec."""
    return proc_status_kb(field) / 1024


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def _torch_reader() -> None:
    """Make `ShardedCheckpoint` read as before issue 39: torch's FileSystemReader, pickle."""
    import io
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    verified.load_metadata = lambda data, where: pickle.load(io.BytesIO(data))  # noqa: S301

    class Plain(FileSystemReader):
        def finish(self) -> None: ...

        def close(self) -> None: ...

    verified.make_reader = lambda shard, md, verifier: Plain(shard)
    verified.Verifier.read_small = lambda self, rel: (self.ckpt / rel).read_bytes()


def _load_rank(path: str, stage: int, threads: int, torch_reader: bool = False) -> dict:
    """One rank's load, in its own process: what `PipelineEngine._resume` reads for `stage`."""
    import torch.distributed.checkpoint  # noqa: F401 - imported before the clock starts

    if torch_reader:
        _torch_reader()
    pin_threads(threads)
    base_rss, base_read, t = _status_mb("VmRSS"), _rchar(), time.perf_counter()
    flat = open_checkpoint(Path(path))
    _, _, names = saved_split(flat)
    stage_state(
        flat, [stage], names, {"state": {}, "param_groups": []}, [set()] * len(names)
    )  # reads every kept version
    seconds = time.perf_counter() - t
    peak = _status_mb("VmHWM") - base_rss
    return {"s": seconds, "read": (_rchar() - base_read) / 2**20, "peak": peak}


def _save_both(engine: EmulatorEngine, cfg: ExperimentConfig, run_dir: Path, step: int) -> dict:
    """Write the state at `step` in both formats; seconds each."""
    state = {
        "config": cfg.to_dict(),
        "model": engine.model.state_dict(),
        "engine": engine.emulator.state_dict(),
        "rng": torch.get_rng_state(),
    }
    t = time.perf_counter()
    save_legacy_checkpoint(run_dir, step, state)
    old = time.perf_counter() - t
    t = time.perf_counter()
    delayed = engine.emulator.delayed.state_dict()
    shards = []
    weights = dict(engine.model.named_parameters())  # a tied head once, as its owner
    for s, names in enumerate(delayed["names"]):
        own = {n: weights[n].detach() for n in names}
        tensors, meta = flatten_part(delayed, [s], own, torch.get_rng_state() if s == 0 else None)
        shards.append(save_part(run_dir, step, s, tensors, meta).name)
    manifest = {"config": cfg.to_dict(), "ranks": list(range(len(delayed["names"])))}
    final = commit_checkpoint(run_dir, step, manifest, keep_last=10**6)
    new = time.perf_counter() - t
    t = time.perf_counter()
    for name in shards:  # the hashing save_part did, again on the same files
        ranges: dict[str, list[tuple[int, int]]] = {}
        for info in ShardedCheckpoint(final)._shards[final / name].storage_data.values():
            ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
        verified.shard_digests(final / name, ranges)
    return {"old": old, "new": new, "hash": time.perf_counter() - t}


def _without_digests(ckpt: Path, to: Path) -> Path:
    """`ckpt` as a version before issue 39 wrote it: the same files (hard links), no digests."""
    to.mkdir()
    for f in ckpt.rglob("*"):
        if f.is_file() and f.name != MANIFEST:
            (to / f.relative_to(ckpt)).parent.mkdir(parents=True, exist_ok=True)
            os.link(f, to / f.relative_to(ckpt))
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest.pop("files")
    (to / MANIFEST).write_text(json.dumps(manifest))
    return to


def measure(cfg: ExperimentConfig, data_dir: Path, run_dir: Path, args) -> dict:
    """Train, then save `args.repeats` times in both formats and load each rank's part."""
    run_dir.mkdir(parents=True)
    engine = EmulatorEngine(cfg, SINGLE_PROCESS, torch.device("cpu"), data_dir, run_dir, None)
    for _ in engine.steps(StepPlan(cfg.train)):
        pass
    step = cfg.train.num_steps
    for i in range(args.repeats):
        (run_dir / f"r{i}").mkdir()
    saves = [_save_both(engine, cfg, run_dir / f"r{i}", step) for i in range(args.repeats)]
    for i in range(args.repeats):
        _without_digests(run_dir / f"r{i}" / f"ckpt_{step:08d}", run_dir / f"r{i}" / "nover")
    pool = mp.get_context("spawn")
    out = {"save": saves, "load": {}}
    for fmt, name, torch_reader in (
        ("old", f"ckpt_{step:08d}.pt", False),
        ("new", f"ckpt_{step:08d}", False),
        ("new-nover", "nover", False),
        ("new-torch", f"ckpt_{step:08d}", True),
    ):
        for r in range(cfg.pipeline.num_stages):
            runs = []
            for i in range(args.repeats):
                with pool.Pool(1) as p:
                    where = str(run_dir / f"r{i}" / name)
                    runs.append(p.apply(_load_rank, (where, r, 1, torch_reader)))
            out["load"][fmt, r] = runs
        files = [p for p in (run_dir / "r0" / name).rglob("*") if p.is_file()]
        out[fmt + "_mb"] = sum(p.stat().st_size for p in (files or [run_dir / "r0" / name]))
    return out


def _print(label: str, m: dict, stages: int) -> None:
    med = statistics.median
    for fmt in ("old", "new", "new-nover", "new-torch"):
        save = med(s[fmt.split("-")[0]] for s in m["save"])
        hashed = f"{med(s['hash'] for s in m['save']):.2f}" if fmt == "new" else ""
        for r in range(stages):
            runs = m["load"][fmt, r]
            print(
                f"{label:<20}{fmt:>10}{m[fmt + '_mb'] / 2**20:>9.1f}{save:>8.2f}{hashed:>8}"
                f"{r:>6}{med(x['s'] for x in runs):>8.2f}{med(x['read'] for x in runs):>9.1f}"
                f"{med(x['peak'] for x in runs):>9.1f}",
                flush=True,
            )
    for r in range(stages):  # verification's share of one rank's load, paired by repeat
        ratio = [a["s"] / b["s"] for a, b in zip(m["load"]["new", r], m["load"]["new-nover", r])]
        print(
            f"{label:<20}  rank {r}: verified / unverified load {med(ratio):.3f} (median of pairs)"
        )


def main() -> None:
    ap = parser(__doc__)
    timing_args(ap, repeats=3, threads=1)  # repeats: saves and loads per contender
    ap.add_argument("--steps", type=int, default=2, help="training steps before the saves")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages (= runtime ranks)")
    ap.add_argument("--smollm-batch", type=int, default=2, help="sequences per smollm step")
    ap.add_argument("--smollm-seq", type=int, default=256, help="tokens per smollm sequence")
    ap.add_argument("--skip-smollm", action="store_true", help="only cpu-small (fast)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    args = ap.parse_args()
    pin_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        data_dir = prepare_corpus(
            DataConfig(corpus="excerpt", data_dir=f"{tmp}/data"), progress=False
        )
        print(
            f"{args.stages} stages, {args.threads} thread(s), median of {args.repeats}; load = "
            f"one rank's load in a fresh process (read: bytes read, peak: RSS above its start)"
        )
        print(
            f"{'contender':<20}{'fmt':>10}{'ckpt MB':>9}{'save s':>8}{'hash s':>8}{'rank':>6}"
            f"{'load s':>8}"
            f"{'read MB':>9}{'peak MB':>9}"
        )
        for i, (label, cfg) in enumerate(contenders(args)):
            cfg = dataclasses.replace(cfg, name=f"c{i}", out_dir=tmp)
            _print(label, measure(cfg, Path(data_dir), Path(tmp) / f"c{i}", args), args.stages)
            shutil.rmtree(Path(tmp) / f"c{i}")  # free the disk before the next contender


if __name__ == "__main__":
    main()
